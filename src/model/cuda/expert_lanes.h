// Side streams for the routed experts' products. Each expert's chain of GEMMs (and its SwiGLU) is
// independent of the others', but one expert's products are small: at a 16k-token chunk an
// expert has a few hundred to ten thousand rows (docs/MOE_BALANCE.md), often under one wave of
// tiles. Queued one after another on one stream they leave most of the GPU idle; spread over a few
// streams they run together. Every lane has its own cuBLASLt handle and workspace.
//
// Use: fork(main), queue each expert's work on lane(e)'s stream with its gemm (the main stream
// may queue work of its own meanwhile), join(main) before anything on main reads their results
// or frees their buffers.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "backend/cuda/stream.h"
#include "kernels/cuda/gemm.h"

namespace spindle::cuda {

class ExpertLanes {
 public:
  static constexpr int kLanes = 4;

  ExpertLanes();

  // The lanes start after the work queued on `main` so far.
  void fork(cudaStream_t main);
  // Work queued on `main` from now on waits for everything queued on the lanes.
  void join(cudaStream_t main);

  cudaStream_t stream(int lane) const { return streams_[static_cast<size_t>(lane)].get(); }
  Gemm& gemm(int lane) { return gemms_[static_cast<size_t>(lane)]; }

  // A lane per expert from the row offsets ([experts + 1]): the busiest expert first, each to
  // the lane with the fewest rows so far.
  static std::vector<int> assign(const std::vector<int32_t>& offsets);

 private:
  std::array<Stream, kLanes> streams_;
  std::array<Gemm, kLanes> gemms_;
  Event forked_{cudaEventDisableTiming};
  std::array<Event, kLanes> done_;
};

}  // namespace spindle::cuda
