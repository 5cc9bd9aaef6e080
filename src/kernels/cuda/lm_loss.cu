// Row statistics of the chunked lm_head loss: one block of 256 threads per row of a logits
// chunk. Each thread keeps an online (max, sum-exp) over its columns in one pass; the pairs are
// merged across the block and then into the row's running state of the earlier chunks.
#include <cmath>

#include "backend/cuda/check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/lm_loss.h"

namespace spindle::cuda::lm_loss_detail {

namespace {

constexpr int kThreads = 256;

// (m1, s1) <- (m1, s1) merged with (m2, s2): sum-exp relative to the larger max.
__device__ void merge(float& m1, float& s1, float m2, float s2) {
  const float m = fmaxf(m1, m2);
  if (m == -INFINITY) return;  // both empty
  s1 = s1 * expf(m1 - m) + s2 * expf(m2 - m);
  m1 = m;
}

__global__ void fold_chunk_kernel(const float* logits, int64_t ld, const int32_t* target, int64_t c0,
                                  int64_t C, float* run_max, float* run_sum, float* target_logit, bool first,
                                  bool last, float* logprob, float* lse) {
  wait_for_earlier_kernels();
  __shared__ float shared_m[kThreads / 32], shared_s[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* l = logits + row * ld;
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = threadIdx.x; j < C; j += kThreads) {
    const float x = l[j];
    if (x > m) {
      s = s * expf(m - x) + 1.0f;
      m = x;
    } else {
      s += expf(x - m);
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset), s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    shared_m[warp] = m;
    shared_s[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kThreads / 32; ++w) merge(m, s, shared_m[w], shared_s[w]);
  const int32_t t = target[row];
  float tl = first ? 0.0f : target_logit[row];
  if (t >= c0 && t < c0 + C) tl = l[t - c0];
  if (!first) merge(m, s, run_max[row], run_sum[row]);
  if (last) {
    const float z = m + logf(s);
    if (lse) lse[row] = z;
    logprob[row] = t >= 0 ? tl - z : 0.0f;
  } else {
    run_max[row] = m;
    run_sum[row] = s;
    target_logit[row] = tl;
  }
}

__global__ void softmax_grad_kernel(const float* logits, int64_t ld, const int32_t* target, const float* lse,
                                    int64_t c0, int64_t C, float scale, __nv_bfloat16* dlogits) {
  wait_for_earlier_kernels();
  const int64_t row = blockIdx.x;
  const float* l = logits + row * ld;
  __nv_bfloat16* d = dlogits + row * ld;
  const int32_t t = target[row];
  const float z = lse[row];
  if (t < 0) {
    for (int64_t j = threadIdx.x; j < C; j += kThreads) d[j] = __float2bfloat16(0.0f);
    return;
  }
  for (int64_t j = threadIdx.x; j < C; j += kThreads) {
    float g = expf(l[j] - z) * scale;
    if (c0 + j == t) g -= scale;
    d[j] = __float2bfloat16(g);
  }
}

__global__ void mean_loss_kernel(const float* logprob, const int32_t* target, int64_t L, float* loss) {
  wait_for_earlier_kernels();
  constexpr int kReduceThreads = 1024;
  __shared__ double shared_sum[kReduceThreads / 32];
  __shared__ int64_t shared_count[kReduceThreads / 32];
  double sum = 0.0;
  int64_t count = 0;
  for (int64_t i = threadIdx.x; i < L; i += kReduceThreads)
    if (target[i] >= 0) {
      sum -= logprob[i];
      ++count;
    }
  for (int offset = 16; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    count += __shfl_xor_sync(0xffffffffu, count, offset);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    shared_sum[warp] = sum;
    shared_count[warp] = count;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kReduceThreads / 32; ++w) {
    sum += shared_sum[w];
    count += shared_count[w];
  }
  *loss = count > 0 ? static_cast<float>(sum / static_cast<double>(count)) : 0.0f;
}

}  // namespace

void fold_chunk(const float* logits, int64_t ld, const int32_t* target, int64_t rows, int64_t c0, int64_t C,
                float* run_max, float* run_sum, float* target_logit, bool first, bool last, float* logprob,
                float* lse, cudaStream_t stream) {
  if (rows == 0) return;
  launch_kernel(fold_chunk_kernel, static_cast<unsigned>(rows), kThreads, 0, stream, logits, ld, target, c0,
                C, run_max, run_sum, target_logit, first, last, logprob, lse);
  SPINDLE_LAUNCHED("fold_chunk_kernel");
}

void softmax_grad(const float* logits, int64_t ld, const int32_t* target, const float* lse, int64_t rows,
                  int64_t c0, int64_t C, float scale, __nv_bfloat16* dlogits, cudaStream_t stream) {
  if (rows == 0) return;
  launch_kernel(softmax_grad_kernel, static_cast<unsigned>(rows), kThreads, 0, stream, logits, ld, target,
                lse, c0, C, scale, dlogits);
  SPINDLE_LAUNCHED("softmax_grad_kernel");
}

void mean_loss(const float* logprob, const int32_t* target, int64_t L, float* loss, cudaStream_t stream) {
  launch_kernel(mean_loss_kernel, 1, 1024, 0, stream, logprob, target, L, loss);
  SPINDLE_LAUNCHED("mean_loss_kernel");
}

}  // namespace spindle::cuda::lm_loss_detail
