// The extension module: built three times (multi_tensor._C_default / _C_avx2 / _C_avx512) from
// the same sources with different CPU_CAPABILITY flags; multi_tensor/backends/native_cpu.py
// imports the best one the CPU allows.
#include "adam_kernel.h"

#define MT_STR2(x) #x
#define MT_STR(x) MT_STR2(x)

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {
void bind_scale_l2norm(py::module_& m);
void bind_tensor_facts(py::module_& m);
}
}  // namespace multi_tensor_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using multi_tensor_cpu::AdamBucket;
  m.doc() = "multi_tensor native CPU kernels (" MT_STR(CPU_CAPABILITY) ")";
  m.attr("capability") = MT_STR(CPU_CAPABILITY);
  m.attr("inline_numel") = multi_tensor_cpu::kInlineNumel;
  // The StepScalars layout this build reads (multi_tensor/backends/native_cpu.py refuses a
  // build whose layout is not rules.py's).
  py::tuple fields(multi_tensor_rules::kNumStepScalars);
  for (int i = 0; i < multi_tensor_rules::kNumStepScalars; ++i)
    fields[i] = multi_tensor_rules::kStepScalarNames[i];
  m.attr("step_scalar_fields") = fields;
  // AdamBucket runs AdamLists.remainders (bf16 params with int16 master remainders).
  m.attr("param_remainders") = true;
  py::class_<AdamBucket>(m, "AdamBucket",
                         "An Adam-family op bound to one bucket's lists (a "
                         "multi_tensor.schema.AdamLists, read by name), checked by the Python "
                         "front end.")
      .def(py::init<py::handle, int64_t>(), py::arg("lists"), py::arg("chunk_size"))
      .def("bind", &AdamBucket::bind, py::arg("grads"),
           "Take this step's grads: True when they fit the bucket (else nothing is bound).")
      .def("run", &AdamBucket::run, py::arg("noop_flag"), py::arg("scalars"),
           py::arg("grad_scale") = py::none(), py::arg("check_finite") = false,
           "One update of the bound grads with a multi_tensor.rules.StepScalars.")
      .def_property_readonly("chunk_size", &AdamBucket::chunk_size);
  multi_tensor_cpu::bind_scale_l2norm(m);
  multi_tensor_cpu::bind_tensor_facts(m);
}
