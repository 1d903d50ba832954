// The native CPU Adam-family bucket: the state lists of one bucket bound once, grads bound per
// step, one parallel launch per step over every chunk of every row.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <vector>

#include "launcher.h"
#include "pylists.h"
#include "vec_io.h"

// adam_rule.h's sqrt and sign flip for at::vec vectors: the hardware's correctly rounded sqrt
// (vsqrtps/vsqrtpd, std::sqrt per lane in the default build) and a sign-bit flip.
namespace multi_tensor_rules {
template <typename M>
inline at::vec::Vectorized<M> ieee_sqrt(const at::vec::Vectorized<M>& x) { return x.sqrt(); }
template <typename M>
inline at::vec::Vectorized<M> negate(const at::vec::Vectorized<M>& x) { return x.neg(); }
}  // namespace multi_tensor_rules

#include "../include/adam_rule.h"

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

// Slots of a row's data pointers.
enum Slot { kGrad = 0, kParam, kExpAvg, kExpAvgSq, kEma, kMaster, kRemainder, kSlots };

struct Row {
  void* p[kSlots] = {};
};

using KernelFn = void (*)(const Chunk*, int64_t, const Row*, const void*);

// lists: a multi_tensor.schema.AdamLists (params, exp_avgs, exp_avg_sqs, emas or None, masters or
// None, remainders or None; its grads are not read), checked by the Python front end (multi_tensor/schema.py).
// bind() takes a step's grads; run() applies one update with the scalars of a
// multi_tensor.rules.StepScalars.
class AdamBucket {
 public:
  AdamBucket(py::handle lists, int64_t chunk_size);
  bool bind(py::handle grads);
  void run(const std::optional<at::Tensor>& noop_flag, py::handle scalars,
           const std::optional<at::Tensor>& grad_scale, bool check_finite);
  int64_t chunk_size() const { return chunk_size_; }

 private:
  bool ema_ = false;
  bool master_ = false;
  bool remainder_ = false;  // bf16 params whose fp32 masters are held as int16 remainders
  int64_t chunk_size_;
  c10::ScalarType param_dtype_ = c10::kFloat;
  c10::ScalarType state_dtype_ = c10::kFloat;
  c10::ScalarType ema_dtype_ = c10::kFloat;  // the state dtype, or bf16 (a bf16 EMA)
  c10::ScalarType grad_dtype_ = c10::kFloat;
  std::vector<std::vector<at::Tensor>> state_;
  std::vector<Slot> slots_;  // the row slot of each state list
  std::vector<at::Tensor> grads_;
  std::vector<Row> rows_;
  std::vector<int64_t> staged_;
  std::vector<int64_t> numels_;
  std::vector<Chunk> chunks_;
  int64_t total_ = 0;
};

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu
