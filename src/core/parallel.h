// A plain parallel loop over an index range on the machine's cores (no pool: spawn, split, join).
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace spindle {

int worker_count();

// Calls body(begin, end) on disjoint sub-ranges of [0, n) covering it, on up to worker_count()
// threads. Ranges are at least `grain` long so that tiny loops stay on one thread.
template <class Body>
void parallel_for(int64_t n, int64_t grain, Body body) {
  if (n <= 0) return;
  const int64_t max_parts = std::max<int64_t>(1, n / std::max<int64_t>(grain, 1));
  const int64_t parts = std::min<int64_t>(worker_count(), max_parts);
  if (parts <= 1) {
    body(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(parts - 1));
  const int64_t step = (n + parts - 1) / parts;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t begin = p * step, end = std::min(n, begin + step);
    if (begin < end) threads.emplace_back([=] { body(begin, end); });
  }
  body(int64_t{0}, std::min(n, step));
  for (auto& t : threads) t.join();
}

}  // namespace spindle
