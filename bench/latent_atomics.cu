// The sparse MLA backward's latent-gradient additions alone, in two orders (docs/PERF.md, "What
// 25% MFU at 1M would take"): 16,384 queries x 2,048 selected rows, each row 576 fp32 values
// added with atomics, either
//   scattered: each query's rows anywhere in the N-row gradient (today's order; at 1M the 2.4 GB
//              buffer is far larger than the L2), or
//   by range:  every query's rows in one range of R rows, then the next range (a key-range-major
//              pass: the range's slice of the gradient can stay in the L2).
// The rows are pseudo-random (random selections: no two queries share more than chance). Blocks
// run in about their index order, so in the ranged order the blocks in flight share one range.
//     build/bench_latent_atomics [rows N]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "cuda_timing.cuh"

using namespace spindle;
using namespace spindle::cuda;

namespace {

constexpr int kCols = 576;       // a latent row: kv_lora_rank 512 + rope 64
constexpr int kThreads = 192;    // 3 values of a row per thread
constexpr int kBlockRows = 256;  // rows added per block
constexpr int64_t kQueries = 16384, kSelected = 2048;

__device__ uint32_t mix(uint32_t a) {
  a ^= a >> 16;
  a *= 0x7feb352du;
  a ^= a >> 15;
  a *= 0x846ca68bu;
  a ^= a >> 16;
  return a;
}

// Block b adds kBlockRows rows: anywhere in `rows` (range_rows == 0), or in range b /
// blocks_per_range of range_rows rows.
__global__ void __launch_bounds__(kThreads)
    add_rows(float* grad, int64_t rows, int64_t range_rows, int64_t blocks_per_range) {
  const int64_t first = range_rows > 0 ? blockIdx.x / blocks_per_range * range_rows : 0;
  const int64_t span = range_rows > 0 ? range_rows : rows;
  for (int i = 0; i < kBlockRows; ++i) {
    const uint32_t h = mix(static_cast<uint32_t>(blockIdx.x) * kBlockRows + i);
    float* row = grad + (first + h % span) * kCols;
    for (int c = threadIdx.x; c < kCols; c += kThreads) atomicAdd(row + c, 1.0f);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 1048576;
  const int64_t blocks = kQueries * kSelected / kBlockRows;
  DeviceBuffer<float> grad(static_cast<size_t>(rows * kCols), MemoryCategory::Activations);
  SPINDLE_CUDA(cudaMemset(grad.data(), 0, static_cast<size_t>(rows * kCols) * sizeof(float)));
  const double bytes = static_cast<double>(kQueries * kSelected) * kCols * sizeof(float);
  std::printf("%lld queries x %lld rows of %d fp32 added into %lld rows (%.2f GB of additions):\n",
              static_cast<long long>(kQueries), static_cast<long long>(kSelected), kCols,
              static_cast<long long>(rows), bytes / 1e9);
  for (const int64_t range : {int64_t{0}, int64_t{32768}, int64_t{16384}, int64_t{8192}}) {
    if (range > rows || (range > 0 && rows % range != 0)) continue;
    const int64_t ranges = range > 0 ? rows / range : 1;
    if (blocks % ranges != 0) continue;
    const double ms = median_ms(
        [&] {
          add_rows<<<static_cast<unsigned>(blocks), kThreads>>>(grad.data(), rows, range, blocks / ranges);
          SPINDLE_LAUNCHED("add_rows");
        },
        5);
    if (range == 0)
      std::printf("  scattered       %8.2f ms (%.0f GB/s of additions)\n", ms, bytes / ms / 1e6);
    else
      std::printf("  ranges of %5lld %8.2f ms (%.0f GB/s of additions; the range's slice %.1f MB)\n",
                  static_cast<long long>(range), ms, bytes / ms / 1e6,
                  static_cast<double>(range * kCols * sizeof(float)) / 1e6);
  }
  return 0;
}
