// The host side of the device backends at C speed: what a bind needs to know of a list of
// tensors (addresses, shapes, dtype, device, layout), in one pass that touches no reference
// count and runs no tensor op. A Python pass costs ~0.1-0.4 us per tensor and attribute; this
// costs a few ns, so a step over 3000 tensors checks them all in well under a millisecond.
// multi_tensor/tensor_facts.py holds the pure-Python twin (same results) for builds without it.
#include <ATen/core/Tensor.h>

#include <cstring>
#include <optional>
#include <string>

#include "pylists.h"

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

namespace {

// The address of a strided tensor's first element, as Python's data_ptr() gives it (the
// mutable pointer: a copy-on-write tensor is materialised first, so the address is the one a
// kernel writes through), or nullopt where it has none to give: a sparse tensor, a data_ptr()
// that throws (functional or throw-on-mutable tensors), or a null address for a nonempty
// tensor (meta tensors, and the storage of wrapper subclasses such as DTensor and FakeTensor).
std::optional<int64_t> address_of(const at::Tensor& t) {
  if (t.layout() != c10::kStrided || !t.has_storage()) return std::nullopt;
  try {
    const auto address = reinterpret_cast<int64_t>(t.data_ptr());
    if (address == 0 && t.numel() != 0) return std::nullopt;
    return address;
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

// One native int64 per item of a list of tensors (``value``: the item's, or nullopt), packed as
// bytes; None when an item is not a tensor or has no value.
template <typename Value>
py::object pack_per_tensor(py::handle obj, Value value) {
  const auto [items, n] = sequence_items(obj);
  std::string out(static_cast<size_t>(n) * sizeof(int64_t), '\0');
  auto* packed = reinterpret_cast<int64_t*>(out.data());
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor* t = tensor_or_null(items[i]);
    if (t == nullptr) return py::none();
    const std::optional<int64_t> v = value(*t);
    if (!v) return py::none();
    packed[i] = *v;
  }
  return py::bytes(out);
}

// addresses(seq) -> bytes: each item's data_ptr, or None when an item is not a tensor or has no
// address (the caller then treats the list as changed).
py::object addresses(py::handle obj) { return pack_per_tensor(obj, address_of); }

// describe(seq) -> (addresses, shapes, dtype, device, contiguous) or None:
//   addresses:  bytes, each item's data_ptr (native int64);
//   shapes:     bytes, each item's ndim then its sizes (native int64), so two lists of the same
//               shapes give equal bytes;
//   dtype:      the items' one dtype, or None when they differ;
//   device:     the items' one device, or None when they differ;
//   contiguous: bytes, 1 per contiguous item, else 0.
// None when an item is not a strided tensor with an address (not a tensor, sparse, traced).
py::object describe(py::handle obj) {
  const auto [items, n] = sequence_items(obj);
  std::string ptrs(static_cast<size_t>(n) * sizeof(int64_t), '\0');
  std::string shapes;
  shapes.reserve(static_cast<size_t>(n) * 3 * sizeof(int64_t));
  std::string contiguous(static_cast<size_t>(n), '\0');
  auto* p = reinterpret_cast<int64_t*>(ptrs.data());
  std::optional<c10::ScalarType> dtype;
  std::optional<c10::Device> device;
  bool one_dtype = true, one_device = true;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor* item = tensor_or_null(items[i]);
    if (item == nullptr) return py::none();
    const at::Tensor& t = *item;
    const auto a = address_of(t);
    if (!a) return py::none();
    p[i] = *a;
    c10::IntArrayRef sizes;
    try {
      sizes = t.sizes();  // (throws for symbolic sizes)
    } catch (const c10::Error&) {
      return py::none();
    }
    const int64_t ndim = static_cast<int64_t>(sizes.size());
    shapes.append(reinterpret_cast<const char*>(&ndim), sizeof(int64_t));
    shapes.append(reinterpret_cast<const char*>(sizes.data()), sizes.size() * sizeof(int64_t));
    contiguous[i] = t.is_contiguous() ? 1 : 0;
    if (i == 0) {
      dtype = t.scalar_type();
      device = t.device();
    } else {
      one_dtype = one_dtype && t.scalar_type() == *dtype;
      one_device = one_device && t.device() == *device;
    }
  }
  py::object dt = one_dtype && dtype ? py::cast(*dtype) : py::none();
  py::object dev = one_device && device ? py::cast(*device) : py::none();
  return py::make_tuple(py::bytes(ptrs), py::bytes(shapes), dt, dev, py::bytes(contiguous));
}

// versions(seq) -> bytes: each tensor's version counter, or None when an item is not a tensor
// or keeps no counter (an inference tensor).
py::object versions(py::handle obj) {
  return pack_per_tensor(obj, [](const at::Tensor& t) -> std::optional<int64_t> {
    if (t.is_inference()) return std::nullopt;
    return static_cast<int64_t>(t._version());
  });
}

// same_objects(a, b) -> bool: the two lists hold the very same objects, in order (identity;
// nothing is compared by value).
bool same_objects(py::handle a, py::handle b) {
  if (a.ptr() == b.ptr()) return true;
  const auto [xs, n] = sequence_items(a);
  const auto [ys, m] = sequence_items(b);
  if (n != m) return false;
  for (Py_ssize_t i = 0; i < n; ++i)
    if (xs[i] != ys[i]) return false;
  return true;
}

// The tensor's metadata and its storage's, a few items ahead of a pass over thousands of small
// tensors scattered over the heap (such a pass is bound by cache misses).
inline void prefetch_facts(PyObject* item) {
  if (!THPVariable_Check(item)) return;
  const c10::TensorImpl* impl = THPVariable_Unpack(item).unsafeGetTensorImpl();
  __builtin_prefetch(impl);
  __builtin_prefetch(reinterpret_cast<const char*>(impl) + 64);
  __builtin_prefetch(reinterpret_cast<const char*>(impl) + 128);
}

// addresses_match(seq, packed) -> bool: addresses(seq) == packed, without building the bytes and
// stopping at the first difference.
bool addresses_match(py::handle obj, py::bytes packed) {
  const auto [items, n] = sequence_items(obj);
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(packed.ptr(), &data, &size) != 0) throw py::error_already_set();
  if (size != n * static_cast<Py_ssize_t>(sizeof(int64_t))) return false;
  constexpr Py_ssize_t kAhead = 8;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch_facts(items[i + kAhead]);
    const at::Tensor* t = tensor_or_null(items[i]);
    if (t == nullptr) return false;
    const std::optional<int64_t> a = address_of(*t);
    int64_t expected;
    std::memcpy(&expected, data + i * sizeof(int64_t), sizeof(int64_t));
    if (!a || *a != expected) return false;
  }
  return true;
}

// grads_of(params, last) -> list or None: [p.grad for p in params], or ``last`` itself (the same
// list object) when it holds exactly those grads (each the same tensor, None where a param has
// none): a steady-state step then makes no Python object at all. A tensor's Python object is
// unique to its TensorImpl, so comparing the impls compares the objects p.grad would return.
// None when a param is not exactly a torch.Tensor or torch.nn.Parameter (a subclass may define
// .grad in Python: the caller reads it there).
py::object grads_of(py::handle params, py::handle last) {
  const auto [ps, n] = sequence_items(params);
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!THPVariable_CheckExact(ps[i])) return py::none();
  if (!last.is_none()) {
    const auto [ls, m] = sequence_items(last);
    bool same = m == n;
    constexpr Py_ssize_t kAhead = 8;
    for (Py_ssize_t i = 0; same && i < n; ++i) {
      if (i + kAhead < n) prefetch_facts(ps[i + kAhead]);
      const at::Tensor& g = THPVariable_Unpack(ps[i]).grad();
      PyObject* held = ls[i];
      if (held == Py_None) {
        same = !g.defined();
      } else {
        same = g.defined() && THPVariable_Check(held) &&
               THPVariable_Unpack(held).unsafeGetTensorImpl() == g.unsafeGetTensorImpl();
      }
    }
    if (same) return py::reinterpret_borrow<py::object>(last);
  }
  PyObject* out = PyList_New(n);
  if (out == nullptr) throw py::error_already_set();
  py::object result = py::reinterpret_steal<py::object>(out);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor& g = THPVariable_Unpack(ps[i]).grad();
    PyObject* item;
    if (g.defined()) {
      item = THPVariable_Wrap(g);
      if (item == nullptr) throw py::error_already_set();
    } else {
      Py_INCREF(Py_None);
      item = Py_None;
    }
    PyList_SET_ITEM(out, i, item);
  }
  return result;
}

}  // namespace

void bind_tensor_facts(py::module_& m) {
  m.def("addresses", &addresses, py::arg("tensors"),
        "Each tensor's data_ptr as native int64 bytes, or None when an item has no address.");
  m.def("describe", &describe, py::arg("tensors"),
        "(addresses, shapes, dtype, device, contiguous) of a list of strided tensors, or None.");
  m.def("same_objects", &same_objects, py::arg("a"), py::arg("b"),
        "Whether two lists hold the very same objects, in order (by identity).");
  m.def("addresses_match", &addresses_match, py::arg("tensors"), py::arg("packed"),
        "Whether addresses(tensors) == packed (stops at the first difference).");
  m.def("grads_of", &grads_of, py::arg("params"), py::arg("last"),
        "[p.grad for p in params], or last itself when it holds exactly those grads; None when "
        "a param is not exactly a Tensor or Parameter.");
  m.def("versions", &versions, py::arg("tensors"),
        "Each tensor's version counter as native int64 bytes, or None when one keeps none.");
}

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu
