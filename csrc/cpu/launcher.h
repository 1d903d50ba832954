// The bucket launcher (apex's multi_tensor_apply, ATen's MultiTensorApply.cuh on the CPU): every
// row of a bucket is cut into chunks of `chunk_size` elements, and ONE at::parallel_for covers all
// chunks of all rows. Every element is processed by exactly one thread with the same code, so a
// result never depends on the chunk size or the thread count.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace multi_tensor_cpu {
inline namespace CPU_CAPABILITY {

// One unit of work: elements [start, end) of row `row` (int64: tensors may exceed 2^31 elements).
struct Chunk {
  int64_t row;
  int64_t start;
  int64_t end;
};

// Below this many elements in total a call runs inline on the calling thread (no fork/join).
constexpr int64_t kInlineNumel = 32768;

// The chunk table of rows with these element counts; returns the total element count.
inline int64_t build_chunks(const std::vector<int64_t>& numels, int64_t chunk_size,
                            std::vector<Chunk>& chunks) {
  chunks.clear();
  int64_t total = 0;
  size_t count = 0;
  for (int64_t n : numels) count += static_cast<size_t>((n + chunk_size - 1) / chunk_size);
  chunks.reserve(count);
  for (size_t r = 0; r < numels.size(); ++r) {
    const int64_t n = numels[r];
    total += n;
    for (int64_t s = 0; s < n; s += chunk_size) {
      chunks.push_back(Chunk{static_cast<int64_t>(r), s, (n - s > chunk_size) ? s + chunk_size : n});
    }
  }
  return total;
}

// f(first_chunk, count) over contiguous runs of the chunk table, in parallel unless the call is
// small (or already inside a parallel region).
template <typename F>
inline void launch_ranges(const std::vector<Chunk>& chunks, int64_t total, const F& f) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  if (n == 0) return;
  if (total < kInlineNumel || n == 1 || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    f(chunks.data(), n);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) { f(chunks.data() + begin, end - begin); });
}

template <typename F>
inline void launch(const std::vector<Chunk>& chunks, int64_t total, const F& f) {
  launch_ranges(chunks, total, [&](const Chunk* c, int64_t n) {
    for (int64_t i = 0; i < n; ++i) f(c[i]);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu
