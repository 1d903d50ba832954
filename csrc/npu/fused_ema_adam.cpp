// The NPU backend's binding of CANN's aclnnApplyFusedEmaAdam (one launch over a flat bucket).
//
// Built on first use by multi_tensor/backends/npu_builder.py (torch.utils.cpp_extension.load with
// CANN's and torch_npu's headers, -lascendcl -ltorch_npu), only when MindSpeed - which binds the
// same operator with the same Python signature - is not installed. Never compiled by setup.py:
// the package's CPU build does not know this file.
//
//   npu_apply_fused_ema_adamw(grad, var, m, v, s, step, lr, ema_decay, beta1, beta2, eps, mode,
//                             bias_correction, weight_decay) -> (var, m, v, s)      (in place)
//
// The operator's contract (CANN's aclnnApplyFusedEmaAdam documentation), checked here before
// anything is enqueued: grad, var, m, v, s on one NPU device, one dtype (fp16, bf16 or fp32),
// one shape of 1 to 8 dims, contiguous (this binding passes the data pointer with offset 0);
// step an int64 tensor of shape [1] on that device; lr, ema_decay, betas, eps, weight_decay
// doubles; mode 0 (Adam, L2) or 1 (AdamW); bias_correction a bool.
//
// Like torch_npu's EXEC_NPU_CMD, the two-phase aclnn API is resolved at run time from the libraries
// torch_npu searches, in its order (custom op packages' libcust_opapi.so, CANN's libopapi_*.so,
// libopapi.so, then the feature libraries such as libaclnn_ops_train.so: opapi_libs.h, which
// cites op-plugin's GetOpApiFuncAddr), the workspace is taken from torch_npu's
// caching allocator, and the launch goes through torch_npu's task queue (OpCommand with a custom
// handler), so it is ordered with every other op on the current stream.
//
// NOT VERIFIED in this repository's CI (no CANN, no torch_npu there): tools/npu_check.py builds
// it and checks it against the reference on an Ascend machine.

#include <dlfcn.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <torch/extension.h>

#include "acl/acl.h"
#include "opapi_libs.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/FormatHelper.h"
#include "torch_npu/csrc/framework/OpCommand.h"

namespace {

using aclTensor = struct aclTensor;
using aclOpExecutor = struct aclOpExecutor;

using CreateTensorFn = aclTensor *(*)(const int64_t *view_dims, uint64_t view_dims_num,
                                      aclDataType data_type, const int64_t *stride, int64_t offset,
                                      aclFormat format, const int64_t *storage_dims,
                                      uint64_t storage_dims_num, void *tensor_data);
using DestroyTensorFn = int (*)(const aclTensor *tensor);
using GetWorkspaceSizeFn = int (*)(const aclTensor *grad, aclTensor *var, aclTensor *m,
                                   aclTensor *v, aclTensor *s, const aclTensor *step, double lr,
                                   double ema_decay, double beta1, double beta2, double eps,
                                   int64_t mode, bool bias_correction, double weight_decay,
                                   uint64_t *workspace_size, aclOpExecutor **executor);
using RunFn = int (*)(void *workspace, uint64_t workspace_size, aclOpExecutor *executor,
                      aclrtStream stream);
using InitHugeMemFn = int (*)(void *, bool);
using UnInitHugeMemFn = void (*)(void *, bool);
using ReleaseHugeMemFn = void (*)(void *, bool);

using multi_tensor_npu::OpApiSymbol;

struct OpApi {
  CreateTensorFn create_tensor = nullptr;
  DestroyTensorFn destroy_tensor = nullptr;
  GetWorkspaceSizeFn workspace_size = nullptr;
  RunFn run = nullptr;
  InitHugeMemFn init_mem = nullptr;
  UnInitHugeMemFn uninit_mem = nullptr;
  ReleaseHugeMemFn release_mem = nullptr;

