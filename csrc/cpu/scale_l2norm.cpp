// apex multi_tensor_scale and multi_tensor_l2norm on the shared chunked launcher.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>

#include <atomic>
#include <cmath>
#include <cstring>

#include "launcher.h"
#include "pylists.h"
#include "vec_io.h"

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

namespace {

bool supported(c10::ScalarType t) {
  return t == c10::kHalf || t == c10::kBFloat16 || t == c10::kFloat || t == c10::kDouble;
}

// ---- scale: dst = round(opmath(src) * opmath(scale)); opmath is fp64 if either side is fp64 ----

struct ScaleRow {
  const void* src;
  void* dst;
  c10::ScalarType st, dt;
};

template <typename S, typename D, typename opmath_t>
bool scale_vec(const S* src, D* dst, int64_t n, opmath_t scale) {
  using V = Vectorized<opmath_t>;
  constexpr int64_t B = block_size<opmath_t>();
  const V sv(scale);
  V acc(opmath_t(0));
  V a, b;
  int64_t i = 0;
  for (; i + B <= n; i += B) {
    load_block<S, opmath_t>(src + i, B, a, b);
    acc = acc + (a - a);
    acc = acc + (b - b);
    store_block<D, opmath_t>(dst + i, B, a * sv, b * sv);
  }
  if (i < n) {
    S sb[B];
    D db[B];
    for (int64_t k = 0; k < B; ++k) sb[k] = S(0);
    std::memcpy(sb, src + i, sizeof(S) * (n - i));
    load_block<S, opmath_t>(sb, B, a, b);
    acc = acc + (a - a);
    acc = acc + (b - b);
    store_block<D, opmath_t>(db, B, a * sv, b * sv);
    std::memcpy(dst + i, db, sizeof(D) * (n - i));
  }
  return any_lane_nan(acc);
}

// Mixed pairs with an fp64 side: scalar, converting like torch's copy_ (double -> float -> low).
template <typename S, typename D>
bool scale_scalar_fp64(const S* src, D* dst, int64_t n, double scale) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(static_cast<float>(src[i]));
    bad |= !std::isfinite(x);
    const double y = x * scale;
    if constexpr (std::is_same_v<D, double>) {
      dst[i] = y;
    } else {
      dst[i] = static_cast<D>(static_cast<float>(y));
    }
  }
  return bad;
}

template <typename S>
bool scale_from(const S* src, void* dst, c10::ScalarType dt, int64_t n, double scale) {
  if constexpr (std::is_same_v<S, double>) {
    switch (dt) {
      case c10::kDouble: return scale_vec<double, double, double>(src, static_cast<double*>(dst), n, scale);
      default: {
        // fp64 source, lower-precision destination: products in fp64, rounded via float.
        bool bad = false;
        for (int64_t i = 0; i < n; ++i) {
          bad |= !std::isfinite(src[i]);
          const double y = src[i] * scale;
          switch (dt) {
            case c10::kFloat: static_cast<float*>(dst)[i] = static_cast<float>(y); break;
            case c10::kHalf: static_cast<c10::Half*>(dst)[i] = c10::Half(static_cast<float>(y)); break;
            default: static_cast<c10::BFloat16*>(dst)[i] = c10::BFloat16(static_cast<float>(y)); break;
          }
        }
        return bad;
      }
    }
  } else {
    switch (dt) {
      case c10::kDouble: return scale_scalar_fp64<S, double>(src, static_cast<double*>(dst), n, scale);
      case c10::kFloat: return scale_vec<S, float, float>(src, static_cast<float*>(dst), n, static_cast<float>(scale));
      case c10::kHalf: return scale_vec<S, c10::Half, float>(src, static_cast<c10::Half*>(dst), n, static_cast<float>(scale));
      default: return scale_vec<S, c10::BFloat16, float>(src, static_cast<c10::BFloat16*>(dst), n, static_cast<float>(scale));
    }
  }
}

bool scale_chunk(const ScaleRow& r, int64_t start, int64_t end, double scale) {
  const int64_t n = end - start;
  const int64_t off = start;
  auto dst_at = [&](size_t esz) { return static_cast<char*>(r.dst) + off * static_cast<int64_t>(esz); };
  const size_t desz = c10::elementSize(r.dt);
  void* d = dst_at(desz);
  switch (r.st) {
    case c10::kFloat: return scale_from<float>(static_cast<const float*>(r.src) + off, d, r.dt, n, scale);
    case c10::kDouble: return scale_from<double>(static_cast<const double*>(r.src) + off, d, r.dt, n, scale);
    case c10::kHalf: return scale_from<c10::Half>(static_cast<const c10::Half*>(r.src) + off, d, r.dt, n, scale);
    default: return scale_from<c10::BFloat16>(static_cast<const c10::BFloat16*>(r.src) + off, d, r.dt, n, scale);
  }
}

// The lists of a call, checked by the Python front end; returns the row count.
int64_t unpack_lists(py::handle tensor_lists, size_t count,
                     std::vector<std::vector<const at::Tensor*>>& lists) {
  lists.clear();
  for (py::handle list : tensor_lists) lists.push_back(unpack_tensors(list));
  TORCH_CHECK(lists.size() == count, "expected ", count, " tensor lists");
  return static_cast<int64_t>(lists[0].size());
}

// Returns false (nothing modified) when a dtype is not handled natively; Python then runs the
// reference implementation.
bool scale_op(int64_t chunk_size, const std::optional<at::Tensor>& noop, py::handle tensor_lists,
              double scale) {
  std::vector<std::vector<const at::Tensor*>> lists;
  const int64_t n = unpack_lists(tensor_lists, 2, lists);
  const auto& srcs = lists[0];
  const auto& dsts = lists[1];
  if (n == 0) return true;
  for (int64_t i = 0; i < n; ++i) {
    if (!supported(srcs[i]->scalar_type()) || !supported(dsts[i]->scalar_type()))
      return false;
  }
  std::vector<ScaleRow> rows(n);
  std::vector<int64_t> numels(n);
  std::vector<at::Tensor> temps;
  std::vector<std::pair<at::Tensor, at::Tensor>> writeback;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& s = *srcs[i];
    const at::Tensor& d = *dsts[i];
    numels[i] = d.numel();
    rows[i].st = s.scalar_type();
    rows[i].dt = d.scalar_type();
    const bool dflat = d.is_contiguous() || d.is_non_overlapping_and_dense();
    at::Tensor dd = d;
    if (!dflat) {
      dd = at::empty(d.sizes(), d.options());
      writeback.emplace_back(d, dd);
      temps.push_back(dd);
    }
    at::Tensor ss = s;
    if (!same_layout(s, dd)) {
      ss = at::empty_strided(dd.sizes(), dd.strides(), s.options());
      ss.copy_(s);
      temps.push_back(ss);
    }
    rows[i].src = ss.numel() ? ss.const_data_ptr() : nullptr;
    rows[i].dst = dd.numel() ? dd.data_ptr() : nullptr;
  }
  std::vector<Chunk> chunks;
  const int64_t total = build_chunks(numels, chunk_size, chunks);
  std::atomic<bool> bad{false};
  {
    py::gil_scoped_release nogil;
    launch(chunks, total, [&](const Chunk& ch) {
      if (scale_chunk(rows[ch.row], ch.start, ch.end, scale)) bad.store(true, std::memory_order_relaxed);
    });
  }
  for (auto& wb : writeback) wb.first.copy_(wb.second);
  if (bad.load()) set_flag(noop);
  return true;
}

// ---- l2norm: fixed 4096-element blocks summed in fp64, combined in index order ----

constexpr int64_t kNormBlock = 4096;

template <typename T>
double sumsq(const T* p, int64_t n, bool& bad) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  double fin[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const double x = static_cast<double>(static_cast<std::conditional_t<std::is_same_v<T, double>, double, float>>(p[i + k]));
      acc[k] += x * x;
      fin[k] += x - x;
    }
  }
  for (int k = 0; i < n; ++i, ++k) {
    const double x = static_cast<double>(static_cast<std::conditional_t<std::is_same_v<T, double>, double, float>>(p[i]));
    acc[k] += x * x;
    fin[k] += x - x;
  }
  double s = 0.0, f = 0.0;
  for (int k = 0; k < 8; ++k) {
    s += acc[k];
    f += fin[k];
  }
  if (f != f) bad = true;
  return s;
}

std::optional<std::tuple<at::Tensor, at::Tensor>> l2norm_op(int64_t chunk_size,
                                                            const std::optional<at::Tensor>& noop,
                                                            py::handle tensor_lists,
                                                            bool per_tensor) {
  std::vector<std::vector<const at::Tensor*>> lists;
  const int64_t n = unpack_lists(tensor_lists, 1, lists);
  const auto& ts = lists[0];
  for (int64_t i = 0; i < n; ++i)
    if (!supported(ts[i]->scalar_type())) return std::nullopt;
  std::vector<const void*> ptrs(n);
  std::vector<c10::ScalarType> dts(n);
  std::vector<int64_t> numels(n);
  std::vector<at::Tensor> temps;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = *ts[i];
    const at::Tensor* use = &t;
    if (!(t.is_contiguous() || t.is_non_overlapping_and_dense())) {
      temps.push_back(t.contiguous());
      use = &temps.back();
    }
    ptrs[i] = use->numel() ? use->const_data_ptr() : nullptr;
    dts[i] = t.scalar_type();
    numels[i] = t.numel();
  }
  // The block table is independent of chunk_size and of the thread count.
  std::vector<Chunk> blocks;
  const int64_t total = build_chunks(numels, kNormBlock, blocks);
  std::vector<double> partial(blocks.size());
  std::atomic<bool> bad{false};
  {
    py::gil_scoped_release nogil;
    launch_indexed(blocks, total, [&](int64_t idx) {
      const Chunk& b = blocks[idx];
      const int64_t len = b.end - b.start;
      bool nf = false;
      double s;
      switch (dts[b.row]) {
        case c10::kFloat: s = sumsq(static_cast<const float*>(ptrs[b.row]) + b.start, len, nf); break;
        case c10::kDouble: s = sumsq(static_cast<const double*>(ptrs[b.row]) + b.start, len, nf); break;
        case c10::kHalf: s = sumsq(static_cast<const c10::Half*>(ptrs[b.row]) + b.start, len, nf); break;
        default: s = sumsq(static_cast<const c10::BFloat16*>(ptrs[b.row]) + b.start, len, nf); break;
      }
      partial[idx] = s;
      if (nf) bad.store(true, std::memory_order_relaxed);
    });
  }
  std::vector<double> per(n, 0.0);
  for (size_t k = 0; k < blocks.size(); ++k) per[blocks[k].row] += partial[k];
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += per[i];
  at::Tensor total_t = at::empty({}, at::TensorOptions().dtype(at::kFloat));
  *total_t.mutable_data_ptr<float>() = static_cast<float>(std::sqrt(sum));
  at::Tensor per_t;
  if (per_tensor) {
    per_t = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
    float* o = per_t.mutable_data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(std::sqrt(per[i]));
  } else {
    per_t = at::zeros({0}, at::TensorOptions().dtype(at::kFloat));
  }
  if (bad.load()) set_flag(noop);
  return std::make_tuple(total_t, per_t);
}

}  // namespace

void bind_scale_l2norm(py::module_& m) {
  m.def("scale", &scale_op, py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
        py::arg("scale"),
        "multi_tensor_scale: dsts[i] = srcs[i] * scale; sets noop_flag on a non-finite source. "
        "Returns False (nothing done) for dtypes the native kernel does not handle.");
  m.def("l2norm", &l2norm_op, py::arg("chunk_size"), py::arg("noop_flag"),
        py::arg("tensor_lists"), py::arg("per_tensor") = false,
        "multi_tensor_l2norm: (total_norm, per_tensor_norms) as fp32 tensors, or None for dtypes "
        "the native kernel does not handle.");
}

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu
