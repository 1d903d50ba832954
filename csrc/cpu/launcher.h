// The bucket launcher (apex's multi_tensor_apply, ATen's MultiTensorApply.cuh on the CPU): every
// row of a bucket is cut into chunks of `chunk_size` elements, and ONE at::parallel_for covers all
// chunks of all rows. Every element is processed by exactly one thread with the same code, so a
// result never depends on the chunk size or the thread count.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
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

// Below this many elements in total a call runs inline on the calling thread: waking the pool's
// workers (after forward/backward they are often asleep) costs more than a small update.
constexpr int64_t kInlineNumel = 1 << 17;

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

// f(first_chunk, count) over the chunk table, in parallel unless the call is small (or already
// inside a parallel region). Threads get equal numbers of ELEMENTS, not of chunks: a thread's
// share is a run of chunks whose first and last may be cut, so one large tensor beside many
// small ones no longer leaves a thread idle. Where a chunk is cut never changes a result.
template <typename F>
inline void launch_ranges(const std::vector<Chunk>& chunks, int64_t total, const F& f) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  if (n == 0) return;
  if (total < kInlineNumel || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    f(chunks.data(), n);
    return;
  }
  // ends[k]: elements up to and including chunk k
  std::vector<int64_t> ends(n);
  int64_t acc = 0;
  for (int64_t k = 0; k < n; ++k) ends[k] = acc += chunks[k].end - chunks[k].start;
  at::parallel_for(0, total, kInlineNumel / 4, [&](int64_t begin, int64_t end) {
    int64_t k = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    std::vector<Chunk> mine;
    for (; k < n && ends[k] - (chunks[k].end - chunks[k].start) < end; ++k) {
      const int64_t first = ends[k] - (chunks[k].end - chunks[k].start);  // element index of chunk k
      Chunk c = chunks[k];
      if (begin > first) c.start += begin - first;
      if (end < ends[k]) c.end -= ends[k] - end;
      mine.push_back(c);
    }
    f(mine.data(), static_cast<int64_t>(mine.size()));
  });
}

template <typename F>
inline void launch(const std::vector<Chunk>& chunks, int64_t total, const F& f) {
  launch_ranges(chunks, total, [&](const Chunk* c, int64_t n) {
    for (int64_t i = 0; i < n; ++i) f(c[i]);
  });
}

// f(k) for every chunk index k, chunks never cut: for reductions whose fixed blocks must stay
// whole so the result is independent of the thread count.
template <typename F>
inline void launch_indexed(const std::vector<Chunk>& chunks, int64_t total, const F& f) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  if (total < kInlineNumel || n == 1 || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    for (int64_t k = 0; k < n; ++k) f(k);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) f(k);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace multi_tensor_cpu
