// fused_ema_adamw, adam and radam: one kernel template (the update rule a template parameter,
// the EMA compiled in or out), the apex-style op front-ends with C++ validation, and the prepared
// (persistent) form used by the optimizers.
//
// Arithmetic: exactly the op sequence of multi_tensor/backends/reference.py, in opmath (fp32, or
// fp64 for fp64 buckets), each scalar computed in double and rounded to opmath once. This file
// must be compiled with -ffp-contract=off so no multiply/add pair is fused into an FMA.
#include "adam_family.h"

#include <ATen/ops/empty_strided.h>

#include <cmath>

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

namespace {

// Slots of a row: grad, param, exp_avg, exp_avg_sq, ema, master.
enum Slot { kG = 0, kP = 1, kM = 2, kV = 3, kS = 4, kW = 5, kSlots = 6 };

struct RowPtrs {
  void* p[kSlots];
};

// Every scalar of one call, rounded to opmath once (the fields a rule does not use stay unset).
template <typename opmath_t>
struct AdamScalars {
  opmath_t inv_scale, wd, beta1, omb1, beta2, omb2, bc1, bc2, eps, lr, ema, ome;
  bool has_scale, maximize, l2_decay, decoupled_decay;
  // radam only: p * dec (decoupled decay), the lerp weight w = 1 - beta1 and w1 = 1 - w (opmath),
  // sqrt(bc2), the rectification term, and the per-call branches.
  opmath_t dec, w, w1, sbc2, rect;
  bool small, rectified;
};

// An update rule: moments() runs in pass 1 on the prepared grad (unscaled, negated under
// maximize) and returns m', v' and the value whose sqrt pass 2 needs; update() runs in pass 2 on
// m' and that sqrt and returns the new weights. Each rule is the reference backend's op sequence.

// Adam / AdamW (reference.adam_family).
struct AdamRule {
  template <typename V, typename C>
  static inline void moments(const C& c, V g, const V& w, const V& m, const V& v, V& mn, V& vn,
                             V& q) {
    if (c.l2_decay) g = g + w * V(c.wd);
    mn = m * V(c.beta1) + g * V(c.omb1);
    vn = v * V(c.beta2) + (g * V(c.omb2)) * g;
    q = vn / V(c.bc2);
  }
  template <typename V, typename C>
  static inline V update(const C& c, const V& w, const V& mn, const V& sq) {
    const V denom = sq + V(c.eps);
    V u = (mn / V(c.bc1)) / denom;
    if (c.decoupled_decay) u = u + w * V(c.wd);
    return w - u * V(c.lr);
  }
  template <typename C>
  static inline bool needs_sqrt(const C&) { return true; }
};

// torch.optim.RAdam (reference.radam): m.lerp_(g, 1 - beta1), the rho_t > 5 branch per call.
struct RAdamRule {
  template <typename V, typename C>
  static inline void moments(const C& c, V g, const V& w, const V& m, const V& v, V& mn, V& vn,
                             V& q) {
    if (c.l2_decay) g = g + w * V(c.wd);
    const V d = g - m;
    mn = c.small ? m + d * V(c.w) : g - d * V(c.w1);
    vn = v * V(c.beta2) + (g * V(c.omb2)) * g;
    q = vn;
  }
  template <typename V, typename C>
  static inline V update(const C& c, const V& w, const V& mn, const V& sq) {
    const V wd = c.decoupled_decay ? w * V(c.dec) : w;
    const V mh = mn / V(c.bc1);
    V u;
    if (c.rectified) {
      const V a = (V(1) / (sq + V(c.eps))) * V(c.sbc2);
      u = ((mh * V(c.lr)) * a) * V(c.rect);
    } else {
      u = mh * V(c.lr);
    }
    return wd - u;
  }
  template <typename C>
  static inline bool needs_sqrt(const C& c) { return c.rectified; }
};

template <typename opmath_t, typename P, typename G, bool MASTER, bool EMA, typename Rule>
struct AdamKernel {
  using V = Vectorized<opmath_t>;
  using S = std::conditional_t<MASTER, float, P>;  // exp_avg / exp_avg_sq / ema storage
  using W = std::conditional_t<MASTER, float, P>;  // the weights the update runs on
  static constexpr int64_t B = block_size<opmath_t>();
  static constexpr int64_t T = kTile;
  static_assert(T % B == 0, "tile must be a multiple of the block");

  // Pass 1 (one block): g -> m', v'; stores m', v' and keeps m' and the rule's sqrt input in
  // opmath tiles.
  static inline void pass1(const AdamScalars<opmath_t>& c, const G* g, const W* w, S* m, S* v,
                           opmath_t* tm, opmath_t* tq) {
    V g0, g1, w0, w1, m0, m1, v0, v1;
    load2<G, opmath_t>(g, g0, g1);
    load2<W, opmath_t>(w, w0, w1);
    load2<S, opmath_t>(m, m0, m1);
    load2<S, opmath_t>(v, v0, v1);
    V mn[2], vn[2];
    const V* gs[2] = {&g0, &g1};
    const V* ws[2] = {&w0, &w1};
    const V* ms[2] = {&m0, &m1};
    const V* vs[2] = {&v0, &v1};
    for (int h = 0; h < 2; ++h) {
      V gh = *gs[h];
      if (c.has_scale) gh = gh * V(c.inv_scale);
      if (c.maximize) gh = gh.neg();
      V q;
      Rule::moments(c, gh, *ws[h], *ms[h], *vs[h], mn[h], vn[h], q);
      mn[h].store(tm + h * V::size());
      q.store(tq + h * V::size());
    }
    store2<S, opmath_t>(m, mn[0], mn[1]);
    store2<S, opmath_t>(v, vn[0], vn[1]);
  }

  // Pass 2 (one block), after tq holds the sqrt (when the rule needs it): the update, the weights
  // and the EMA.
  static inline void pass2(const AdamScalars<opmath_t>& c, P* p, W* w, S* s, const opmath_t* tm,
                           const opmath_t* tq) {
    V w0, w1, s0, s1;
    load2<W, opmath_t>(w, w0, w1);
    if constexpr (EMA) load2<S, opmath_t>(s, s0, s1);
    V wn[2], sn[2];
    const V* ws[2] = {&w0, &w1};
    const V* ss[2] = {&s0, &s1};
    for (int h = 0; h < 2; ++h) {
      wn[h] = Rule::update(c, *ws[h], V::loadu(tm + h * V::size()), V::loadu(tq + h * V::size()));
      if constexpr (EMA) sn[h] = *ss[h] * V(c.ema) + wn[h] * V(c.ome);
    }
    if constexpr (EMA) store2<S, opmath_t>(s, sn[0], sn[1]);
    if constexpr (MASTER) store2<W, opmath_t>(w, wn[0], wn[1]);
    store2<P, opmath_t>(p, wn[0], wn[1]);
  }

  template <typename X>
  static inline void pad(X* buf, const X* src, int64_t count) {
    for (int64_t k = 0; k < B; ++k) buf[k] = X(0);
    if (src) std::memcpy(buf, src, sizeof(X) * count);
  }

  struct Segment {
    const RowPtrs* row;
    int64_t start;  // element offset in the row
    int64_t len;    // elements
    int64_t slot;   // offset in the tile
  };

  // Pass 1 over elements [i, i + len) of a row into tile slots [slot, slot + roundup(len, B)).
  static inline void seg_pass1(const AdamScalars<opmath_t>& c, const RowPtrs& r, int64_t i,
                               int64_t len, opmath_t* tm, opmath_t* tq) {
    const G* g = static_cast<const G*>(r.p[kG]);
    S* m = static_cast<S*>(r.p[kM]);
    S* v = static_cast<S*>(r.p[kV]);
    const W* w = MASTER ? static_cast<const W*>(r.p[kW]) : static_cast<const W*>(r.p[kP]);
    const int64_t full = len - len % B;
    for (int64_t k = 0; k < full; k += B) {
      pass1(c, g + i + k, w + i + k, m + i + k, v + i + k, tm + k, tq + k);
    }
    const int64_t rest = len - full;
    if (rest) {
      const int64_t j = i + full;
      G gb[B];
      W wb[B];
      S mb[B], vb[B];
      pad(gb, g + j, rest);
      pad(wb, w + j, rest);
      pad(mb, m + j, rest);
      pad(vb, v + j, rest);
      pass1(c, gb, wb, mb, vb, tm + full, tq + full);
      // padding lanes: 1 rather than 0, which would send MKL's sqrt down its slow special-value
      // path (the padded results are discarded either way)
      for (int64_t k = rest; k < B; ++k) tq[full + k] = opmath_t(1);
      std::memcpy(m + j, mb, sizeof(S) * rest);
      std::memcpy(v + j, vb, sizeof(S) * rest);
    }
  }

  static inline void seg_pass2(const AdamScalars<opmath_t>& c, const RowPtrs& r, int64_t i,
                               int64_t len, const opmath_t* tm, const opmath_t* tq) {
    P* p = static_cast<P*>(r.p[kP]);
    S* s = EMA ? static_cast<S*>(r.p[kS]) : nullptr;
    W* w = MASTER ? static_cast<W*>(r.p[kW]) : reinterpret_cast<W*>(p);
    const int64_t full = len - len % B;
    for (int64_t k = 0; k < full; k += B) {
      pass2(c, p + i + k, w + i + k, EMA ? s + i + k : nullptr, tm + k, tq + k);
    }
    const int64_t rest = len - full;
    if (rest) {
      const int64_t j = i + full;
      P pb[B];
      W wb[B];
      S sb[B];
      pad(pb, p + j, rest);
      pad(wb, w + j, rest);
      pad(sb, EMA ? s + j : nullptr, rest);
      pass2(c, pb, MASTER ? wb : reinterpret_cast<W*>(pb), sb, tm + full, tq + full);
      std::memcpy(p + j, pb, sizeof(P) * rest);
      if constexpr (EMA) std::memcpy(s + j, sb, sizeof(S) * rest);
      if constexpr (MASTER) std::memcpy(w + j, wb, sizeof(W) * rest);
    }
  }

  // A run of chunks (one thread's share). Elements are packed into tiles of T (several small
  // chunks can share one tile): pass 1 of every segment, ONE sqrt call over the tile (the same
  // sqrt routine torch's reference uses; skipped when the rule needs none, e.g. an un-rectified
  // RAdam step), then pass 2. A partial block runs the same vector code
  // on zero-padded copies, so every element gets identical bits wherever it sits.
  static void run(const Chunk* chunks, int64_t nchunks, const RowPtrs* rows, const void* scalars) {
    const auto& c = *static_cast<const AdamScalars<opmath_t>*>(scalars);
    const bool sqrt_needed = Rule::needs_sqrt(c);
    alignas(64) opmath_t tm[T];
    alignas(64) opmath_t tq[T];
    Segment segs[T / B];
    int64_t nseg = 0;
    int64_t fill = 0;
    auto flush = [&]() {
      if (fill == 0) return;
      if (sqrt_needed) tile_sqrt(tq, fill);
      for (int64_t k = 0; k < nseg; ++k) {
        seg_pass2(c, *segs[k].row, segs[k].start, segs[k].len, tm + segs[k].slot,
                  tq + segs[k].slot);
      }
      nseg = 0;
      fill = 0;
    };
    for (int64_t ci = 0; ci < nchunks; ++ci) {
      const Chunk& ch = chunks[ci];
      const RowPtrs& r = rows[ch.row];
      if (ci + 2 < nchunks && chunks[ci].end - chunks[ci].start < 256) {
        // many small tensors: their data is scattered, so start the next loads early
        const Chunk& nx = chunks[ci + 2];
        const RowPtrs& nr = rows[nx.row];
        __builtin_prefetch(static_cast<const G*>(nr.p[kG]) + nx.start);
        __builtin_prefetch(static_cast<const P*>(nr.p[kP]) + nx.start, 1);
        __builtin_prefetch(static_cast<const S*>(nr.p[kM]) + nx.start, 1);
        __builtin_prefetch(static_cast<const S*>(nr.p[kV]) + nx.start, 1);
        if constexpr (EMA) __builtin_prefetch(static_cast<const S*>(nr.p[kS]) + nx.start, 1);
        if constexpr (MASTER) __builtin_prefetch(static_cast<const W*>(nr.p[kW]) + nx.start, 1);
      }
      int64_t pos = ch.start;
      while (pos < ch.end) {
        const int64_t avail = T - fill;  // a multiple of B
        int64_t len = ch.end - pos;
        if (((len + B - 1) / B) * B > avail) len = avail;
        seg_pass1(c, r, pos, len, tm + fill, tq + fill);
        segs[nseg++] = Segment{&r, pos, len, fill};
        fill += ((len + B - 1) / B) * B;
        pos += len;
        if (fill == T) flush();
      }
    }
    flush();
  }
};

using KernelFn = void (*)(const Chunk*, int64_t, const RowPtrs*, const void*);

template <typename Rule, bool EMA, bool MASTER, typename P>
KernelFn select_grad(c10::ScalarType gt) {
  switch (gt) {
    case c10::kFloat: return &AdamKernel<float, P, float, MASTER, EMA, Rule>::run;
    case c10::kHalf: return &AdamKernel<float, P, c10::Half, MASTER, EMA, Rule>::run;
    case c10::kBFloat16: return &AdamKernel<float, P, c10::BFloat16, MASTER, EMA, Rule>::run;
    default: return nullptr;
  }
}

template <typename Rule, bool EMA>
KernelFn select_kernel(c10::ScalarType pt, c10::ScalarType gt, bool master) {
  if (pt == c10::kDouble) {
    return (!master && gt == c10::kDouble)
               ? &AdamKernel<double, double, double, false, EMA, Rule>::run
               : nullptr;
  }
  switch (pt) {
    case c10::kFloat:
      return master ? select_grad<Rule, EMA, true, float>(gt)
                    : select_grad<Rule, EMA, false, float>(gt);
    case c10::kHalf:
      return master ? select_grad<Rule, EMA, true, c10::Half>(gt)
                    : select_grad<Rule, EMA, false, c10::Half>(gt);
    case c10::kBFloat16:
      return master ? select_grad<Rule, EMA, true, c10::BFloat16>(gt)
                    : select_grad<Rule, EMA, false, c10::BFloat16>(gt);
    default: return nullptr;
  }
}

KernelFn select_rule_kernel(UpdateRule rule, bool has_ema, c10::ScalarType pt,
                            c10::ScalarType gt, bool master) {
  if (rule == UpdateRule::kRAdam) {
    return has_ema ? select_kernel<RAdamRule, true>(pt, gt, master)
                   : select_kernel<RAdamRule, false>(pt, gt, master);
  }
  return has_ema ? select_kernel<AdamRule, true>(pt, gt, master)
                 : select_kernel<AdamRule, false>(pt, gt, master);
}

template <typename opmath_t>
AdamScalars<opmath_t> make_scalars(const AdamHyper& h, bool has_ema) {
  AdamScalars<opmath_t> c;
  double bc1 = 1.0, bc2 = 1.0;
  if (h.bias_correction) {
    bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
    bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  }
  c.beta1 = static_cast<opmath_t>(h.beta1);
  c.omb1 = static_cast<opmath_t>(1.0 - h.beta1);
  c.beta2 = static_cast<opmath_t>(h.beta2);
  c.omb2 = static_cast<opmath_t>(1.0 - h.beta2);
  c.bc1 = static_cast<opmath_t>(bc1);
  c.bc2 = static_cast<opmath_t>(bc2);
  c.eps = static_cast<opmath_t>(h.eps);
  c.lr = static_cast<opmath_t>(h.lr);
  c.wd = static_cast<opmath_t>(h.weight_decay);
  c.ema = static_cast<opmath_t>(has_ema ? h.ema_decay : 0.0);
  c.ome = static_cast<opmath_t>(has_ema ? 1.0 - h.ema_decay : 0.0);
  c.maximize = h.maximize;
  c.l2_decay = h.mode == 0 && h.weight_decay != 0.0;
  c.decoupled_decay = h.mode == 1 && h.weight_decay != 0.0;
  c.dec = c.w = c.w1 = c.sbc2 = c.rect = opmath_t(0);
  c.small = c.rectified = false;
  if (h.rule == UpdateRule::kRAdam) {
    // reference.radam_scalars(): torch.optim.RAdam's expressions in double (t a float, `x ** 0.5`
    // is pow(x, 0.5), which need not round like sqrt; the volatile keeps it a pow call).
    static volatile double kHalf = 0.5;
    const double half = kHalf;
    const double t = static_cast<double>(h.step);
    bc1 = 1.0 - std::pow(h.beta1, t);
    bc2 = 1.0 - std::pow(h.beta2, t);
    const double rho_inf = 2.0 / (1.0 - h.beta2) - 1.0;
    const double rho_t = rho_inf - 2.0 * t * std::pow(h.beta2, t) / bc2;
    c.rectified = rho_t > 5.0;
    if (c.rectified) {
      const double rect = std::pow(
          (rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t),
          half);
      c.rect = static_cast<opmath_t>(rect);
      c.sbc2 = static_cast<opmath_t>(std::pow(bc2, half));
    }
    c.bc1 = static_cast<opmath_t>(bc1);
    c.bc2 = static_cast<opmath_t>(bc2);
    // m.lerp_(g, w): torch's lerp picks its formula on |w| < 0.5 (w in opmath); w1 = 1 - w is an
    // opmath subtraction.
    c.w = static_cast<opmath_t>(1.0 - h.beta1);
    c.small = std::abs(c.w) < opmath_t(0.5);
    c.w1 = opmath_t(1) - c.w;
    c.dec = static_cast<opmath_t>(1.0 - h.lr * h.weight_decay);
  }
  c.has_scale = false;
  c.inv_scale = opmath_t(1);
  if (h.grad_scale.has_value() && h.grad_scale->defined()) {
    const at::Tensor& gs = *h.grad_scale;
    TORCH_CHECK_VALUE(gs.numel() == 1, "grad_scale must be a 1-element tensor, got shape ",
                      shape_str(gs.sizes()));
    c.has_scale = true;
    const auto st = gs.scalar_type();
    if (gs.is_cpu() && (st == c10::kFloat || st == c10::kDouble || st == c10::kHalf ||
                        st == c10::kBFloat16)) {
      // grad_scale.to(opmath).reciprocal(): round to opmath first, then 1/x in opmath.
      double d = 0.0;
      const void* ptr = gs.const_data_ptr();
      switch (st) {
        case c10::kFloat: d = *static_cast<const float*>(ptr); break;
        case c10::kDouble: d = *static_cast<const double*>(ptr); break;
        case c10::kHalf: d = static_cast<float>(*static_cast<const c10::Half*>(ptr)); break;
        default: d = static_cast<float>(*static_cast<const c10::BFloat16*>(ptr)); break;
      }
      const opmath_t sc = static_cast<opmath_t>(d);
      c.inv_scale = opmath_t(1) / sc;
    } else {
      const auto opdt = std::is_same_v<opmath_t, double> ? c10::kDouble : c10::kFloat;
      c.inv_scale = static_cast<opmath_t>(gs.to(at::kCPU, opdt).reciprocal().reshape({-1})[0].item().toDouble());
    }
  }
  return c;
}

// A row is addressed directly (one flat array per tensor) when the params are non-overlapping
// and dense and every other tensor of the row has the params' layout; elementwise math does not
// care about the order of elements in memory.
inline bool gather_direct(const std::array<const at::Tensor*, kSlots>& row, RowPtrs& out,
                          int64_t numel) {
  const at::Tensor& ref = *row[kP];
  const bool ref_contig = ref.is_contiguous();
  if (!ref_contig && !ref.is_non_overlapping_and_dense()) return false;
  for (int k = 0; k < kSlots; ++k) {
    const at::Tensor* t = row[k];
    if (!t) {
      out.p[k] = nullptr;
      continue;
    }
    if (k != kP && !(ref_contig ? t->is_contiguous() : t->strides().equals(ref.strides())))
      return false;
    // in-place outputs via mutable_data_ptr (materializes a copy-on-write storage first)
    out.p[k] = !numel ? nullptr
               : k == kG ? const_cast<void*>(t->const_data_ptr()) : t->mutable_data_ptr();
  }
  return true;
}

}  // namespace

// Rows that cannot be addressed directly run on temporaries (the params' layout when it is
// flat, else contiguous); in-place outputs are copied back after the kernel.
struct AdamBucket {
  std::vector<RowPtrs> ptrs;
  std::vector<int64_t> numels;
  std::vector<std::pair<size_t, std::array<const at::Tensor*, kSlots>>> slow;
  std::vector<at::Tensor> temps;
  std::vector<std::pair<at::Tensor, at::Tensor>> writeback;  // (destination, temporary)
  c10::ScalarType pt = c10::kFloat, gt = c10::kFloat;

  void reset(size_t n) {
    ptrs.resize(n);
    numels.resize(n);
    slow.clear();
  }
  void add(size_t i, const std::array<const at::Tensor*, kSlots>& row, int64_t numel) {
    numels[i] = numel;
    if (!gather_direct(row, ptrs[i], numel)) slow.emplace_back(i, row);
  }
  void setup_slow() {
    for (auto& [r, row] : slow) {
      const at::Tensor& ref = *row[kP];
      const bool ref_flat = ref.is_contiguous() || ref.is_non_overlapping_and_dense();
      for (int k = 0; k < kSlots; ++k) {
        if (!row[k]) {
          ptrs[r].p[k] = nullptr;
          continue;
        }
        const at::Tensor& t = *row[k];
        const bool direct = ref_flat ? (k == kP || same_layout(t, ref)) : t.is_contiguous();
        if (direct) {
          ptrs[r].p[k] = !t.numel() ? nullptr
                         : k == kG ? const_cast<void*>(t.const_data_ptr()) : t.mutable_data_ptr();
          continue;
        }
        at::Tensor tmp = ref_flat ? at::empty_strided(ref.sizes(), ref.strides(), t.options())
                                  : at::empty(ref.sizes(), t.options());
        tmp.copy_(t);
        ptrs[r].p[k] = tmp.numel() ? tmp.data_ptr() : nullptr;
        if (k != kG) writeback.emplace_back(t, tmp);
        temps.push_back(std::move(tmp));
      }
    }
  }
};

namespace {
}  // namespace

// ------------------------------------------------------------------------------------------------
// The shared execution path (validated rows in, update applied)
// ------------------------------------------------------------------------------------------------

void run_adam_bucket(AdamBucket& bucket, bool has_ema, bool has_master, int64_t chunk_size,
                     const std::optional<at::Tensor>& noop, const AdamHyper& h) {
  if (bucket.ptrs.empty()) return;
  if (noop_is_set(noop)) return;
  const auto pt = bucket.pt;
  const auto gt = bucket.gt;
  KernelFn fn = select_rule_kernel(h.rule, has_ema, pt, gt, has_master);
  TORCH_CHECK_TYPE(fn != nullptr, "multi_tensor: unsupported dtype combination params=",
                   dtype_name(pt), " grads=", dtype_name(gt));
  const bool fp64 = pt == c10::kDouble;
  AdamScalars<float> cf;
  AdamScalars<double> cd;
  if (fp64) cd = make_scalars<double>(h, has_ema); else cf = make_scalars<float>(h, has_ema);
  const void* scalars = fp64 ? static_cast<const void*>(&cd) : static_cast<const void*>(&cf);

  bucket.setup_slow();
  std::vector<Chunk> chunks;
  const int64_t total = build_chunks(bucket.numels, chunk_size, chunks);
  const RowPtrs* rows = bucket.ptrs.data();

  if (h.check_finite) {
    std::atomic<bool> bad{false};
    {
      py::gil_scoped_release nogil;
      launch(chunks, total, [&](const Chunk& ch) {
        if (bad.load(std::memory_order_relaxed)) return;
        const void* g = rows[ch.row].p[kG];
        const int64_t n = ch.end - ch.start;
        bool b = false;
        switch (gt) {
          case c10::kFloat: b = has_nonfinite<float, float>(static_cast<const float*>(g) + ch.start, n); break;
          case c10::kDouble: b = has_nonfinite<double, double>(static_cast<const double*>(g) + ch.start, n); break;
          case c10::kHalf: b = has_nonfinite<c10::Half, float>(static_cast<const c10::Half*>(g) + ch.start, n); break;
          default: b = has_nonfinite<c10::BFloat16, float>(static_cast<const c10::BFloat16*>(g) + ch.start, n); break;
        }
        if (b) bad.store(true, std::memory_order_relaxed);
      });
    }
    if (bad.load()) {
      set_noop(noop);
      return;
    }
  }
  {
    py::gil_scoped_release nogil;
    launch_ranges(chunks, total, [&](const Chunk* c, int64_t n) { fn(c, n, rows, scalars); });
  }
  for (auto& wb : bucket.writeback) wb.first.copy_(wb.second);
}

// ------------------------------------------------------------------------------------------------
// Validation (mirrors validation.check_adam_family_lists; runs before anything is modified)
// ------------------------------------------------------------------------------------------------

namespace {

const char* kEmaNames5[] = {"grads", "params", "exp_avgs", "exp_avg_sqs", "emas"};
const char* kEmaNames6[] = {"grads", "params", "exp_avgs", "exp_avg_sqs", "emas", "masters"};
const char* kAdamNames4[] = {"grads", "params", "exp_avgs", "exp_avg_sqs"};
const char* kAdamNames5[] = {"grads", "params", "exp_avgs", "exp_avg_sqs", "masters"};

bool is_param_dtype(c10::ScalarType t) {
  return t == c10::kHalf || t == c10::kBFloat16 || t == c10::kFloat || t == c10::kDouble;
}
bool is_grad_dtype(c10::ScalarType t) {
  return t == c10::kHalf || t == c10::kBFloat16 || t == c10::kFloat;
}

std::string forms_str(UpdateRule rule, bool has_ema) {
  auto join = [](const char** names, int n) {
    std::string s = "[";
    for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::string(names[i]);
    return s + "]";
  };
  std::string forms = has_ema ? join(kEmaNames5, 5) + " or " + join(kEmaNames6, 6)
                              : join(kAdamNames4, 4) + " or " + join(kAdamNames5, 5);
  if (rule == UpdateRule::kRAdam)
    forms += has_ema ? " (ema_decay is set)" : " (ema_decay is None)";
  return forms;
}

// check_list_dtype(): one dtype per list, from the allowed set.
c10::ScalarType check_list_dtype(const std::string& op, const char* name, const PyTensorList& l,
                                 bool (*allowed)(c10::ScalarType), const char* allowed_str) {
  const auto dt = l.items[0]->scalar_type();
  for (size_t i = 0; i < l.size(); ++i) {
    TORCH_CHECK_TYPE(l.items[i]->scalar_type() == dt, op, ": ", name, "[", i, "] is ",
                     dtype_name(l.items[i]->scalar_type()), " but ", name, "[0] is ",
                     dtype_name(dt),
                     "; every tensor of one list must share one dtype (bucket tensors by dtype "
                     "first)");
  }
  TORCH_CHECK_TYPE(allowed(dt), op, ": ", name, " are ", dtype_name(dt), "; supported: ",
                   allowed_str);
  return dt;
}

bool only_fp64(c10::ScalarType t) { return t == c10::kDouble; }

}  // namespace

std::string family_op_name(UpdateRule rule, bool has_ema) {
  if (rule == UpdateRule::kRAdam) return "multi_tensor_radam";
  return has_ema ? "multi_tensor_fused_ema_adamw" : "multi_tensor_adam";
}

AdamForm validate_adam_family(UpdateRule rule, bool has_ema,
                              const std::vector<PyTensorList*>& lists) {
  const std::string op = family_op_name(rule, has_ema);
  const size_t nl = lists.size();
  const size_t base = has_ema ? 5 : 4;
  TORCH_CHECK_VALUE(nl == base || nl == base + 1, op, ": tensor_lists must be ",
                    forms_str(rule, has_ema), "; got ", nl, " lists");
  const bool has_master = nl == base + 1;
  const char** names = has_ema ? (has_master ? kEmaNames6 : kEmaNames5)
                               : (has_master ? kAdamNames5 : kAdamNames4);
  std::vector<const char*> vnames(names, names + nl);
  const int64_t n = check_rows(op, lists, vnames, 1);
  AdamForm form{has_master, n, c10::kFloat, c10::kFloat};
  if (n == 0) return form;
  const char* pstr = "torch.float16, torch.bfloat16, torch.float32, torch.float64";
  const auto pdt = check_list_dtype(op, "params", *lists[1], is_param_dtype, pstr);
  const auto sdt = has_master ? c10::kFloat : pdt;
  TORCH_CHECK_TYPE(!(has_master && pdt == c10::kDouble), op,
                   ": params are float64; fp32 master weights are for fp16/bf16/fp32 params");
  for (size_t li = 2; li < nl; ++li) {
    const auto dt = check_list_dtype(op, names[li], *lists[li], is_param_dtype, pstr);
    TORCH_CHECK_TYPE(dt == sdt, op, ": ", names[li], " are ", dtype_name(dt), " but must be ",
                     dtype_name(sdt), " ",
                     has_master ? "(optimizer state and masters are fp32 in the master-weights form)"
                                : "(the same dtype as params)");
  }
  const auto gdt = pdt == c10::kDouble
                       ? check_list_dtype(op, "grads", *lists[0], only_fp64, "torch.float64")
                       : check_list_dtype(op, "grads", *lists[0], is_grad_dtype,
                                          "torch.float16, torch.bfloat16, torch.float32");
  form.param_dtype = pdt;
  form.grad_dtype = gdt;
  return form;
}

// Bucket from validated lists (list index -> slot).
void bucket_from_lists(bool has_ema, bool has_master, const std::vector<PyTensorList*>& lists,
                       AdamBucket& bucket) {
  const size_t n = lists[0]->size();
  bucket.reset(n);
  bucket.pt = lists[1]->items[0]->scalar_type();
  bucket.gt = lists[0]->items[0]->scalar_type();
  for (size_t i = 0; i < n; ++i) {
    std::array<const at::Tensor*, kSlots> row;
    row.fill(nullptr);
    row[kG] = lists[0]->items[i];
    row[kP] = lists[1]->items[i];
    row[kM] = lists[2]->items[i];
    row[kV] = lists[3]->items[i];
    if (has_ema) row[kS] = lists[4]->items[i];
    if (has_master) row[kW] = lists[has_ema ? 5 : 4]->items[i];
    bucket.add(i, row, row[kP]->numel());
  }
}

int64_t parse_step(const std::string& op, py::handle step) {
  PyObject* o = step.ptr();
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    TORCH_CHECK_VALUE(t.numel() == 1, op, ": step must be a 1-element tensor, got shape ",
                      shape_str(t.sizes()));
    auto item = t.item();
    if (item.isFloatingPoint()) {
      const double d = item.toDouble();
      TORCH_CHECK_VALUE(std::isfinite(d) && d == std::floor(d) && d >= 1.0, op,
                        ": step must be a positive integer, got ", py::repr(step).cast<std::string>());
      return static_cast<int64_t>(d);
    }
    TORCH_CHECK_VALUE(item.isIntegral(false) && item.toLong() >= 1, op,
                      ": step must be a positive integer, got ", py::repr(step).cast<std::string>());
    return item.toLong();
  }
  if (!PyBool_Check(o) && PyIndex_Check(o)) {
    const long long v = PyLong_AsLongLong(py::reinterpret_steal<py::object>(PyNumber_Index(o)).ptr());
    if (!PyErr_Occurred() && v >= 1) return v;
    PyErr_Clear();
  }
  TORCH_CHECK_VALUE(false, op, ": step must be a positive integer, got ",
                    py::repr(step).cast<std::string>());
}

void check_scalars(const std::string& op, int64_t chunk_size, const AdamHyper& h) {
  TORCH_CHECK_VALUE(chunk_size >= 1, op, ": chunk_size must be a positive integer, got ",
                    chunk_size);
  TORCH_CHECK_VALUE(h.mode == 0 || h.mode == 1, op,
                    ": mode must be 0 (Adam, L2 decay) or 1 (AdamW, decoupled decay), got ",
                    h.mode);
}

// ------------------------------------------------------------------------------------------------
// Op form: op(chunk_size, noop_flag, tensor_lists, *scalars, grad_scale=, maximize=, check_finite=)
// ------------------------------------------------------------------------------------------------

void adam_family_op(bool has_ema, int64_t chunk_size, const std::optional<at::Tensor>& noop,
                    py::handle tensor_lists, AdamHyper& h, py::handle step) {
  const std::string op = family_op_name(h.rule, has_ema);
  PyObject* tl = tensor_lists.ptr();
  if (!PyList_Check(tl) && !PyTuple_Check(tl)) {
    TORCH_CHECK_VALUE(false, op, ": tensor_lists must be ", forms_str(h.rule, has_ema), "; got ",
                      Py_TYPE(tl)->tp_name);
  }
  const Py_ssize_t nl = PySequence_Fast_GET_SIZE(tl);
  std::vector<PyTensorList> storage(static_cast<size_t>(nl));
  std::vector<PyTensorList*> lists;
  const size_t base = has_ema ? 5 : 4;
  if (static_cast<size_t>(nl) == base || static_cast<size_t>(nl) == base + 1) {
    for (Py_ssize_t k = 0; k < nl; ++k) {
      unpack_list(PySequence_Fast_ITEMS(tl)[k], storage[k],
                  op + ": tensor_lists[" + std::to_string(k) + "]");
    }
  }
  for (auto& s : storage) lists.push_back(&s);
  const AdamForm form = validate_adam_family(h.rule, has_ema, lists);
  h.step = parse_step(op, step);
  check_scalars(op, chunk_size, h);
  if (form.rows == 0) return;
  AdamBucket bucket;
  bucket_from_lists(has_ema, form.has_master, lists, bucket);
  run_adam_bucket(bucket, has_ema, form.has_master, chunk_size, noop, h);
}

// ------------------------------------------------------------------------------------------------
// Prepared form
// ------------------------------------------------------------------------------------------------

PreparedAdamFamily::PreparedAdamFamily(const std::string& op_name, py::handle state_lists,
                                       int64_t chunk_size)
    : op_name_(op_name), chunk_size_(chunk_size) {
  TORCH_CHECK_VALUE(op_name == "fused_ema_adamw" || op_name == "adam" || op_name == "radam",
                    "PreparedAdamFamily: op must be 'fused_ema_adamw', 'adam' or 'radam', got '",
                    op_name, "'");
  rule_ = op_name == "radam" ? UpdateRule::kRAdam : UpdateRule::kAdam;
  form_fixed_ = rule_ == UpdateRule::kAdam;
  has_ema_ = op_name == "fused_ema_adamw";
  msg_op_ = family_op_name(rule_, has_ema_);
  const std::string& op = msg_op_;
  TORCH_CHECK_VALUE(chunk_size >= 1, op, ": chunk_size must be a positive integer, got ",
                    chunk_size);
  PyObject* sl = state_lists.ptr();
  TORCH_CHECK_VALUE(PyList_Check(sl) || PyTuple_Check(sl), op,
                    ": state_lists must be a list of tensor lists");
  const Py_ssize_t nl = PySequence_Fast_GET_SIZE(sl);
  state_.resize(nl);
  for (Py_ssize_t k = 0; k < nl; ++k) {
    PyTensorList l;
    unpack_list(PySequence_Fast_ITEMS(sl)[k], l, op + ": state list");
    for (size_t i = 0; i < l.size(); ++i) {
      TORCH_CHECK_TYPE(l.items[i] != nullptr, op, ": state list ", k, " item ", i,
                       " must be a torch.Tensor, got ", type_name_of(l.objs[i]));
      state_[k].push_back(*l.items[i]);
    }
  }
}

AdamForm PreparedAdamFamily::full_validate(const PyTensorList& grads) {
  std::vector<PyTensorList> st(state_.size());
  std::vector<PyTensorList*> lists;
  lists.push_back(const_cast<PyTensorList*>(&grads));
  for (size_t k = 0; k < state_.size(); ++k) {
    st[k].items.resize(state_[k].size());
    st[k].objs.assign(state_[k].size(), nullptr);
    for (size_t i = 0; i < state_[k].size(); ++i) st[k].items[i] = &state_[k][i];
    lists.push_back(&st[k]);
  }
  AdamForm form = validate_adam_family(rule_, has_ema_, lists);
  has_master_ = form.has_master;
  if (form.rows) {
    param_dtype_ = form.param_dtype;
    validated_ = true;
  }
  return form;
}

// radam before its first call: the list form of the state lists. Three lists: no EMA; five: EMA
// and masters; four: emas when the fourth list has the params' dtype (the EMA form requires it),
// else masters (fp32 masters of fp16/bf16 params). For fp32 params both forms check the same.
bool PreparedAdamFamily::infer_ema() const {
  if (state_.size() == 5) return true;
  if (state_.size() != 4 || state_[0].empty() || state_[3].empty()) return false;
  return state_[3][0].scalar_type() == state_[0][0].scalar_type();
}

// radam: a call's ema_decay fixes the form; a change of form validates the lists again.
void PreparedAdamFamily::set_form(bool has_ema) {
  if (form_fixed_ || has_ema == has_ema_) return;
  has_ema_ = has_ema;
  validated_ = false;
}

void PreparedAdamFamily::validate(py::handle grads) {
  PyTensorList g;
  unpack_list(grads, g, msg_op_ + ": grads");
  if (!form_fixed_ && !validated_) has_ema_ = infer_ema();
  full_validate(g);
}

namespace {
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

// One pass per call over a validated bucket: cheap re-checks (grads against params; the state
// tensors' numel/dtype/device, since `p.data = x` may swap storage between steps) fused with
// gathering the data pointers, so each tensor's metadata is touched once. Anything unexpected
// returns false and the call goes through the full validation, which raises the precise error.
bool PreparedAdamFamily::gather(const PyTensorList& grads, AdamBucket& bucket) const {
  if (!validated_) return false;
  const size_t n = grads.size();
  if (state_.empty() || state_[0].size() != n || n == 0) return false;
  const at::Tensor* g0 = grads.items[0];
  if (!g0) return false;
  const auto gdt = g0->scalar_type();
  if (param_dtype_ == c10::kDouble ? gdt != c10::kDouble
                                   : !(gdt == c10::kFloat || gdt == c10::kHalf ||
                                       gdt == c10::kBFloat16))
    return false;
  const auto sdt = has_master_ ? c10::kFloat : param_dtype_;
  const size_t ns = state_.size();
  bucket.reset(n);
  bucket.pt = param_dtype_;
  bucket.gt = gdt;
  // The metadata of thousands of tensors is scattered over the heap: this loop is bound by
  // cache misses, so prefetch a few rows ahead (Python object -> TensorImpl -> StorageImpl).
  constexpr size_t kAhead = 16;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      __builtin_prefetch(grads.objs[i + kAhead]);
      for (size_t k = 0; k < ns; ++k) prefetch_impl(state_[k][i + kAhead]);
    }
    if (i + kAhead / 2 < n) {
      const size_t j = i + kAhead / 2;
      if (grads.items[j]) prefetch_impl(*grads.items[j]);
      for (size_t k = 0; k < ns; ++k) prefetch_storage(state_[k][j]);
    }
    if (i + kAhead / 4 < n && grads.items[i + kAhead / 4]) prefetch_storage(*grads.items[i + kAhead / 4]);
    const at::Tensor* g = grads.items[i];
    const at::Tensor& p = state_[0][i];
    if (!g || g->scalar_type() != gdt || !g->is_cpu() || g->layout() != c10::kStrided) return false;
    if (p.scalar_type() != param_dtype_ || !p.is_cpu()) return false;
    if (!g->sizes().equals(p.sizes())) return false;
    const int64_t numel = p.numel();
    std::array<const at::Tensor*, kSlots> row;
    row.fill(nullptr);
    row[kG] = g;
    row[kP] = &p;
    for (size_t k = 1; k < ns; ++k) {
      const at::Tensor& t = state_[k][i];
      if (t.numel() != numel || t.scalar_type() != sdt || !t.is_cpu()) return false;
    }
    row[kM] = &state_[1][i];
    row[kV] = &state_[2][i];
    if (has_ema_) row[kS] = &state_[3][i];
    if (has_master_) row[kW] = &state_[ns - 1][i];
    bucket.add(i, row, numel);
  }
  return true;
}

void PreparedAdamFamily::call(py::handle grads, const std::optional<at::Tensor>& noop, AdamHyper& h,
                              py::handle step, bool has_ema) {
  PyTensorList g;
  unpack_list(grads, g, msg_op_ + ": grads");
  call_list(g, noop, h, step, has_ema);
}

bool PreparedAdamFamily::call_param_grads(const std::optional<at::Tensor>& noop, AdamHyper& h,
                                          py::handle step, bool has_ema) {
  if (state_.empty()) return false;
  const auto& params = state_[0];
  const size_t n = params.size();
  // Hold a reference to every grad for the call (the kernel runs without the GIL).
  std::vector<at::Tensor> hold;
  hold.reserve(n);
  PyTensorList g;
  g.items.resize(n);
  g.objs.assign(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& gi = params[i].unsafeGetTensorImpl()->grad();
    if (!gi.defined()) return false;
    hold.push_back(gi);
  }
  for (size_t i = 0; i < n; ++i) g.items[i] = &hold[i];
  call_list(g, noop, h, step, has_ema);
  return true;
}

void PreparedAdamFamily::call_list(const PyTensorList& g, const std::optional<at::Tensor>& noop,
                                   AdamHyper& h, py::handle step, bool has_ema) {
  const std::string& op = msg_op_;
  h.rule = rule_;
  set_form(has_ema);
  AdamBucket bucket;
  if (!gather(g, bucket)) {
    if (full_validate(g).rows == 0) {
      h.step = parse_step(op, step);
      check_scalars(op, chunk_size_, h);
      return;
    }
    if (!gather(g, bucket)) {
      // validated but not gatherable by the fast path (should not happen): generic path
      std::vector<PyTensorList> st(state_.size());
      std::vector<PyTensorList*> lists{const_cast<PyTensorList*>(&g)};
      for (size_t k = 0; k < state_.size(); ++k) {
        for (auto& t : state_[k]) st[k].items.push_back(&t);
        st[k].objs.assign(state_[k].size(), nullptr);
        lists.push_back(&st[k]);
      }
      bucket_from_lists(has_ema_, has_master_, lists, bucket);
    }
  }
  h.step = parse_step(op, step);
  check_scalars(op, chunk_size_, h);
  run_adam_bucket(bucket, has_ema_, has_master_, chunk_size_, noop, h);
}

py::list PreparedAdamFamily::state_lists() const {
  py::list out;
  for (const auto& l : state_) {
    py::list li;
    for (const auto& t : l) li.append(py::cast(t));
    out.append(li);
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// Bindings
// ------------------------------------------------------------------------------------------------

// The prepared call's positional scalars (the op's order after tensor_lists) parsed into h; then
// run(self, noop, h, step, has_ema).
template <typename Run>
auto prepared_call(PreparedAdamFamily& self, const std::optional<at::Tensor>& noop,
                   const py::args& args, const std::optional<at::Tensor>& grad_scale,
                   bool maximize, bool check_finite, const Run& run) {
  AdamHyper h;
  h.grad_scale = grad_scale;
  h.maximize = maximize;
  h.check_finite = check_finite;
  if (self.rule() == UpdateRule::kRAdam) {
    // lr, beta1, beta2, eps, step, weight_decay, decoupled_weight_decay(, ema_decay)
    TORCH_CHECK_TYPE(args.size() == 7 || args.size() == 8,
                     "multi_tensor_radam: prepared call takes 7 or 8 scalar arguments "
                     "after (grads, noop_flag), got ", args.size());
    h.lr = args[0].cast<double>();
    h.beta1 = args[1].cast<double>();
    h.beta2 = args[2].cast<double>();
    h.eps = args[3].cast<double>();
    py::handle step = args[4];
    h.weight_decay = args[5].cast<double>();
    h.mode = py::bool_(args[6]).cast<bool>() ? 1 : 0;
    h.bias_correction = true;
    const bool ema = args.size() == 8 && !args[7].is_none();
    h.ema_decay = ema ? args[7].cast<double>() : 0.0;
    return run(self, noop, h, step, ema);
  }
  const bool ema = self.has_ema();
  const size_t want = ema ? 9 : 8;
  TORCH_CHECK_TYPE(args.size() == want, family_op_name(UpdateRule::kAdam, ema),
                   ": prepared call takes ", want,
                   " scalar arguments after (grads, noop_flag), got ", args.size());
  size_t k = 0;
  h.lr = args[k++].cast<double>();
  h.ema_decay = ema ? args[k++].cast<double>() : 0.0;
  h.beta1 = args[k++].cast<double>();
  h.beta2 = args[k++].cast<double>();
  h.eps = args[k++].cast<double>();
  py::handle step = args[k++];
  h.mode = args[k++].cast<int64_t>();
  h.bias_correction = py::bool_(args[k++]).cast<bool>();
  h.weight_decay = args[k++].cast<double>();
  return run(self, noop, h, step, ema);
}

void bind_adam_family(py::module_& m) {
  using opt_t = std::optional<at::Tensor>;
  m.def(
      "fused_ema_adamw",
      [](int64_t chunk_size, const opt_t& noop, py::handle tensor_lists, double lr,
         double ema_decay, double beta1, double beta2, double eps, py::handle step, int64_t mode,
         bool bias_correction, double weight_decay, const opt_t& grad_scale, bool maximize,
         bool check_finite) {
        AdamHyper h{lr, ema_decay, beta1, beta2, eps, 0, mode, bias_correction, weight_decay,
                    grad_scale, maximize, check_finite};
        adam_family_op(true, chunk_size, noop, tensor_lists, h, step);
      },
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
      py::arg("ema_decay"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"),
      py::arg("mode"), py::arg("bias_correction"), py::arg("weight_decay"), py::kw_only(),
      py::arg("grad_scale") = py::none(), py::arg("maximize") = false,
      py::arg("check_finite") = false,
      "multi_tensor_fused_ema_adamw: [grads, params, exp_avgs, exp_avg_sqs, emas(, masters)], in "
      "place; bitwise equal to the reference backend.");
  m.def(
      "adam",
      [](int64_t chunk_size, const opt_t& noop, py::handle tensor_lists, double lr, double beta1,
         double beta2, double eps, py::handle step, int64_t mode, bool bias_correction,
         double weight_decay, const opt_t& grad_scale, bool maximize, bool check_finite) {
        AdamHyper h{lr, 0.0, beta1, beta2, eps, 0, mode, bias_correction, weight_decay,
                    grad_scale, maximize, check_finite};
        adam_family_op(false, chunk_size, noop, tensor_lists, h, step);
      },
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"), py::arg("mode"),
      py::arg("bias_correction"), py::arg("weight_decay"), py::kw_only(),
      py::arg("grad_scale") = py::none(), py::arg("maximize") = false,
      py::arg("check_finite") = false,
      "multi_tensor_adam: [grads, params, exp_avgs, exp_avg_sqs(, masters)], in place.");
  m.def(
      "radam",
      [](int64_t chunk_size, const opt_t& noop, py::handle tensor_lists, double lr, double beta1,
         double beta2, double eps, py::handle step, double weight_decay,
         bool decoupled_weight_decay, std::optional<double> ema_decay, const opt_t& grad_scale,
         bool maximize, bool check_finite) {
        AdamHyper h{lr, ema_decay.value_or(0.0), beta1, beta2, eps, 0,
                    decoupled_weight_decay ? 1 : 0, true, weight_decay, grad_scale, maximize,
                    check_finite, UpdateRule::kRAdam};
        adam_family_op(ema_decay.has_value(), chunk_size, noop, tensor_lists, h, step);
      },
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"),
      py::arg("weight_decay"), py::arg("decoupled_weight_decay"),
      py::arg("ema_decay") = py::none(), py::kw_only(), py::arg("grad_scale") = py::none(),
      py::arg("maximize") = false, py::arg("check_finite") = false,
      "multi_tensor_radam: torch.optim.RAdam (+ EMA). ema_decay None: [grads, params, exp_avgs, "
      "exp_avg_sqs(, masters)]; a float: [grads, params, exp_avgs, exp_avg_sqs, emas(, masters)]. "
      "In place; bitwise equal to the reference backend.");

  py::class_<PreparedAdamFamily>(m, "PreparedAdamFamily",
                                 "An adam-family op (fused_ema_adamw, adam, radam) bound to one "
                                 "bucket's state lists (params, exp_avgs, exp_avg_sqs[, emas]"
                                 "[, masters]). radam: each call's ema_decay picks the form.")
      .def(py::init<const std::string&, py::handle, int64_t>(), py::arg("op"),
           py::arg("state_lists"), py::arg("chunk_size"))
      .def("validate", &PreparedAdamFamily::validate, py::arg("grads"))
      .def_property_readonly("op", &PreparedAdamFamily::op_name)
      .def_property_readonly("chunk_size", &PreparedAdamFamily::chunk_size)
      .def_property_readonly("state_lists", &PreparedAdamFamily::state_lists)
      .def(
          "__call__",
          [](PreparedAdamFamily& self, py::handle grads, const opt_t& noop, py::args args,
             const opt_t& grad_scale, bool maximize, bool check_finite) {
            prepared_call(self, noop, args, grad_scale, maximize, check_finite,
                          [&](PreparedAdamFamily& s, const opt_t& nf, AdamHyper& h,
                              py::handle step, bool ema) { s.call(grads, nf, h, step, ema); });
          },
          py::arg("grads"), py::arg("noop_flag"),
          py::arg("grad_scale") = py::none(), py::arg("maximize") = false,
          py::arg("check_finite") = false)
      .def(
          "step_param_grads",
          [](PreparedAdamFamily& self, const opt_t& noop, py::args args, const opt_t& grad_scale,
             bool maximize, bool check_finite) {
            return prepared_call(self, noop, args, grad_scale, maximize, check_finite,
                                 [](PreparedAdamFamily& s, const opt_t& nf, AdamHyper& h,
                                    py::handle step, bool ema) {
                                   return s.call_param_grads(nf, h, step, ema);
                                 });
          },
          py::arg("noop_flag"), py::arg("grad_scale") = py::none(),
          py::arg("maximize") = false, py::arg("check_finite") = false,
          "__call__ with the grads of the bound params (the first state list), read from their "
          "`.grad`; returns False, running nothing, when any of them has no grad.");
}

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu
