// Shared pieces of the native CPU multi-tensor backend: the chunked launcher (one parallel region
// over every chunk of every tensor of a bucket), vector load/store helpers that convert between
// storage dtypes and opmath, Python list unpacking and apex-style validation messages.
//
// Every translation unit is compiled three times (DEFAULT, AVX2, AVX512 via CPU_CAPABILITY*), each
// build being its own extension module; all code lives in an ISA-specific inline namespace so the
// three builds can never share symbols.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif

#define MT_STR2(x) #x
#define MT_STR(x) MT_STR2(x)

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

namespace py = pybind11;
using at::vec::Vectorized;

// ------------------------------------------------------------------------------------------------
// Launcher (apex multi_tensor_apply / ATen FusedAdamKernel style)
// ------------------------------------------------------------------------------------------------

// One unit of work: elements [start, end) of row `row` (int64 offsets: tensors may exceed 2^31).
struct Chunk {
  int64_t row;
  int64_t start;
  int64_t end;
};

// Below this many elements in total a call runs inline on the calling thread (no fork/join).
constexpr int64_t kInlineNumel = 32768;

// Cut every row of `numels` into chunks of `chunk_size` elements; returns the total element count.
inline int64_t build_chunks(const std::vector<int64_t>& numels, int64_t chunk_size,
                            std::vector<Chunk>& chunks) {
  chunks.clear();
  int64_t total = 0;
  size_t count = 0;
  for (int64_t n : numels) count += static_cast<size_t>((n + chunk_size - 1) / chunk_size);
  chunks.reserve(count);
  for (size_t r = 0; r < numels.size(); ++r) {
    const int64_t n = numels[r];
    total += n;
    for (int64_t s = 0; s < n; s += chunk_size) {
      const int64_t e = (n - s > chunk_size) ? s + chunk_size : n;
      chunks.push_back(Chunk{static_cast<int64_t>(r), s, e});
    }
  }
  return total;
}

struct VmlSqrt;
const VmlSqrt& vml_sqrt();
inline void with_mkl_single_thread_begin(int& prev);
inline void with_mkl_single_thread_end(int prev);

// Run f(first_chunk, count) over contiguous runs of the chunk table: one at::parallel_for over
// all chunks of all tensors, or inline when the call is small. Every element is processed by
// exactly one thread with the same code, so results do not depend on chunk size or threads.
template <typename F>
inline void launch_ranges(const std::vector<Chunk>& chunks, int64_t total, const F& f) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  if (n == 0) return;
  if (total < kInlineNumel || n == 1 || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    int prev;
    with_mkl_single_thread_begin(prev);
    f(chunks.data(), n);
    with_mkl_single_thread_end(prev);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    int prev;
    with_mkl_single_thread_begin(prev);
    f(chunks.data() + begin, end - begin);
    with_mkl_single_thread_end(prev);
  });
}

// Run f(chunk) for every chunk.
template <typename F>
inline void launch(const std::vector<Chunk>& chunks, int64_t total, const F& f) {
  launch_ranges(chunks, total, [&](const Chunk* c, int64_t n) {
    for (int64_t i = 0; i < n; ++i) f(c[i]);
  });
}

// ------------------------------------------------------------------------------------------------
// Vector I/O: a "block" is 2 opmath vectors (= one Vectorized<Half/BFloat16> when opmath is float).
// ------------------------------------------------------------------------------------------------

template <typename opmath_t>
constexpr int64_t block_size() {
  return 2 * static_cast<int64_t>(Vectorized<opmath_t>::size());
}

template <typename T, typename opmath_t>
inline void load2(const T* p, Vectorized<opmath_t>& a, Vectorized<opmath_t>& b) {
  if constexpr (std::is_same_v<T, opmath_t>) {
    a = Vectorized<opmath_t>::loadu(p);
    b = Vectorized<opmath_t>::loadu(p + Vectorized<opmath_t>::size());
  } else {
    static_assert(std::is_same_v<opmath_t, float>, "reduced types convert to float");
    static_assert(Vectorized<T>::size() == 2 * Vectorized<float>::size(), "vector widths");
    auto v = Vectorized<T>::loadu(p);
    auto ab = at::vec::convert_to_float<T>(v);
    a = std::get<0>(ab);
    b = std::get<1>(ab);
  }
}

template <typename T, typename opmath_t>
inline void store2(T* p, const Vectorized<opmath_t>& a, const Vectorized<opmath_t>& b) {
  if constexpr (std::is_same_v<T, opmath_t>) {
    a.store(p);
    b.store(p + Vectorized<opmath_t>::size());
  } else {
    static_assert(std::is_same_v<opmath_t, float>, "reduced types convert from float");
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

// ------------------------------------------------------------------------------------------------
// sqrt, bit-identical to torch.sqrt on this torch build. torch's CPU sqrt kernel calls MKL VML
// (vmsSqrt/vmdSqrt with VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE, see ATen/cpu/vml.h) when
// torch is built with MKL; that routine is not always correctly rounded, so the reference
// backend's bits depend on it. We call the very same MKL routine (exported by libtorch_cpu,
// resolved weakly) over a tile of elements, and fall back to Vectorized::sqrt (what torch uses
// without MKL) when it is absent.
// ------------------------------------------------------------------------------------------------

constexpr int64_t kTile = 1024;  // elements per sqrt call

using vml_s_fn = void (*)(int64_t, const float*, float*, long long);
using vml_d_fn = void (*)(int64_t, const double*, double*, long long);

using mkl_threads_fn = int (*)(int);

struct VmlSqrt {
  vml_s_fn s = nullptr;
  vml_d_fn d = nullptr;
  mkl_threads_fn set_threads_local = nullptr;  // MKL_Set_Num_Threads_Local (C API)
};


// Resolved once per process in module.cpp (dlsym on libtorch_cpu's symbols).
const VmlSqrt& vml_sqrt();

inline void with_mkl_single_thread_begin(int& prev) {
  const auto fn = vml_sqrt().set_threads_local;
  prev = fn ? fn(1) : 0;
}
inline void with_mkl_single_thread_end(int prev) {
  const auto fn = vml_sqrt().set_threads_local;
  if (fn) fn(prev);
}

template <typename opmath_t>
inline void tile_sqrt(opmath_t* q, int64_t n) {
  constexpr long long kMode = 0x00000002 /*VML_HA*/ | 0x00140000 /*VML_FTZDAZ_OFF*/ |
                              0x00000100 /*VML_ERRMODE_IGNORE*/;
  const VmlSqrt& f = vml_sqrt();
  if constexpr (std::is_same_v<opmath_t, float>) {
    if (f.s) {
      f.s(n, q, q, kMode);
      return;
    }
  } else {
    if (f.d) {
      f.d(n, q, q, kMode);
      return;
    }
  }
  using V = Vectorized<opmath_t>;
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) V::loadu(q + i).sqrt().store(q + i);
  if (i < n) V::loadu(q + i, n - i).sqrt().store(q + i, n - i);
}

// Whether any lane of a (x - x) accumulator is NaN, i.e. some accumulated x was inf/NaN.
template <typename opmath_t>
inline bool any_lane_nan(const Vectorized<opmath_t>& acc) {
  opmath_t out[Vectorized<opmath_t>::size()];
  acc.store(out);
  for (int64_t k = 0; k < Vectorized<opmath_t>::size(); ++k)
    if (out[k] != out[k]) return true;
  return false;
}

// Any inf/NaN among n elements of p (x - x is 0 for finite x, NaN otherwise).
template <typename T, typename opmath_t>
inline bool has_nonfinite(const T* p, int64_t n) {
  constexpr int64_t B = block_size<opmath_t>();
  using V = Vectorized<opmath_t>;
  V acc(opmath_t(0));
  Vectorized<opmath_t> a, b;
  int64_t i = 0;
  for (; i + B <= n; i += B) {
    load2<T, opmath_t>(p + i, a, b);
    acc = acc + (a - a);
    acc = acc + (b - b);
  }
  if (i < n) {
    T buf[B];
    for (int64_t k = 0; k < B; ++k) buf[k] = T(0);
    std::memcpy(buf, p + i, sizeof(T) * (n - i));
    load2<T, opmath_t>(buf, a, b);
    acc = acc + (a - a);
    acc = acc + (b - b);
  }
  return any_lane_nan(acc);
}

// ------------------------------------------------------------------------------------------------
// Python helpers and message formatting (mirrors multi_tensor/validation.py)
// ------------------------------------------------------------------------------------------------

inline std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "torch.float32";
    case c10::kDouble: return "torch.float64";
    case c10::kHalf: return "torch.float16";
    case c10::kBFloat16: return "torch.bfloat16";
    case c10::kLong: return "torch.int64";
    case c10::kInt: return "torch.int32";
    case c10::kShort: return "torch.int16";
    case c10::kChar: return "torch.int8";
    case c10::kByte: return "torch.uint8";
    case c10::kBool: return "torch.bool";
    case c10::kComplexFloat: return "torch.complex64";
    case c10::kComplexDouble: return "torch.complex128";
    case c10::kComplexHalf: return "torch.complex32";
    case c10::ScalarType::Float8_e4m3fn: return "torch.float8_e4m3fn";
    case c10::ScalarType::Float8_e5m2: return "torch.float8_e5m2";
    default: return std::string("torch.") + c10::toString(t);
  }
}

inline std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) os << ", ";
    os << s[i];
  }
  if (s.size() == 1) os << ",";
  os << ")";
  return os.str();
}

inline std::string layout_name(c10::Layout l) {
  switch (l) {
    case c10::kSparse: return "torch.sparse_coo";
    case c10::kSparseCsr: return "torch.sparse_csr";
    case c10::kSparseCsc: return "torch.sparse_csc";
    case c10::kSparseBsr: return "torch.sparse_bsr";
    case c10::kSparseBsc: return "torch.sparse_bsc";
    case c10::kMkldnn: return "torch._mkldnn";
    default: {
      std::ostringstream os;
      os << l;
      return os.str();
    }
  }
}

inline std::string device_str(const at::Tensor& t) { return t.device().str(); }

// One Python list of tensors, unpacked without touching refcounts of the tensors: `items` point
// at the at::Tensor held by each Python object (nullptr for a non-tensor); `holder` keeps a
// PySequence_Fast alive when the input was not a list/tuple.
struct PyTensorList {
  std::vector<const at::Tensor*> items;
  std::vector<PyObject*> objs;
  py::object holder;
  size_t size() const { return items.size(); }
};

inline void unpack_list(py::handle obj, PyTensorList& out, const std::string& what) {
  PyObject* seq = obj.ptr();
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
    PyObject* fast = PySequence_Fast(seq, "");
    if (fast == nullptr) {
      PyErr_Clear();
      TORCH_CHECK_TYPE(false, what, " must be a list of tensors, got ",
                       Py_TYPE(obj.ptr())->tp_name);
    }
    out.holder = py::reinterpret_steal<py::object>(fast);
    seq = fast;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  out.items.resize(n);
  out.objs.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* it = items[i];
    out.objs[i] = it;
    out.items[i] = THPVariable_Check(it) ? &THPVariable_Unpack(it) : nullptr;
  }
}

inline std::string type_name_of(PyObject* o) { return Py_TYPE(o)->tp_name; }

// check_tensor() of validation.py: a dense float tensor with the row reference's shape/device.
inline void check_tensor(const std::string& op, const char* name, int64_t i,
                         const at::Tensor* t, PyObject* obj, const at::Tensor* ref,
                         const char* ref_name) {
  TORCH_CHECK_TYPE(t != nullptr, op, ": ", name, "[", i, "] must be a torch.Tensor, got ",
                   obj ? type_name_of(obj) : std::string("None"));
  TORCH_CHECK(t->layout() == c10::kStrided, op, ": ", name, "[", i, "] is a sparse tensor (",
              layout_name(t->layout()),
              "); fused optimizers need dense tensors (sparse gradients are not supported)");
  TORCH_CHECK_TYPE(at::isFloatingType(t->scalar_type()), op, ": ", name, "[", i,
                   "] must be a floating-point tensor, got ", dtype_name(t->scalar_type()));
  if (ref != nullptr && !t->is_same(*ref)) {
    TORCH_CHECK_VALUE(t->sizes().equals(ref->sizes()), op, ": ", name, "[", i, "] has shape ",
                      shape_str(t->sizes()), " but ", ref_name, "[", i, "] has shape ",
                      shape_str(ref->sizes()));
    TORCH_CHECK(t->device() == ref->device(), op, ": ", name, "[", i, "] is on ", device_str(*t),
                " but ", ref_name, "[", i, "] is on ", device_str(*ref));
  }
}

// check_rows() of validation.py over already unpacked lists, plus "CPU only".
inline int64_t check_rows(const std::string& op, const std::vector<PyTensorList*>& lists,
                          const std::vector<const char*>& names, size_t ref_list) {
  size_t n = lists.empty() ? 0 : lists[0]->size();
  bool same = true;
  for (auto* l : lists) same = same && l->size() == n;
  if (!same) {
    std::ostringstream os;
    for (size_t k = 0; k < lists.size(); ++k) os << (k ? ", " : "") << names[k] << "=" << lists[k]->size();
    TORCH_CHECK_VALUE(false, op, ": tensor lists must have equal lengths, got ", os.str());
  }
  const auto& refs = *lists[ref_list];
  for (size_t li = 0; li < lists.size(); ++li) {
    for (size_t i = 0; i < n; ++i) {
      check_tensor(op, names[li], i, lists[li]->items[i], lists[li]->objs[i],
                   li != ref_list ? refs.items[i] : nullptr, names[ref_list]);
    }
  }
  if (n) {
    const auto dev = refs.items[0]->device();
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(refs.items[i]->device() == dev, op, ": ", names[ref_list], "[", i, "] is on ",
                  device_str(*refs.items[i]), " but ", names[ref_list], "[0] is on ", dev.str(),
                  "; one call runs on one device (bucket tensors by device first)");
    }
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(refs.items[i]->is_cpu(), op, ": ", names[ref_list], "[", i, "] is on ",
                  device_str(*refs.items[i]),
                  "; the native CPU backend only runs CPU tensors");
    }
  }
  return static_cast<int64_t>(n);
}

// ------------------------------------------------------------------------------------------------
// noop flag and row layout helpers
// ------------------------------------------------------------------------------------------------

inline bool noop_is_set(const std::optional<at::Tensor>& noop) {
  if (!noop.has_value() || !noop->defined() || noop->numel() == 0) return false;
  const at::Tensor& t = *noop;
  if (!t.is_cpu()) return t.reshape({-1})[0].item().toDouble() != 0.0;
  const void* p = t.const_data_ptr();
  switch (t.scalar_type()) {
    case c10::kInt: return *static_cast<const int32_t*>(p) != 0;
    case c10::kLong: return *static_cast<const int64_t*>(p) != 0;
    case c10::kFloat: return *static_cast<const float*>(p) != 0.0f;
    case c10::kDouble: return *static_cast<const double*>(p) != 0.0;
    case c10::kBool: return *static_cast<const bool*>(p);
    case c10::kByte: return *static_cast<const uint8_t*>(p) != 0;
    default: return t.reshape({-1})[0].item().toDouble() != 0.0;
  }
}

inline void set_noop(const std::optional<at::Tensor>& noop) {
  if (noop.has_value() && noop->defined()) noop->fill_(1);
}

// True when a and b address their elements identically (same sizes and strides, or both
// contiguous).
inline bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_contiguous() && b.is_contiguous()) return true;
  return a.strides().equals(b.strides());
}

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu
