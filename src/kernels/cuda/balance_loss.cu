// Balance loss kernels, one warp per token (grid-stride), its lanes owning experts lane, lane + 32,
// ... of the token's row, staged in shared memory. The top-k is taken on the logits: softmax keeps
// their order, so this is the reference's order by p exactly, with no ties made by fp32 rounding of
// p. Each warp sums its tokens' picks and probabilities in its own shared slots (no atomics); a
// block adds its warps' sums in warp order and then to the outputs with one atomic per expert.
#include <algorithm>
#include <climits>
#include <cmath>

#include "backend/cuda/check.h"
#include "kernels/cuda/balance_loss.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/warp_reduce.cuh"

namespace spindle::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int64_t kMaxExperts = 2048;
constexpr int64_t kStatisticsBlocks = 1024;
constexpr int64_t kBackwardBlocks = 4096;

// Copies the token's logits into `row` (each lane its own experts) and returns the softmax's
// maximum and denominator.
__device__ void stage_row(const float* logits, int E, int lane, float* row, float& largest,
                          float& denominator) {
  largest = -INFINITY;
  for (int e = lane; e < E; e += 32) {
    row[e] = logits[e];
    largest = fmaxf(largest, row[e]);
  }
  largest = warp_max(largest);
  denominator = 0.0f;
  for (int e = lane; e < E; e += 32) denominator += expf(row[e] - largest);
  denominator = warp_sum(denominator);
}

// Shared memory, per warp: its sums of p (double) [E], the token's row [E] and its pick counts [E].
__global__ void statistics_kernel(const float* logits, int64_t tokens, int E, int K, double* counts,
                                  double* prob_sum) {
  wait_for_earlier_kernels();
  extern __shared__ double shared[];
  double* warp_psum = shared;
  float* warp_row = reinterpret_cast<float*>(warp_psum + kWarps * E);
  int* warp_picks = reinterpret_cast<int*>(warp_row + kWarps * E);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  double* psum = warp_psum + warp * E;
  float* row = warp_row + warp * E;
  int* picks = warp_picks + warp * E;
  for (int e = lane; e < E; e += 32) {
    psum[e] = 0.0;
    picks[e] = 0;
  }
  for (int64_t t = blockIdx.x * static_cast<int64_t>(kWarps) + warp; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    float largest, denominator;
    stage_row(logits + t * E, E, lane, row, largest, denominator);
    for (int e = lane; e < E; e += 32) psum[e] += expf(row[e] - largest) / denominator;
    // The k-th pick is the best (larger logit, then lower index) after the (k-1)-th in that order.
    float last = INFINITY;
    int last_index = -1;
    for (int k = 0; k < K; ++k) {
      float v = -INFINITY;
      int i = INT_MAX;
      for (int e = lane; e < E; e += 32) {
        const float l = row[e];
        const bool after = l < last || (l == last && e > last_index);
        if (after && (l > v || (l == v && e < i))) {
          v = l;
          i = e;
        }
      }
      warp_argmax(v, i);
      if (lane == 0 && i < E) ++picks[i];  // i < E fails only on NaN logits
      last = v;
      last_index = i;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads) {
    double p = 0.0;
    int c = 0;
    for (int w = 0; w < kWarps; ++w) {
      p += warp_psum[w * E + e];
      c += warp_picks[w * E + e];
    }
    if (c != 0) atomicAdd(counts + e, static_cast<double>(c));
    if (p != 0.0) atomicAdd(prob_sum + e, rint(p * 0x1p24) * 0x1p-24);
  }
}

// Shared memory: the counts less their mean [E] (centred, so that fp32 keeps counts_e - dot when
// the counts pooled over many layers are large; sum_j p_j = 1 makes the shift cancel), then per
// warp the row [E], overwritten with p.
__global__ void balance_backward_kernel(const float* logits, const double* counts, int64_t tokens, int E,
                                        float factor, float* dlogits) {
  wait_for_earlier_kernels();
  extern __shared__ float centred[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* row = centred + E + warp * E;
  double total = 0.0;
  for (int e = lane; e < E; e += 32) total += counts[e];
  const double mean = warp_sum(total) / E;  // the same in every warp
  for (int e = threadIdx.x; e < E; e += kThreads) centred[e] = static_cast<float>(counts[e] - mean);
  __syncthreads();
  for (int64_t t = blockIdx.x * static_cast<int64_t>(kWarps) + warp; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    float largest, denominator;
    stage_row(logits + t * E, E, lane, row, largest, denominator);
    float dot = 0.0f;
    for (int e = lane; e < E; e += 32) {
      row[e] = expf(row[e] - largest) / denominator;
      dot += row[e] * centred[e];
    }
    dot = warp_sum(dot);
    float* d = dlogits + t * E;
    for (int e = lane; e < E; e += 32) d[e] += factor * row[e] * (centred[e] - dot);
  }
}

void check_experts(const char* what, int64_t tokens, int64_t experts) {
  check(experts >= 1 && experts <= kMaxExperts, what, ": experts must be in 1..", kMaxExperts, ", got ",
        experts);
  check(tokens >= 0, what, ": negative token count ", tokens);
}

}  // namespace

void balance_statistics(const float* logits, int64_t tokens, int64_t experts, int64_t topk, double* counts,
                        double* prob_sum, cudaStream_t stream) {
  check_experts("balance_statistics", tokens, experts);
  check(topk >= 1 && topk <= experts, "balance_statistics: topk ", topk, " must be in 1..", experts);
  check(tokens < (int64_t{1} << 29), "balance_statistics: ", tokens,
        " tokens (prob_sum kept exact below 2^29)");
  if (tokens == 0) return;
  const size_t bytes = kWarps * static_cast<size_t>(experts) * (sizeof(double) + sizeof(float) + sizeof(int));
  allow_shared_memory(statistics_kernel, bytes, "balance_statistics: ", experts, " experts");
  const auto blocks =
      static_cast<unsigned>(std::min<int64_t>((tokens + kWarps - 1) / kWarps, kStatisticsBlocks));
  launch_kernel(statistics_kernel, blocks, kThreads, bytes, stream, logits, tokens, static_cast<int>(experts),
                static_cast<int>(topk), counts, prob_sum);
  SPINDLE_LAUNCHED("statistics_kernel");
}

double balance_loss_value(const double* counts_host, const double* prob_sum_host, int64_t experts,
                          double rows) {
  check(experts >= 1, "balance_loss_value: no experts");
  check(rows > 0, "balance_loss_value: rows must be positive, got ", rows);
  double aux = 0;
  for (int64_t e = 0; e < experts; ++e) aux += counts_host[e] / rows * prob_sum_host[e] / rows;
  return aux * static_cast<double>(experts);
}

void balance_loss_backward(const float* logits, const double* counts, int64_t tokens, int64_t experts,
                           double rows, double coef, float* dlogits, cudaStream_t stream) {
  check_experts("balance_loss_backward", tokens, experts);
  check(rows > 0, "balance_loss_backward: rows must be positive, got ", rows);
  if (tokens == 0) return;
  const size_t bytes = (kWarps + 1) * static_cast<size_t>(experts) * sizeof(float);
  allow_shared_memory(balance_backward_kernel, bytes, "balance_loss_backward: ", experts, " experts");
  const auto blocks =
      static_cast<unsigned>(std::min<int64_t>((tokens + kWarps - 1) / kWarps, kBackwardBlocks));
  const auto factor = static_cast<float>(coef * static_cast<double>(experts) / (rows * rows));
  launch_kernel(balance_backward_kernel, blocks, kThreads, bytes, stream, logits, counts, tokens,
                static_cast<int>(experts), factor, dlogits);
  SPINDLE_LAUNCHED("balance_backward_kernel");
}

}  // namespace spindle::cuda
