// Python lists of tensors as the C++ side reads them. The Python front ends have already checked
// every list (multi_tensor/schema.py); this only unpacks, without touching reference counts.
#pragma once

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>
#include <vector>

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

namespace py = pybind11;

// The items of a list or tuple (borrowed: valid while it is alive) and their count.
inline std::pair<PyObject**, Py_ssize_t> sequence_items(py::handle obj) {
  PyObject* seq = obj.ptr();
  TORCH_CHECK_TYPE(PyList_Check(seq) || PyTuple_Check(seq), "expected a list of tensors, got ",
                   Py_TYPE(seq)->tp_name);
  return {PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq)};
}

// The at::Tensor behind a Python object, or nullptr for one that is not a tensor.
inline const at::Tensor* tensor_or_null(PyObject* item) {
  return THPVariable_Check(item) ? &THPVariable_Unpack(item) : nullptr;
}

// The at::Tensor behind each item of a list or tuple (nullptr for an item that is not a tensor).
inline std::vector<const at::Tensor*> unpack_tensors(py::handle obj) {
  const auto [items, n] = sequence_items(obj);
  std::vector<const at::Tensor*> out(n);
  for (Py_ssize_t i = 0; i < n; ++i) out[i] = tensor_or_null(items[i]);
  return out;
}

inline bool flag_is_set(const std::optional<at::Tensor>& flag) {
  if (!flag.has_value() || !flag->defined() || flag->numel() == 0) return false;
  const at::Tensor& t = *flag;
  if (t.is_cpu()) {  // the usual int32/float flags, read in place (no tensor ops per step)
    const void* p = t.const_data_ptr();
    switch (t.scalar_type()) {
      case c10::kInt: return *static_cast<const int32_t*>(p) != 0;
      case c10::kFloat: return *static_cast<const float*>(p) != 0.0f;
      case c10::kLong: return *static_cast<const int64_t*>(p) != 0;
      default: break;
    }
  }
  return t.reshape({-1})[0].item<double>() != 0.0;
}

inline void set_flag(const std::optional<at::Tensor>& flag) {
  if (flag.has_value() && flag->defined()) flag->fill_(1);
}

// True when a and b address their elements identically, so one flat index serves both.
inline bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_contiguous() && b.is_contiguous()) return true;
  return a.strides().equals(b.strides()) && a.is_non_overlapping_and_dense();
}

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu
