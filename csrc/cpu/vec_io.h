// Vector I/O between storage dtypes and the math type: a "block" is two math vectors, which for
// fp16/bf16 storage is exactly one Vectorized<Half/BFloat16>. Conversions to fp16/bf16 round to
// nearest even (at::vec's convert_from_float); partial blocks load zeros into the unused lanes.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

using at::vec::Vectorized;

template <typename T>
constexpr int64_t block_size() {
  return 2 * static_cast<int64_t>(Vectorized<T>::size());
}

// Elements [0, n) of a block at p (n == block_size() for a full block).
template <typename T, typename M>
inline void load_block(const T* p, int64_t n, Vectorized<M>& a, Vectorized<M>& b) {
  constexpr int64_t H = Vectorized<M>::size();
  if constexpr (std::is_same_v<T, M>) {
    if (n == 2 * H) {
      a = Vectorized<M>::loadu(p);
      b = Vectorized<M>::loadu(p + H);
    } else {
      a = Vectorized<M>::loadu(p, std::min(n, H));
      b = n > H ? Vectorized<M>::loadu(p + H, n - H) : Vectorized<M>(M(0));
    }
  } else {
    static_assert(std::is_same_v<M, float>, "fp16/bf16 convert to float");
    static_assert(Vectorized<T>::size() == 2 * H, "one reduced vector is two float vectors");
    const auto v = n == 2 * H ? Vectorized<T>::loadu(p) : Vectorized<T>::loadu(p, n);
    std::tie(a, b) = at::vec::convert_to_float<T>(v);
  }
}

template <typename T, typename M>
inline void store_block(T* p, int64_t n, const Vectorized<M>& a, const Vectorized<M>& b) {
  constexpr int64_t H = Vectorized<M>::size();
  if constexpr (std::is_same_v<T, M>) {
    if (n == 2 * H) {
      a.store(p);
      b.store(p + H);
    } else {
      a.store(p, std::min(n, H));
      if (n > H) b.store(p + H, n - H);
    }
  } else {
    const auto v = at::vec::convert_from_float<T>(a, b);
    if (n == 2 * H) {
      v.store(p);
    } else {
      v.store(p, n);
    }
  }
}

// Whether any lane of a (x - x) accumulator is NaN, i.e. some accumulated x was inf or NaN.
template <typename M>
inline bool any_lane_nan(const Vectorized<M>& acc) {
  M out[Vectorized<M>::size()];
  acc.store(out);
  for (int64_t k = 0; k < Vectorized<M>::size(); ++k)
    if (out[k] != out[k]) return true;
  return false;
}

// Any inf/NaN among n elements at p.
template <typename T, typename M>
inline bool has_nonfinite(const T* p, int64_t n) {
  constexpr int64_t B = block_size<M>();
  Vectorized<M> acc(M(0)), a, b;
  for (int64_t i = 0; i < n; i += B) {
    load_block<T, M>(p + i, std::min(B, n - i), a, b);
    acc = acc + (a - a);
    acc = acc + (b - b);
  }
  return any_lane_nan(acc);
}

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu
