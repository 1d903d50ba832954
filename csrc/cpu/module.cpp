// The extension module: built three times (multi_tensor._C_default / _C_avx2 / _C_avx512) from
// the same sources with different CPU_CAPABILITY flags; multi_tensor/backends/native_cpu.py
// imports the best one the CPU allows.
#include <ATen/Context.h>
#include <dlfcn.h>

#include "adam_family.h"

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

// MKL's ILP64 entry points (int64 length) exported by libtorch_cpu when torch uses MKL; only
// used when torch itself uses MKL for sqrt (at::hasMKL()). MULTI_TENSOR_NO_VML=1 disables them
// (for experiments; the result then differs from torch.sqrt where MKL is not correctly rounded).
const VmlSqrt& vml_sqrt() {
  static const VmlSqrt fns = [] {
    VmlSqrt f;
    const char* off = std::getenv("MULTI_TENSOR_NO_VML");
    if ((off && off[0] && off[0] != '0') || !at::hasMKL()) return f;
    void* self = dlopen(nullptr, RTLD_NOW | RTLD_NOLOAD);
    void* h = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
    for (void* handle : {h, self}) {
      if (!handle) continue;
      if (!f.s) f.s = reinterpret_cast<vml_s_fn>(dlsym(handle, "vmsSqrt_64"));
      if (!f.d) f.d = reinterpret_cast<vml_d_fn>(dlsym(handle, "vmdSqrt_64"));
      if (!f.set_threads_local)
        f.set_threads_local =
            reinterpret_cast<mkl_threads_fn>(dlsym(handle, "MKL_Set_Num_Threads_Local"));
    }
    if (!f.s || !f.d) f = VmlSqrt{};
    return f;
  }();
  return fns;
}

bool using_vml_sqrt() { return vml_sqrt().s != nullptr; }

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "multi_tensor native CPU kernels (" MT_STR(CPU_CAPABILITY) ")";
  m.attr("capability") = MT_STR(CPU_CAPABILITY);
  m.attr("inline_numel") = multi_tensor_cpu::kInlineNumel;
  m.def("uses_mkl_sqrt", &multi_tensor_cpu::using_vml_sqrt,
        "True when sqrt runs through torch's MKL VML routine (as torch.sqrt does).");
  multi_tensor_cpu::bind_adam_family(m);
  multi_tensor_cpu::bind_scale_l2norm(m);
}
