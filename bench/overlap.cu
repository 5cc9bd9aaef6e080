// Can compute-bound products hide under the DRAM-bound sparse attention? The absorbed sparse MLA's
// forward and backward (bench_sparse_mla's shape: the last 16,384 queries of a 1M sequence, random
// pools) run on one stream while a run of weight-gradient products (dw [2048, 2048] fp32 += dy^T x
// over 16,384 rows: a KDA projection's, 137 GFLOP each) runs on another, both queued at once.
// Printed for each: the attention alone, the products alone, both together at equal stream
// priorities and with either stream first, and the share of the products' time that the overlap
// hid: (attention + products - together) / products.
//     build/bench_overlap [tokens] [products]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "cuda_timing.cuh"
#include "kernels/cuda/gemm.h"
#include "sparse_mla_chunk.cuh"

using namespace spindle;
using namespace spindle::cuda;

namespace {

// Median over `repeats` (after a warm-up) of the time from `a`'s start to the end of both streams'
// work, `run` queuing it on the two streams.
double together_ms(const std::function<void(cudaStream_t, cudaStream_t)>& run, cudaStream_t a, cudaStream_t b,
                   int repeats) {
  cudaEvent_t start, b_done, stop;
  SPINDLE_CUDA(cudaEventCreate(&start));
  SPINDLE_CUDA(cudaEventCreate(&b_done));
  SPINDLE_CUDA(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i <= repeats; ++i) {
    SPINDLE_CUDA(cudaEventRecord(start, a));
    SPINDLE_CUDA(cudaStreamWaitEvent(b, start));
    run(a, b);
    SPINDLE_CUDA(cudaEventRecord(b_done, b));
    SPINDLE_CUDA(cudaStreamWaitEvent(a, b_done));
    SPINDLE_CUDA(cudaEventRecord(stop, a));
    SPINDLE_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    SPINDLE_CUDA(cudaEventElapsedTime(&t, start, stop));
    if (i > 0) ms.push_back(t);  // the first is the warm-up
  }
  std::sort(ms.begin(), ms.end());
  SPINDLE_CUDA(cudaEventDestroy(start));
  SPINDLE_CUDA(cudaEventDestroy(b_done));
  SPINDLE_CUDA(cudaEventDestroy(stop));
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 1048576;
  const int products = argc > 2 ? std::atoi(argv[2]) : 24;
  SparseMlaChunk chunk(tokens, 16384, 1);
  const int64_t rows = 16384, D = 2048;
  auto x = random_bf16(rows * D, 4), dy = random_bf16(rows * D, 5);
  DeviceBuffer<float> dw(static_cast<size_t>(D * D), MemoryCategory::Gradients);
  SPINDLE_CUDA(cudaDeviceSynchronize());

  int least = 0, greatest = 0;
  SPINDLE_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t plain_a, plain_b, high_a, high_b;
  SPINDLE_CUDA(cudaStreamCreateWithPriority(&plain_a, cudaStreamNonBlocking, least));
  SPINDLE_CUDA(cudaStreamCreateWithPriority(&plain_b, cudaStreamNonBlocking, least));
  SPINDLE_CUDA(cudaStreamCreateWithPriority(&high_a, cudaStreamNonBlocking, greatest));
  SPINDLE_CUDA(cudaStreamCreateWithPriority(&high_b, cudaStreamNonBlocking, greatest));
  Gemm gemm;
  const auto run_products = [&](cudaStream_t stream) {
    for (int i = 0; i < products; ++i)
      gemm.linear_backward_weight(dy.data(), x.data(), dw.data(), rows, D, D, stream);
  };
  const auto forward = [&](cudaStream_t stream) { chunk.forward(stream); };
  const auto backward = [&](cudaStream_t stream) { chunk.backward(stream); };
  const int repeats = 5;
  const double alone_products =
      together_ms([&](cudaStream_t, cudaStream_t b) { run_products(b); }, plain_a, plain_b, repeats);
  std::printf(
      "sparse MLA (16,384 queries at %lld tokens, random pools) beside %d weight-gradient products "
      "[2048, 2048] over 16,384 rows (%.3f ms alone, %.0f TFLOP/s):\n",
      static_cast<long long>(tokens), products, alone_products,
      2.0 * rows * D * D * products / alone_products / 1e9);
  const std::pair<const char*, std::function<void(cudaStream_t)>> passes[] = {{"forward", forward},
                                                                              {"backward", backward}};
  for (const auto& pass : passes) {
    const char* name = pass.first;
    const std::function<void(cudaStream_t)>& attention = pass.second;
    const double alone =
        together_ms([&](cudaStream_t a, cudaStream_t) { attention(a); }, plain_a, plain_b, repeats);
    std::printf("  %-8s alone %8.3f ms\n", name, alone);
    const struct {
      const char* label;
      cudaStream_t a, b;
    } orders[] = {{"equal priorities", plain_a, plain_b},
                  {"products first", plain_a, high_b},
                  {"attention first", high_a, plain_b}};
    for (const auto& o : orders) {
      const double both = together_ms(
          [&](cudaStream_t a, cudaStream_t b) {
            attention(a);
            run_products(b);
          },
          o.a, o.b, repeats);
      std::printf("  %-8s + products, %-16s %8.3f ms: %5.1f%% of the products' time hidden\n", name, o.label,
                  both, 100.0 * (alone + alone_products - both) / alone_products);
    }
  }
  for (cudaStream_t stream : {plain_a, plain_b, high_a, high_b}) SPINDLE_CUDA(cudaStreamDestroy(stream));
  return 0;
}
