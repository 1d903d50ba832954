// fused_ema_adamw / adam: declarations shared by the op front-ends, the prepared form and the
// module definition.
#pragma once

#include "common.h"

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

// Hyperparameters of one call, as passed from Python (doubles; cast to opmath once per call).
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
};

struct AdamForm {
  bool has_master;
  int64_t rows;
  c10::ScalarType param_dtype;
  c10::ScalarType grad_dtype;
};

std::string adam_op_name(bool has_ema);

// validation.check_adam_family_lists in C++ (same checks, order, messages and exception types).
AdamForm validate_adam_family(bool has_ema, const std::vector<PyTensorList*>& lists);

struct AdamBucket;

// The persistent form: holds the state lists (everything but grads) as at::Tensor handles and
// re-reads data pointers on every call (`p.data = x` may swap a tensor's storage).
class PreparedAdamFamily {
 public:
  PreparedAdamFamily(const std::string& op_name, py::handle state_lists, int64_t chunk_size);
  void validate(py::handle grads);
  void call(py::handle grads, const std::optional<at::Tensor>& noop, AdamHyper& h,
            py::handle step);
  const std::string& op_name() const { return op_name_; }
  int64_t chunk_size() const { return chunk_size_; }
  bool has_ema() const { return has_ema_; }
  py::list state_lists() const;

 private:
  AdamForm full_validate(const PyTensorList& grads);
  bool gather(const PyTensorList& grads, AdamBucket& bucket) const;

  std::string op_name_;
  std::string msg_op_;
  int64_t chunk_size_;
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
