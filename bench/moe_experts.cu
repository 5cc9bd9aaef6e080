// The routed experts' products at one streamed chunk of the 4B config (16 experts, hidden 2048,
// intermediate 576, top-4 of 16,384 tokens: ~4,096 rows an expert), in the orders the MoE could
// run them (docs/PERF.md, "Where the 1M step's 162 s go now"). An expert's product has 1 to 2
// waves of output tiles on 132 SMs, so one after another on one stream each ends in a part-empty
// wave. Timed by CUDA events (median of a few runs) with their FLOP/s:
//   forward, today:        per expert gate and up (N = 576 each), then down;
//   forward, stacked:      per expert [gate; up] as one product (N = 1152), then down;
//   forward, stacked on L: the same with the experts spread over L side streams (the busiest expert
//                          first, to the lane with the fewest rows), one Gemm with a cuBLASLt
//                          workspace per stream, as the model runs them (model/cuda/expert_lanes.h);
//   down backward:         per expert dhidden = dy W_down (N = 576), one stream and L streams.
//     build/bench_moe_experts [tokens] [lanes]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "cuda_timing.cuh"
#include "kernels/cuda/gemm.h"
#include "model/cuda/expert_lanes.h"

using namespace spindle;
using namespace spindle::cuda;

namespace {

constexpr int64_t kExperts = 16, kTopk = 4, kHidden = 2048, kInter = 576;

}  // namespace

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 16384;
  const int lanes_wanted = argc > 2 ? std::atoi(argv[2]) : 4;
  const int64_t D = kHidden, I = kInter, E = kExperts;
  // Rows per expert: the mean share, each expert up to 20% above or below it (fixed pattern).
  std::vector<int64_t> rows(static_cast<size_t>(E)), first(static_cast<size_t>(E));
  int64_t n = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t mean = tokens * kTopk / E, jitter = (e * 7919) % 9 - 4;  // -4 .. 4 tenths of 20%
    rows[static_cast<size_t>(e)] = std::max<int64_t>(1, mean + mean * jitter / 20);
    first[static_cast<size_t>(e)] = n;
    n += rows[static_cast<size_t>(e)];
  }
  auto x = random_bf16(n * D, 1), gate = random_bf16(E * I * D, 2), up = random_bf16(E * I * D, 3),
       down = random_bf16(E * D * I, 4), stacked = random_bf16(E * 2 * I * D, 5), dy = random_bf16(n * D, 6);
  DeviceBuffer<__nv_bfloat16> gu(static_cast<size_t>(n * 2 * I), MemoryCategory::Activations),
      hidden(static_cast<size_t>(n * I), MemoryCategory::Activations),
      out(static_cast<size_t>(n * D), MemoryCategory::Activations),
      dhidden(static_cast<size_t>(n * I), MemoryCategory::Activations);
  SPINDLE_CUDA(cudaDeviceSynchronize());

  Gemm gemm;
  ExpertLanes lanes(lanes_wanted);
  std::vector<int32_t> offsets(first.begin(), first.end());
  offsets.push_back(static_cast<int32_t>(n));
  const std::vector<int> lane_of = lanes.assign(offsets);

  const auto expert = [&](int64_t e, cudaStream_t s, bool stack) {
    const int64_t f = first[static_cast<size_t>(e)], m = rows[static_cast<size_t>(e)];
    if (stack) {
      gemm.linear(x.data() + f * D, stacked.data() + e * 2 * I * D, gu.data() + f * 2 * I, m, D, 2 * I, s);
    } else {
      gemm.linear(x.data() + f * D, gate.data() + e * I * D, gu.data() + f * 2 * I, m, D, I, s);
      gemm.linear(x.data() + f * D, up.data() + e * I * D, hidden.data() + f * I, m, D, I, s);
    }
    gemm.linear(hidden.data() + f * I, down.data() + e * D * I, out.data() + f * D, m, I, D, s);
  };
  const auto down_backward = [&](int64_t e, cudaStream_t s) {
    const int64_t f = first[static_cast<size_t>(e)], m = rows[static_cast<size_t>(e)];
    gemm.linear_backward_input(dy.data() + f * D, down.data() + e * D * I, dhidden.data() + f * I, m, I, D,
                               s);
  };
  const double forward_flops = 2.0 * static_cast<double>(n) * D * 3 * I,
               down_flops = 2.0 * static_cast<double>(n) * D * I;
  const auto report = [](const char* what, double ms, double flops) {
    std::printf("  %-34s %7.3f ms (%.0f TFLOP/s)\n", what, ms, flops / ms / 1e9);
  };
  std::printf("%lld experts, %lld rows (%lld to %lld an expert), hidden %lld, intermediate %lld, %d lanes:\n",
              static_cast<long long>(E), static_cast<long long>(n),
              static_cast<long long>(*std::min_element(rows.begin(), rows.end())),
              static_cast<long long>(*std::max_element(rows.begin(), rows.end())), static_cast<long long>(D),
              static_cast<long long>(I), lanes.count());
  // Every expert's work on the legacy stream, or each on its lane's stream (one Gemm serves both).
  using Work = std::function<void(int64_t, cudaStream_t)>;
  const auto on_one_stream = [&](const Work& work) {
    return median_ms(
        [&] {
          for (int64_t e = 0; e < E; ++e) work(e, nullptr);
        },
        10);
  };
  const auto on_lanes = [&](const Work& work) {
    return median_ms(
        [&] {
          lanes.fork(nullptr);
          for (int64_t e = 0; e < E; ++e) work(e, lanes.stream(lane_of[static_cast<size_t>(e)]));
          lanes.join(nullptr);
        },
        10);
  };
  const auto apart = [&](int64_t e, cudaStream_t s) { expert(e, s, false); };
  const auto stacked_work = [&](int64_t e, cudaStream_t s) { expert(e, s, true); };
  report("forward, gate and up apart", on_one_stream(apart), forward_flops);
  report("forward, gate and up stacked", on_one_stream(stacked_work), forward_flops);
  report("forward, stacked, on the lanes", on_lanes(stacked_work), forward_flops);
  report("down backward (dy W_down)", on_one_stream(down_backward), down_flops);
  report("down backward, on the lanes", on_lanes(down_backward), down_flops);
  return 0;
}
