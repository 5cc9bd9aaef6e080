// Side streams for the routed experts' products. Each expert's chain of products is independent
// of the others', but at a 16k-token chunk an expert has ~4,096 rows: one to two waves of output
// tiles on 132 SMs, so one expert after another on one stream ends each product in a part-empty
// wave. Spread over a few streams, one expert's last wave runs beside another's first
// (bench/moe_experts.cu: the forward's products 0.78 -> 0.71 ms at a 16k chunk of the 4B config).
// The model's Gemm serves them (a cuBLASLt workspace per stream, its plans shared).
//
// Use: fork(main); queue each expert's work on stream(lane), lane from assign(); the main stream
// may queue work of its own meanwhile; join(main) before anything on main reads the lanes' results
// or frees their buffers.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/cuda/stream.h"

namespace spindle::cuda {

class ExpertLanes {
 public:
  static constexpr int kDefaultLanes = 4;

  explicit ExpertLanes(int lanes = kDefaultLanes);

  int count() const { return static_cast<int>(streams_.size()); }
  // The lanes start after the work queued on `main` so far.
  void fork(cudaStream_t main);
  // Work queued on `main` from now on waits for everything queued on the lanes.
  void join(cudaStream_t main);

  cudaStream_t stream(int lane) const { return streams_[static_cast<size_t>(lane)]->get(); }

  // A lane for each expert from the row offsets ([experts + 1]): the busiest expert first, each
  // to the lane with the fewest rows so far.
  std::vector<int> assign(const std::vector<int32_t>& offsets) const;

 private:
  std::vector<std::unique_ptr<Stream>> streams_;
  std::vector<std::unique_ptr<Event>> done_;
  Event forked_{cudaEventDisableTiming};
};

}  // namespace spindle::cuda
