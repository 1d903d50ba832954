// fused_ema_adamw / adam / radam: declarations shared by the op front-ends, the prepared form and
// the module definition.
#pragma once

#include "common.h"

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

// The update rule a kernel is compiled for: Adam/AdamW (fused_ema_adamw, adam) or
// torch.optim.RAdam (radam). Both share the launcher, the I/O, the sqrt tiles and the EMA.
enum class UpdateRule : int { kAdam = 0, kRAdam = 1 };

// Hyperparameters of one call, as passed from Python (doubles; cast to opmath once per call).
// radam maps decoupled_weight_decay onto `mode` (1: decoupled, 0: L2) and always bias-corrects.
struct AdamHyper {
  double lr = 0.0;
  double ema_decay = 0.0;
  double beta1 = 0.0;
  double beta2 = 0.0;
  double eps = 0.0;
  int64_t step = 1;
  int64_t mode = 1;
  bool bias_correction = true;
  double weight_decay = 0.0;
  std::optional<at::Tensor> grad_scale;
  bool maximize = false;
  bool check_finite = false;
  UpdateRule rule = UpdateRule::kAdam;
};

struct AdamForm {
  bool has_master;
  int64_t rows;
  c10::ScalarType param_dtype;
  c10::ScalarType grad_dtype;
};

// The name errors use: multi_tensor_fused_ema_adamw, multi_tensor_adam, multi_tensor_radam.
std::string family_op_name(UpdateRule rule, bool has_ema);

// validation.check_adam_family_lists in C++ (same checks, order, messages and exception types).
// For radam, `has_ema` is validation.radam_lists_key(ema_decay) == "radam_ema".
AdamForm validate_adam_family(UpdateRule rule, bool has_ema,
                              const std::vector<PyTensorList*>& lists);

struct AdamBucket;

// The persistent form: holds the state lists (everything but grads) as at::Tensor handles and
// re-reads data pointers on every call (`p.data = x` may swap a tensor's storage).
//
// op "fused_ema_adamw" / "adam": the list form is fixed by the op. op "radam": as in the op form,
// each call's ema_decay decides it (None: [params, exp_avgs, exp_avg_sqs(, masters)], a float:
// [params, exp_avgs, exp_avg_sqs, emas(, masters)]); a call whose form differs from the last
// validated one is validated again. validate() before any call infers the form of the ambiguous
// four-state-list case from the dtypes (fourth list in the params' dtype: emas, else masters),
// which accepts exactly the lists that one of the two forms accepts.
class PreparedAdamFamily {
 public:
  PreparedAdamFamily(const std::string& op_name, py::handle state_lists, int64_t chunk_size);
  void validate(py::handle grads);
  void call(py::handle grads, const std::optional<at::Tensor>& noop, AdamHyper& h,
            py::handle step, bool has_ema);
  // call() with the grads of the stored params (state list 0), read from their `.grad` here.
  // Returns false, running nothing, when any param has no grad.
  bool call_param_grads(const std::optional<at::Tensor>& noop, AdamHyper& h, py::handle step,
                        bool has_ema);
  const std::string& op_name() const { return op_name_; }
  int64_t chunk_size() const { return chunk_size_; }
  UpdateRule rule() const { return rule_; }
  bool has_ema() const { return has_ema_; }
  py::list state_lists() const;

 private:
  AdamForm full_validate(const PyTensorList& grads);
  bool gather(const PyTensorList& grads, AdamBucket& bucket) const;
  bool infer_ema() const;
  void call_list(const PyTensorList& g, const std::optional<at::Tensor>& noop, AdamHyper& h,
                 py::handle step, bool has_ema);
  void set_form(bool has_ema);

  std::string op_name_;
  std::string msg_op_;
  int64_t chunk_size_;
  UpdateRule rule_ = UpdateRule::kAdam;
  bool form_fixed_ = true;  // false for radam: the call's ema_decay picks the list form
  bool has_ema_ = true;
  bool has_master_ = false;
  bool validated_ = false;
  c10::ScalarType param_dtype_ = c10::kFloat;
  std::vector<std::vector<at::Tensor>> state_;
};

void bind_adam_family(py::module_& m);
void bind_scale_l2norm(py::module_& m);

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu
