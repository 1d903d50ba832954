// The Adam-family element update, device-neutral: the operation order of multi_tensor/rules.py,
// written once for any arithmetic type V (a SIMD vector on the CPU, a scalar in a GPU thread).
//
// V needs +, -, *, / (each one correctly rounded IEEE operation, compiled without FMA
// contraction), construction from a scalar T, and two free functions found by argument-dependent
// lookup or overloads: ieee_sqrt(V) (correctly rounded) and negate(V) (flips the sign bit).
// The scalars are multi_tensor.rules.StepScalars (step_scalars.h, generated from rules.py), each
// rounded once from double to T by the backend; a GPU kernel mirrors this function line for line.
#pragma once

#include <cstdint>

#include "step_scalars.h"

namespace multi_tensor_rules {

template <typename T>
struct AdamScalars : StepScalars<T> {
  T inv_scale;  // T(1) / grad_scale, when has_scale
  bool has_scale;
};

// One element (or one vector of elements). g: the grad converted to T; w: the weights (fp32
// master or param), m, v, s: state, all in T. Updates w, m, v and, with EMA, s.
template <bool EMA, typename V, typename T>
inline void adam_update(const AdamScalars<T>& c, V g, V& w, V& m, V& v, V& s) {
  if (c.has_scale) g = g * V(c.inv_scale);
  if (c.maximize) g = negate(g);
  if (c.l2) g = g + V(c.l2_wd) * w;
  m = V(c.beta1) * m + V(c.omb1) * g;
  v = V(c.beta2) * v + (V(c.omb2) * g) * g;
  const V u = c.use_denom ? m / (ieee_sqrt(v) * V(c.isb2) + V(c.eps)) : m;
  V wn = c.decoupled ? w - V(c.lr_wd) * w : w;
  wn = wn - V(c.step_size) * u;
  if constexpr (EMA) s = s + V(c.ema_w) * (wn - s);
  w = wn;
}

// master_weights="remainder" (multi_tensor/rules.py, "The remainder encoding"): the fp32 master
// x is the bf16 param p (its bits) and the int16 remainder r. x's low 16 bits are r's bits; its
// high 16 bits are p's, less one when r < 0 (p was rounded up in magnitude: the low half was
// >= 0x8000, so round to nearest with ties away from zero). Integer arithmetic modulo 2^16 on p,
// so every (p, r) pair is one fp32 bit pattern and back.
inline uint32_t join_master(uint16_t p, int16_t r) {
  const uint32_t hi = static_cast<uint16_t>(p - static_cast<uint16_t>(r < 0));
  return (hi << 16) | static_cast<uint16_t>(r);
}

inline void split_master(uint32_t x, uint16_t& p, int16_t& r) {
  const uint32_t lo = x & 0xFFFFu;
  p = static_cast<uint16_t>((x >> 16) + (lo >> 15));
  r = static_cast<int16_t>(static_cast<uint16_t>(lo));
}

}  // namespace multi_tensor_rules