  OpApi() {
    create_tensor = reinterpret_cast<CreateTensorFn>(OpApiSymbol("aclCreateTensor"));
    destroy_tensor = reinterpret_cast<DestroyTensorFn>(OpApiSymbol("aclDestroyTensor"));
    workspace_size = reinterpret_cast<GetWorkspaceSizeFn>(
        OpApiSymbol("aclnnApplyFusedEmaAdamGetWorkspaceSize"));
    run = reinterpret_cast<RunFn>(OpApiSymbol("aclnnApplyFusedEmaAdam"));
    init_mem = reinterpret_cast<InitHugeMemFn>(OpApiSymbol("InitHugeMemThreadLocal"));
    uninit_mem = reinterpret_cast<UnInitHugeMemFn>(OpApiSymbol("UnInitHugeMemThreadLocal"));
    release_mem = reinterpret_cast<ReleaseHugeMemFn>(OpApiSymbol("ReleaseHugeMem"));
  }
};

const OpApi &Api() {
  static const OpApi api;
  TORCH_CHECK(api.create_tensor != nullptr && api.destroy_tensor != nullptr,
              "npu_apply_fused_ema_adamw: aclCreateTensor/aclDestroyTensor not found in "
              "CANN's op API libraries (libopapi.so, libopapi_*.so, libaclnn_*.so; is CANN's "
              "set_env.sh sourced?)");
  TORCH_CHECK(api.workspace_size != nullptr && api.run != nullptr,
              "npu_apply_fused_ema_adamw: aclnnApplyFusedEmaAdam not found in this CANN's op API "
              "library (it ships for Atlas A2/A3 and Ascend 950 with CANN 8.0 or later)");
  return api;
}

aclDataType AclDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ACL_FLOAT;
    case at::kHalf: return ACL_FLOAT16;
    case at::kBFloat16: return ACL_BF16;
    case at::kLong: return ACL_INT64;
    default: TORCH_CHECK(false, "npu_apply_fused_ema_adamw: unsupported dtype ", t);
  }
  return ACL_DT_UNDEFINED;
}

// A contiguous tensor, addressed at its first element (offset 0, storage = the view).
aclTensor *ToAcl(const OpApi &api, const at::Tensor &t) {
  std::vector<int64_t> dims(t.sizes().begin(), t.sizes().end());
  std::vector<int64_t> strides(t.strides().begin(), t.strides().end());
  aclTensor *out = api.create_tensor(dims.data(), dims.size(), AclDtype(t.scalar_type()),
                                     strides.data(), 0, ACL_FORMAT_ND, dims.data(), dims.size(),
                                     const_cast<void *>(t.data_ptr()));
  TORCH_CHECK(out != nullptr, "npu_apply_fused_ema_adamw: aclCreateTensor failed");
  return out;
}

void CheckContract(const at::Tensor &grad, const at::Tensor &var, const at::Tensor &m,
                   const at::Tensor &v, const at::Tensor &s, const at::Tensor &step,
                   int64_t mode) {
  const char *names[] = {"grad", "var", "m", "v", "s"};
  const at::Tensor *ts[] = {&grad, &var, &m, &v, &s};
  auto dtype = var.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "npu_apply_fused_ema_adamw: var is ", dtype, "; the operator takes fp32, fp16, bf16");
  TORCH_CHECK(var.dim() >= 1 && var.dim() <= 8,
              "npu_apply_fused_ema_adamw: tensors must have 1 to 8 dims, var has ", var.dim());
  for (int i = 0; i < 5; ++i) {
    const at::Tensor &t = *ts[i];
    TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1 && t.device() == var.device(),
                "npu_apply_fused_ema_adamw: ", names[i], " is on ", t.device(), ", var on ",
                var.device(), " (all on one NPU)");
    TORCH_CHECK(t.scalar_type() == dtype, "npu_apply_fused_ema_adamw: ", names[i], " is ",
                t.scalar_type(), " but var is ", dtype, " (one dtype for all five)");
    TORCH_CHECK(t.sizes() == var.sizes(), "npu_apply_fused_ema_adamw: ", names[i],
                " has shape ", t.sizes(), " but var has ", var.sizes());
    TORCH_CHECK(t.is_contiguous(), "npu_apply_fused_ema_adamw: ", names[i], " is not contiguous");
    // the kernel is registered for ND only (ops-nn's apply_fused_ema_adam_def.cpp) and this
    // binding describes every tensor as ND: a private storage format (FRACTAL_NZ, ...) would be
    // read as ND, silently wrong
    TORCH_CHECK(at_npu::native::FormatHelper::IsBaseFormatType(t), "npu_apply_fused_ema_adamw: ",
                names[i], " is in NPU storage format ",
                at_npu::native::FormatHelper::GetFormatName(t),
                "; the operator takes ND (torch_npu.npu_format_cast(t, 2) first)");
  }
  TORCH_CHECK(step.scalar_type() == at::kLong && step.dim() == 1 && step.numel() == 1,
              "npu_apply_fused_ema_adamw: step must be an int64 tensor of shape [1], got ",
              step.scalar_type(), " ", step.sizes());
  TORCH_CHECK(step.device() == var.device(), "npu_apply_fused_ema_adamw: step is on ",
              step.device(), ", var on ", var.device());
  TORCH_CHECK(mode == 0 || mode == 1, "npu_apply_fused_ema_adamw: mode must be 0 or 1, got ",
              mode);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> npu_apply_fused_ema_adamw(
    const at::Tensor &grad, at::Tensor var, at::Tensor m, at::Tensor v, at::Tensor s,
    const at::Tensor &step, double lr, double ema_decay, double beta1, double beta2, double eps,
    int64_t mode, bool bias_correction, double weight_decay) {
  CheckContract(grad, var, m, v, s, step, mode);
  if (var.numel() == 0) {
    return std::make_tuple(var, m, v, s);
  }
  const OpApi &api = Api();
  const c10::OptionalDeviceGuard guard(var.device());
  if (api.init_mem != nullptr) {
    api.init_mem(nullptr, false);
  }
  aclTensor *a_grad = ToAcl(api, grad);
  aclTensor *a_var = ToAcl(api, var);
  aclTensor *a_m = ToAcl(api, m);
  aclTensor *a_v = ToAcl(api, v);
  aclTensor *a_s = ToAcl(api, s);
  aclTensor *a_step = ToAcl(api, step);
  uint64_t workspace_size = 0;
  aclOpExecutor *executor = nullptr;
  int status = api.workspace_size(a_grad, a_var, a_m, a_v, a_s, a_step, lr, ema_decay, beta1,
                                  beta2, eps, mode, bias_correction, weight_decay,
                                  &workspace_size, &executor);
  TORCH_CHECK(status == 0, "aclnnApplyFusedEmaAdamGetWorkspaceSize failed (", status, "): ",
              aclGetRecentErrMsg());
  void *workspace = nullptr;
  if (workspace_size != 0) {
    // Freed at once: the caching allocator reuses it only for work queued after this launch.
    at::Tensor ws = at::empty({static_cast<int64_t>(workspace_size)}, var.options().dtype(at::kByte));
    workspace = ws.data_ptr();
  }
  aclrtStream stream = c10_npu::getCurrentNPUStream().stream(false);
  const OpApi *p = &api;
  auto launch = [p, workspace, workspace_size, executor, stream, a_grad, a_var, a_m, a_v, a_s,
                 a_step]() -> int {
    int ret = p->run(workspace, workspace_size, executor, stream);
    TORCH_CHECK(ret == 0, "aclnnApplyFusedEmaAdam failed (", ret, "): ", aclGetRecentErrMsg());
    for (aclTensor *t : {a_grad, a_var, a_m, a_v, a_s, a_step}) {
      p->destroy_tensor(t);
    }
    if (p->release_mem != nullptr) {
      p->release_mem(nullptr, false);
    }
    return ret;
  };
  at_npu::native::OpCommand cmd;
  cmd.Name("aclnnApplyFusedEmaAdam");
  cmd.SetCustomHandler(launch);
  cmd.Run();
  if (api.uninit_mem != nullptr) {
    api.uninit_mem(nullptr, false);
  }
  return std::make_tuple(var, m, v, s);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("npu_apply_fused_ema_adamw", &npu_apply_fused_ema_adamw,
             "CANN aclnnApplyFusedEmaAdam, in place (MindSpeed's signature)",
             pybind11::arg("grad"), pybind11::arg("var"), pybind11::arg("m"),
             pybind11::arg("v"), pybind11::arg("s"), pybind11::arg("step"),
             pybind11::arg("lr") = 1e-3, pybind11::arg("ema_decay") = 0.9999,
             pybind11::arg("beta1") = 0.9, pybind11::arg("beta2") = 0.999,
             pybind11::arg("eps") = 1e-8, pybind11::arg("mode") = 1,
             pybind11::arg("bias_correction") = true, pybind11::arg("weight_decay") = 0.0);
}
