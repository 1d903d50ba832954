// The CPU Adam-family kernel: one pass per element in registers (load grad, weights, m, v, ema;
// the update of csrc/include/adam_rule.h; store), over the chunk table of a bucket.
//
// Compiled with -ffp-contract=off: every multiply and add stays its own IEEE operation. sqrt and
// division are the hardware's correctly rounded instructions (through at::vec), so the bits are
// the reference backend's (multi_tensor/rules.py gives the order).
#include "adam_kernel.h"

#include <atomic>
#include <cstring>

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

namespace {

using multi_tensor_rules::AdamScalars;

// P: param storage, G: grad storage, M: math type (float, or double for fp64 buckets).
// MASTER: the update runs on fp32 masters and the param receives the rounded master.
// EMA_BF16: the EMA is stored in bf16 (float math only): loaded exactly into M, rounded once to
// nearest even on store; otherwise it is stored like m and v.
// REM: bf16 params whose fp32 master is the param plus an int16 remainder (adam_rule.h's
// join_master / split_master): the weights are joined into float on load and split on store.
template <typename P, typename G, typename M, bool MASTER, bool EMA, bool EMA_BF16 = false,
          bool REM = false>
struct AdamKernel {
  using V = Vectorized<M>;
  using S = std::conditional_t<MASTER || REM, float, P>;  // m, v (and master) storage
  using E = std::conditional_t<EMA_BF16, c10::BFloat16, S>;  // ema storage
  static_assert(!EMA_BF16 || std::is_same_v<M, float>, "a bf16 EMA is for float math");
  static constexpr int64_t B = block_size<M>();
  static_assert(!REM || (std::is_same_v<P, c10::BFloat16> && std::is_same_v<M, float>),
                "remainders are for bf16 params");

  // The masters of elements [0, n) from their params and remainders (zeros past n). The loops
  // are plain integer lanes the compiler vectorises.
  static inline void load_split(const P* pp, const int16_t* rp, int64_t n, V& a, V& b) {
    alignas(64) uint32_t x[B];
    const uint16_t* pb = reinterpret_cast<const uint16_t*>(pp);
    if (n == B) {
      for (int64_t k = 0; k < B; ++k) x[k] = multi_tensor_rules::join_master(pb[k], rp[k]);
    } else {
      for (int64_t k = 0; k < B; ++k)
        x[k] = k < n ? multi_tensor_rules::join_master(pb[k], rp[k]) : 0u;
    }
    a = V::loadu(x);
    b = V::loadu(x + V::size());
  }

  static inline void store_split(P* pp, int16_t* rp, int64_t n, const V& a, const V& b) {
    alignas(64) uint32_t x[B];
    alignas(64) uint16_t ph[B];
    alignas(64) int16_t rh[B];
    a.store(x);
    b.store(x + V::size());
    for (int64_t k = 0; k < B; ++k) multi_tensor_rules::split_master(x[k], ph[k], rh[k]);
    std::memcpy(pp, ph, n * sizeof(uint16_t));
    std::memcpy(rp, rh, n * sizeof(int16_t));
  }

  static inline void block(const AdamScalars<M>& c, const Row& r, int64_t i, int64_t n) {
    const G* gp = static_cast<const G*>(r.p[kGrad]) + i;
    P* pp = static_cast<P*>(r.p[kParam]) + i;
    S* mp = static_cast<S*>(r.p[kExpAvg]) + i;
    S* vp = static_cast<S*>(r.p[kExpAvgSq]) + i;
    S* wp = MASTER ? static_cast<S*>(r.p[kMaster]) + i : reinterpret_cast<S*>(pp);
    int16_t* rp = REM ? static_cast<int16_t*>(r.p[kRemainder]) + i : nullptr;
    E* sp = EMA ? static_cast<E*>(r.p[kEma]) + i : nullptr;
    V g[2], w[2], m[2], v[2], s[2];
    load_block<G, M>(gp, n, g[0], g[1]);
    if constexpr (REM) {
      load_split(pp, rp, n, w[0], w[1]);
    } else {
      load_block<S, M>(wp, n, w[0], w[1]);
    }
    load_block<S, M>(mp, n, m[0], m[1]);
    load_block<S, M>(vp, n, v[0], v[1]);
    if constexpr (EMA) load_block<E, M>(sp, n, s[0], s[1]);
    for (int h = 0; h < 2; ++h) multi_tensor_rules::adam_update<EMA>(c, g[h], w[h], m[h], v[h], s[h]);
    store_block<S, M>(mp, n, m[0], m[1]);
    store_block<S, M>(vp, n, v[0], v[1]);
    if constexpr (EMA) store_block<E, M>(sp, n, s[0], s[1]);
    if constexpr (REM) {
      store_split(pp, rp, n, w[0], w[1]);
    } else {
      if constexpr (MASTER) store_block<S, M>(wp, n, w[0], w[1]);
      store_block<P, M>(pp, n, w[0], w[1]);
    }
  }

  static void run(const Chunk* chunks, int64_t count, const Row* rows, const void* scalars) {
    // A local copy: stores through the data pointers cannot alias it, so the scalars stay in
    // registers across the loop.
    const AdamScalars<M> c = *static_cast<const AdamScalars<M>*>(scalars);
    for (int64_t k = 0; k < count; ++k) {
      const Chunk& ch = chunks[k];
      const Row& r = rows[ch.row];
      int64_t i = ch.start;
      for (; i + B <= ch.end; i += B) block(c, r, i, B);
      if (i < ch.end) block(c, r, i, ch.end - i);
    }
  }
};

template <typename P, typename M, bool MASTER, bool EMA, bool EMA_BF16, bool REM = false>
KernelFn for_grad(c10::ScalarType gt) {
  if constexpr (std::is_same_v<M, double>) {
    return &AdamKernel<double, double, double, false, EMA>::run;
  } else {
    switch (gt) {
      case c10::kFloat: return &AdamKernel<P, float, float, MASTER, EMA, EMA_BF16, REM>::run;
      case c10::kHalf: return &AdamKernel<P, c10::Half, float, MASTER, EMA, EMA_BF16, REM>::run;
      default: return &AdamKernel<P, c10::BFloat16, float, MASTER, EMA, EMA_BF16, REM>::run;
    }
  }
}

// EMA_BF16: a bf16 EMA beside state of another dtype (a bf16 EMA of bf16 params without masters
// is their plain path).
template <bool EMA, bool EMA_BF16>
KernelFn for_param(c10::ScalarType pt, c10::ScalarType gt, bool master, bool remainder) {
  if (remainder) return for_grad<c10::BFloat16, float, false, EMA, EMA_BF16, true>(gt);
  switch (pt) {
    case c10::kDouble: return for_grad<double, double, false, EMA, false>(gt);
    case c10::kFloat:
      return master ? for_grad<float, float, true, EMA, EMA_BF16>(gt)
                    : for_grad<float, float, false, EMA, EMA_BF16>(gt);
    case c10::kHalf:
      return master ? for_grad<c10::Half, float, true, EMA, EMA_BF16>(gt)
                    : for_grad<c10::Half, float, false, EMA, EMA_BF16>(gt);
    default:
      return master ? for_grad<c10::BFloat16, float, true, EMA, EMA_BF16>(gt)
                    : for_grad<c10::BFloat16, float, false, EMA, false>(gt);
  }
}

template <typename M>
AdamScalars<M> round_scalars(py::handle h, const std::optional<at::Tensor>& grad_scale) {
  // A StepScalars is a tuple: field i at index i (step_scalars.h, generated from rules.py). The
  // size check catches an extension built from another rules.py.
  TORCH_CHECK(PyTuple_Check(h.ptr()) &&
                  PyTuple_GET_SIZE(h.ptr()) == multi_tensor_rules::kNumStepScalars,
              "AdamBucket.run(): scalars must be a multi_tensor.rules.StepScalars of ",
              multi_tensor_rules::kNumStepScalars, " fields, got ",
              py::str(py::type::handle_of(h)).cast<std::string>(), " of length ",
              PyTuple_Check(h.ptr()) ? PyTuple_GET_SIZE(h.ptr()) : -1,
              " (an extension built from another multi_tensor/rules.py?)");
  const auto t = py::reinterpret_borrow<py::tuple>(h);
  AdamScalars<M> c;
  multi_tensor_rules::read_step_scalars<M>(
      c, [&](int i) { return t[i].cast<double>(); }, [&](int i) { return t[i].cast<bool>(); });
  c.has_scale = grad_scale.has_value() && grad_scale->defined();
  c.inv_scale = M(1);
  if (c.has_scale) {
    const at::Tensor& t = *grad_scale;
    // The front end (multi_tensor/validation.py) admits only these; checked again here because an
    // empty CPU tensor would otherwise be read through a null data pointer.
    TORCH_CHECK(t.numel() == 1 && t.is_floating_point(),
                "AdamBucket.run(): grad_scale must be a 1-element floating-point tensor, got ",
                t.sizes(), " ", t.scalar_type());
    const M scale = t.is_cpu() && t.scalar_type() == c10::kFloat
                        ? static_cast<M>(*t.const_data_ptr<float>())
                        : static_cast<M>(t.reshape({-1})[0].item<double>());
    c.inv_scale = M(1) / scale;
  }
  return c;
}

template <typename G>
bool grads_nonfinite(const std::vector<Chunk>& chunks, int64_t total, const std::vector<Row>& rows) {
  std::atomic<bool> bad{false};
  launch(chunks, total, [&](const Chunk& ch) {
    using M = std::conditional_t<std::is_same_v<G, double>, double, float>;
    const G* g = static_cast<const G*>(rows[ch.row].p[kGrad]) + ch.start;
    if (has_nonfinite<G, M>(g, ch.end - ch.start)) bad.store(true, std::memory_order_relaxed);
  });
  return bad.load();
}

bool is_direct(const at::Tensor& ref, const at::Tensor& t) { return same_layout(ref, t); }

inline void prefetch_impl(const at::Tensor& t) {
  const char* c = reinterpret_cast<const char*>(t.unsafeGetTensorImpl());
  __builtin_prefetch(c);
  __builtin_prefetch(c + 64);
  __builtin_prefetch(c + 128);
  __builtin_prefetch(c + 192);
}

inline void prefetch_storage(const at::Tensor& t) {
  __builtin_prefetch(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
}

}  // namespace

AdamBucket::AdamBucket(py::handle lists, int64_t chunk_size) : chunk_size_(chunk_size) {
  // lists: a multi_tensor.schema.AdamLists, read by name (emas / masters None when absent).
  const py::object emas = lists.attr("emas");
  const py::object masters = lists.attr("masters");
  const py::object remainders = py::getattr(lists, "remainders", py::none());
  ema_ = !emas.is_none();
  master_ = !masters.is_none();
  remainder_ = !remainders.is_none();
  TORCH_CHECK(!(master_ && remainder_), "AdamBucket: masters and remainders are exclusive");
  auto take = [&](py::handle list, Slot slot) {
    std::vector<at::Tensor> ts;
    for (const at::Tensor* t : unpack_tensors(list)) {
      // The front end has checked the lists; this keeps a direct call from crashing.
      TORCH_CHECK_TYPE(t != nullptr && t->defined(), "AdamBucket: lists must hold tensors");
      ts.push_back(*t);
    }
    state_.push_back(std::move(ts));
    slots_.push_back(slot);
  };
  take(lists.attr("params"), kParam);
  take(lists.attr("exp_avgs"), kExpAvg);
  take(lists.attr("exp_avg_sqs"), kExpAvgSq);
  if (ema_) take(emas, kEma);
  if (master_) take(masters, kMaster);
  if (remainder_) take(remainders, kRemainder);
  const auto& params = state_[0];
  for (const auto& list : state_)
    TORCH_CHECK_VALUE(list.size() == params.size(), "AdamBucket: lists of different lengths");
  param_dtype_ = params.empty() ? c10::kFloat : params[0].scalar_type();
  state_dtype_ = master_ || remainder_ ? c10::kFloat : param_dtype_;
  TORCH_CHECK(!remainder_ || params.empty() || param_dtype_ == c10::kBFloat16,
              "AdamBucket: remainders are for bf16 params, got ", param_dtype_);
  ema_dtype_ = ema_ && !params.empty() ? state_[3][0].scalar_type() : state_dtype_;
  // The front end (multi_tensor/schema.py) admits only these; a kernel for anything else would
  // read the EMA with the wrong element size.
  TORCH_CHECK(ema_dtype_ == state_dtype_ ||
                  (ema_dtype_ == c10::kBFloat16 && param_dtype_ != c10::kDouble),
              "AdamBucket: the EMA must be ", state_dtype_, " or bf16 (fp16/bf16/fp32 params), got ",
              ema_dtype_);
}

// The per-step check that the grads still fit the bucket (count, dtype, shape, CPU, dense with
// real storage) and that no state tensor changed shape or dtype (`p.data = x` may swap one or
// reshape the param; a same-numel reshape must not run on state of the old shape),
// fused with gathering the data pointers. Anything unexpected returns false: the optimizer then
// plans afresh, and its full check names the problem.
bool AdamBucket::bind(py::handle grads) {
  const auto gs = unpack_tensors(grads);
  const auto& params = state_[0];
  const size_t n = params.size();
  grads_.clear();
  if (gs.size() != n) return false;
  if (n == 0) return true;
  if (!gs[0]) return false;
  const auto gt = gs[0]->scalar_type();
  const bool grad_ok = param_dtype_ == c10::kDouble
                           ? gt == c10::kDouble
                           : (gt == c10::kFloat || gt == c10::kHalf || gt == c10::kBFloat16);
  if (!grad_ok) return false;
  grad_dtype_ = gt;
  rows_.assign(n, Row{});
  staged_.clear();
  std::vector<int64_t> numels(n);
  std::vector<at::Tensor> bound;
  bound.reserve(n);
  // The metadata of thousands of small tensors is scattered over the heap, so this loop is bound
  // by cache misses: prefetch a few rows ahead (TensorImpl, then StorageImpl).
  constexpr size_t kAhead = 16;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      if (gs[i + kAhead]) prefetch_impl(*gs[i + kAhead]);
      for (const auto& list : state_) prefetch_impl(list[i + kAhead]);
    }
    if (i + kAhead / 2 < n) {
      if (gs[i + kAhead / 2]) prefetch_storage(*gs[i + kAhead / 2]);
      for (const auto& list : state_) prefetch_storage(list[i + kAhead / 2]);
    }
    const at::Tensor* g = gs[i];
    const at::Tensor& p = params[i];
    if (!g || g->scalar_type() != gt || !g->is_cpu() || g->layout() != c10::kStrided ||
        g->key_set().has(c10::DispatchKey::Python) || !g->sizes().equals(p.sizes()) ||
        p.scalar_type() != param_dtype_ || !p.is_cpu())
      return false;
    const int64_t numel = p.numel();
    bool direct = is_direct(p, *g);
    for (size_t k = 1; k < state_.size(); ++k) {
      const at::Tensor& t = state_[k][i];
      const c10::ScalarType want = slots_[k] == kEma         ? ema_dtype_
                                   : slots_[k] == kRemainder ? c10::kShort
                                                             : state_dtype_;
      if (!t.sizes().equals(p.sizes()) || !t.is_cpu() || t.scalar_type() != want)
        return false;
      direct = direct && is_direct(p, t);
    }
    bound.push_back(*g);
    numels[i] = numel;
    if (numel == 0) continue;
    if (!direct) {
      staged_.push_back(static_cast<int64_t>(i));
      continue;
    }
    Row& r = rows_[i];
    r.p[kGrad] = const_cast<void*>(g->const_data_ptr());
    for (size_t k = 0; k < state_.size(); ++k) r.p[slots_[k]] = state_[k][i].mutable_data_ptr();
  }
  // Only a bind that succeeds changes the chunk table (a refused one leaves the bucket as it was).
  if (numels != numels_) {
    numels_ = std::move(numels);
    total_ = build_chunks(numels_, chunk_size_, chunks_);
  }
  grads_ = std::move(bound);
  return true;
}

void AdamBucket::run(const std::optional<at::Tensor>& noop_flag, py::handle scalars,
                     const std::optional<at::Tensor>& grad_scale, bool check_finite) {
  TORCH_CHECK(grads_.size() == state_[0].size(), "AdamBucket.run() before a successful bind()");
  std::vector<at::Tensor> grads = std::move(grads_);
  grads_.clear();
  if (grads.empty() || flag_is_set(noop_flag)) return;
  // Rows whose tensors do not share one dense layout run on contiguous copies.
  std::vector<std::pair<at::Tensor, at::Tensor>> writeback;
  for (int64_t i : staged_) {
    Row& r = rows_[i];
    at::Tensor g = grads[i].contiguous();
    grads[i] = g;
    r.p[kGrad] = const_cast<void*>(g.const_data_ptr());
    for (size_t k = 0; k < state_.size(); ++k) {
      const at::Tensor& t = state_[k][i];
      at::Tensor tmp = t.contiguous();
      if (!tmp.is_same(t)) writeback.emplace_back(t, tmp);
      r.p[slots_[k]] = tmp.mutable_data_ptr();
    }
  }
  const bool fp64 = param_dtype_ == c10::kDouble;
  AdamScalars<float> cf;
  AdamScalars<double> cd;
  if (fp64) {
    cd = round_scalars<double>(scalars, grad_scale);
  } else {
    cf = round_scalars<float>(scalars, grad_scale);
  }
  const bool ema_bf16 = ema_ && ema_dtype_ != state_dtype_;  // the front end allows only bf16
  const KernelFn fn =
      !ema_      ? for_param<false, false>(param_dtype_, grad_dtype_, master_, remainder_)
      : ema_bf16 ? for_param<true, true>(param_dtype_, grad_dtype_, master_, remainder_)
                 : for_param<true, false>(param_dtype_, grad_dtype_, master_, remainder_);
  const void* c = fp64 ? static_cast<const void*>(&cd) : static_cast<const void*>(&cf);
  bool skipped = false;
  {
    py::gil_scoped_release nogil;
    if (check_finite) {
      switch (grad_dtype_) {
        case c10::kFloat: skipped = grads_nonfinite<float>(chunks_, total_, rows_); break;
        case c10::kDouble: skipped = grads_nonfinite<double>(chunks_, total_, rows_); break;
        case c10::kHalf: skipped = grads_nonfinite<c10::Half>(chunks_, total_, rows_); break;
        default: skipped = grads_nonfinite<c10::BFloat16>(chunks_, total_, rows_); break;
      }
    }
    if (!skipped) {
      launch_ranges(chunks_, total_, [&](const Chunk* first, int64_t count) {
        fn(first, count, rows_.data(), c);
      });
    }
  }
  if (skipped) {
    set_flag(noop_flag);
    return;
  }
  for (auto& [dst, src] : writeback) dst.copy_(src);
}

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu
