// Generated from multi_tensor/rules.py by `python tools/step_scalars_header.py`: do not
// edit (tests/test_scalar_layout.py fails when this file differs from what rules.py gives).
//
// multi_tensor.rules.StepScalars in its field order: index i of the Python tuple (and slot i
// of the buffer multi_tensor.rules.pack gives the Triton kernels) holds field i.
#pragma once

namespace multi_tensor_rules {

constexpr int kStepScalarBeta1 = 0;
constexpr int kStepScalarOmb1 = 1;
constexpr int kStepScalarBeta2 = 2;
constexpr int kStepScalarOmb2 = 3;
constexpr int kStepScalarL2Wd = 4;
constexpr int kStepScalarLrWd = 5;
constexpr int kStepScalarIsb2 = 6;
constexpr int kStepScalarEps = 7;
constexpr int kStepScalarStepSize = 8;
constexpr int kStepScalarEmaW = 9;
constexpr int kStepScalarL2 = 10;
constexpr int kStepScalarDecoupled = 11;
constexpr int kStepScalarUseDenom = 12;
constexpr int kStepScalarMaximize = 13;
constexpr int kStepScalarEma = 14;
constexpr int kNumStepScalars = 15;
constexpr const char* kStepScalarNames[kNumStepScalars] = {
    "beta1",
    "omb1",
    "beta2",
    "omb2",
    "l2_wd",
    "lr_wd",
    "isb2",
    "eps",
    "step_size",
    "ema_w",
    "l2",
    "decoupled",
    "use_denom",
    "maximize",
    "ema",
};

// Each field a double rounded once to T; a flag a bool.
template <typename T>
struct StepScalars {
  T beta1;
  T omb1;
  T beta2;
  T omb2;
  T l2_wd;
  T lr_wd;
  T isb2;
  T eps;
  T step_size;
  T ema_w;
  bool l2;
  bool decoupled;
  bool use_denom;
  bool maximize;
  bool ema;
};

// Fills c from a source read by index: value(i) gives field i as a double, flag(i) as a bool.
template <typename T, typename Value, typename Flag>
inline void read_step_scalars(StepScalars<T>& c, const Value& value, const Flag& flag) {
  c.beta1 = static_cast<T>(value(kStepScalarBeta1));
  c.omb1 = static_cast<T>(value(kStepScalarOmb1));
  c.beta2 = static_cast<T>(value(kStepScalarBeta2));
  c.omb2 = static_cast<T>(value(kStepScalarOmb2));
  c.l2_wd = static_cast<T>(value(kStepScalarL2Wd));
  c.lr_wd = static_cast<T>(value(kStepScalarLrWd));
  c.isb2 = static_cast<T>(value(kStepScalarIsb2));
  c.eps = static_cast<T>(value(kStepScalarEps));
  c.step_size = static_cast<T>(value(kStepScalarStepSize));
  c.ema_w = static_cast<T>(value(kStepScalarEmaW));
  c.l2 = flag(kStepScalarL2);
  c.decoupled = flag(kStepScalarDecoupled);
  c.use_denom = flag(kStepScalarUseDenom);
  c.maximize = flag(kStepScalarMaximize);
  c.ema = flag(kStepScalarEma);
}

}  // namespace multi_tensor_rules
