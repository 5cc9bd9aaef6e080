// DSA indexer training (version 1: correct first, CUDA cores, fp32 arithmetic). See
// indexer_training.h for the contracts and launch shapes.
//
// Next steps for speed (not done here): the pool scores are a small GEMM per query (heads x
// head_dim times head_dim x chosen pools) that tensor cores could take, with the relu mask kept
// for the backward instead of recomputed; dpool_keys could be summed per pool without atomics
// through a transposed index (for each pool, the queries that chose it), as noted in
// sparse_attention.cu for dkv.
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/indexer_training.h"
#include "kernels/cuda/shared_memory_limit.h"

namespace spindle::cuda {

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMassWarps = 4;
constexpr int kKlWarps = 8;
constexpr int kPoolChannels = 32, kPoolRows = 8, kPoolThreads = kPoolChannels * kPoolRows;
constexpr int64_t kPoolBlocksMax = 1024;  // pool-walking CTAs per channel tile: fills the GPU

struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Xor butterfly: every lane ends with the bit-identical result (fp addition commutes), so
// branching on it keeps the warp converged.
template <class Op>
__device__ __forceinline__ float warp_reduce(float value, Op op) {
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(kFull, value, offset));
  return value;
}

// Over the whole CTA, the same value to every thread (warps combined in a fixed order). Holds
// barriers: every thread calls it. scratch: one float per warp.
template <class Op>
__device__ __forceinline__ float block_reduce(float value, float* scratch, Op op) {
  const int warps = static_cast<int>(blockDim.x / 32);
  value = warp_reduce(value, op);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < warps; ++w) total = op(total, scratch[w]);
  __syncthreads();  // scratch is free for the next call
  return total;
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// q . k over the warp's lanes (lane c, c + 32, ...); q in shared memory as fp32, k bf16 or fp32.
template <class K>
__device__ __forceinline__ float warp_dot(const float* q, const K* k, int64_t n, int lane) {
  float dot = 0.0f;
  for (int64_t c = lane; c < n; c += 32) dot += q[c] * to_float(k[c]);
  return warp_reduce(dot, Sum());
}

__global__ void __launch_bounds__(kMassWarps * 32)
    attention_mass_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                          const int32_t* __restrict__ selected, float* __restrict__ mass, int64_t H,
                          int64_t KH, int64_t dqk, int64_t stride, int64_t width, float scale) {
  extern __shared__ float smem[];
  const int warps = static_cast<int>(blockDim.x / 32);
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int64_t t = blockIdx.x;
  float* sums = smem;                // [warps, width] probabilities summed over each warp's heads
  float* own = sums + warp * width;  // this warp's row: slot i belongs to lane i % 32
  float* qs = sums + warps * width + warp * dqk;  // [dqk] the query head, pre-scaled
  for (int64_t i = lane; i < width; i += 32) own[i] = 0.0f;
  const int32_t* idx = selected + t * width;
  for (int64_t h = warp; h < H; h += warps) {
    const __nv_bfloat16* qh = q + (t * H + h) * dqk;
    for (int64_t c = lane; c < dqk; c += 32) qs[c] = __bfloat162float(qh[c]) * scale;
    // Pass 1: the softmax's max and denominator, online.
    float m = -INFINITY, l = 0.0f;
    for (int64_t i0 = 0; i0 < width; i0 += 32) {
      const int32_t mine = i0 + lane < width ? idx[i0 + lane] : -1;
      const int n = static_cast<int>(width - i0 < 32 ? width - i0 : 32);
      for (int j = 0; j < n; ++j) {
        const int32_t sel = __shfl_sync(kFull, mine, j);
        if (sel < 0) continue;  // warp-uniform
        const float dot = warp_dot(qs, kv + (static_cast<int64_t>(sel) * KH + h % KH) * stride, dqk, lane);
        const float m_new = fmaxf(m, dot);
        l = l * expf(m - m_new) + expf(dot - m_new);
        m = m_new;
      }
    }
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
    // Pass 2: the probabilities, each kept by the lane that owns its slot.
    for (int64_t i0 = 0; i0 < width; i0 += 32) {
      const int32_t mine = i0 + lane < width ? idx[i0 + lane] : -1;
      const int n = static_cast<int>(width - i0 < 32 ? width - i0 : 32);
      float p_mine = 0.0f;
      for (int j = 0; j < n; ++j) {
        const int32_t sel = __shfl_sync(kFull, mine, j);
        if (sel < 0) continue;
        const float dot = warp_dot(qs, kv + (static_cast<int64_t>(sel) * KH + h % KH) * stride, dqk, lane);
        if (lane == j) p_mine = expf(dot - m) * inv_l;
      }
      if (i0 + lane < width) own[i0 + lane] += p_mine;
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += sums[w * width + i];
    mass[t * width + i] = total;
  }
}

__global__ void __launch_bounds__(kKlWarps * 32) indexer_kl_backward_kernel(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ pool_keys,
    const __nv_bfloat16* __restrict__ head_weights, const int32_t* __restrict__ selected,
    const float* __restrict__ mass, __nv_bfloat16* __restrict__ dq, float* __restrict__ dpool_keys,
    __nv_bfloat16* __restrict__ dhead_weights, double* __restrict__ kl_sum, int64_t queries, int64_t H,
    int64_t d, int64_t kp, int64_t runs, int64_t width, float scale, float score_scale) {
  extern __shared__ float smem[];
  __shared__ float scratch[kKlWarps];
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  float* qs = smem;                                   // [H, d] the query's heads
  float* dqs = qs + H * d;                            // [H, d] their gradient
  float* ws = dqs + H * d;                            // [H] head weights
  float* dws = ws + H;                                // [H] their gradient
  float* score = dws + H;                             // [runs] pool scores, then d loss / d score
  float* target = score + runs;                       // [runs] attention mass of each run's pool
  int* pool = reinterpret_cast<int*>(target + runs);  // [runs] the run's pool, -1 when unused
  float* ks = reinterpret_cast<float*>(pool + runs) + warp * 2 * d;  // [d] this warp's pool key
  float* dks = ks + d;                                               // [d] its gradient
  double kl_local = 0.0;                                             // thread 0's sum over this CTA's queries
  for (int64_t t = blockIdx.x; t < queries; t += gridDim.x) {        // t: a row of the chunk
    for (int64_t i = threadIdx.x; i < H * d; i += blockDim.x) {
      qs[i] = __bfloat162float(q[t * H * d + i]);
      dqs[i] = 0.0f;
    }
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      ws[h] = __bfloat162float(head_weights[t * H + h]);
      dws[h] = 0.0f;
    }
    // The chosen complete pools: runs of kpool slots at the front of the selection, named by
    // their first slot.
    float count = 0.0f, mass_sum = 0.0f;
    for (int64_t r = threadIdx.x; r < runs; r += blockDim.x) {
      const int32_t first = selected[t * width + r * kp];
      float m = 0.0f;
      if (first >= 0) {
        for (int64_t j = 0; j < kp; ++j) m += mass[t * width + r * kp + j];
        count += 1.0f;
        mass_sum += m;
      }
      pool[r] = first >= 0 ? static_cast<int>(first / kp) : -1;
      target[r] = m;
    }
    count = block_reduce(count, scratch, Sum());
    mass_sum = block_reduce(mass_sum, scratch, Sum());
    if (count >= 2.0f && mass_sum > 0.0f) {  // one pool or no mass: nothing to learn, zeros
      // Pass 1: score_r = sum_h w_h relu(q_h . k_r / sqrt(d)), a warp per run.
      for (int64_t r = warp; r < runs; r += kKlWarps) {
        if (pool[r] < 0) continue;
        for (int64_t c = lane; c < d; c += 32) ks[c] = __bfloat162float(pool_keys[pool[r] * d + c]);
        float sc = 0.0f;
        for (int64_t h = 0; h < H; ++h)
          sc += ws[h] * fmaxf(warp_dot(qs + h * d, ks, d, lane) * score_scale, 0.0f);
        if (lane == 0) score[r] = sc;
      }
      __syncthreads();
      // The indexer's softmax over the chosen pools against the normalised mass; each run stays
      // with one thread from here to the gradient it leaves in score[r].
      float mx = -INFINITY;
      for (int64_t r = threadIdx.x; r < runs; r += blockDim.x)
        if (pool[r] >= 0) mx = fmaxf(mx, score[r]);
      mx = block_reduce(mx, scratch, Max());
      float z_sum = 0.0f;
      for (int64_t r = threadIdx.x; r < runs; r += blockDim.x)
        if (pool[r] >= 0) z_sum += expf(score[r] - mx);
      z_sum = block_reduce(z_sum, scratch, Sum());
      const float log_z = logf(z_sum);
      float kl = 0.0f;
      for (int64_t r = threadIdx.x; r < runs; r += blockDim.x) {
        if (pool[r] < 0) continue;
        const float shifted = score[r] - mx, pi = target[r] / mass_sum;
        kl += pi > 0.0f ? pi * (logf(pi) - (shifted - log_z)) : 0.0f;  // log rho without underflow
        score[r] = (expf(shifted) / z_sum - pi) * scale;
      }
      kl = block_reduce(kl, scratch, Sum());  // its barriers also publish score[]
      if (threadIdx.x == 0) kl_local += kl;
      // Pass 2: recompute q_h . k_r; where the relu passes, d score / d w_h = relu(.) and
      // d score / d(q_h . k_r) = w_h / sqrt(d).
      for (int64_t r = warp; r < runs; r += kKlWarps) {
        if (pool[r] < 0) continue;
        const float dscore = score[r];
        for (int64_t c = lane; c < d; c += 32) {
          ks[c] = __bfloat162float(pool_keys[pool[r] * d + c]);
          dks[c] = 0.0f;
        }
        for (int64_t h = 0; h < H; ++h) {
          const float z = warp_dot(qs + h * d, ks, d, lane) * score_scale;
          if (z <= 0.0f) continue;  // warp-uniform
          if (lane == 0) atomicAdd(dws + h, dscore * z);
          const float g = dscore * ws[h] * score_scale;
          for (int64_t c = lane; c < d; c += 32) {
            atomicAdd(dqs + h * d + c, g * ks[c]);
            dks[c] += g * qs[h * d + c];
          }
        }
        for (int64_t c = lane; c < d; c += 32) atomicAdd(dpool_keys + pool[r] * d + c, dks[c]);
      }
      __syncthreads();
    }
    for (int64_t i = threadIdx.x; i < H * d; i += blockDim.x) dq[t * H * d + i] = __float2bfloat16(dqs[i]);
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dhead_weights[t * H + h] = __float2bfloat16(dws[h]);
    __syncthreads();  // the next query overwrites shared memory
  }
  if (threadIdx.x == 0 && kl_local != 0.0) atomicAdd(kl_sum, kl_local);
}

__global__ void __launch_bounds__(kPoolThreads)
    indexer_pool_keys_backward_kernel(const __nv_bfloat16* __restrict__ keys,
                                      const __nv_bfloat16* __restrict__ gate,
                                      const __nv_bfloat16* __restrict__ ape,
                                      const float* __restrict__ dpool_keys, __nv_bfloat16* __restrict__ dkeys,
                                      __nv_bfloat16* __restrict__ dgate, float* __restrict__ dape,
                                      int64_t pools, int64_t d, int64_t kp) {
  extern __shared__ float partial[];  // [kp, kPoolThreads]: each thread's share of dape[j, c]
  const int x = static_cast<int>(threadIdx.x % kPoolChannels),
            y = static_cast<int>(threadIdx.x / kPoolChannels);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kPoolChannels + x;
  for (int64_t j = 0; j < kp; ++j) partial[j * kPoolThreads + threadIdx.x] = 0.0f;
  if (c < d) {
    for (int64_t p = static_cast<int64_t>(blockIdx.y) * kPoolRows + y; p < pools;
         p += static_cast<int64_t>(gridDim.y) * kPoolRows) {
      const int64_t row = p * kp;
      auto logit = [&](int64_t j) {
        return __bfloat162float(gate[(row + j) * d + c]) + __bfloat162float(ape[j * d + c]);
      };
      const float g = dpool_keys[p * d + c];
      float mx = -INFINITY;
      for (int64_t j = 0; j < kp; ++j) mx = fmaxf(mx, logit(j));
      float sum = 0.0f, weighted = 0.0f;  // weighted: sum_j alpha_j g k_j once divided by sum
      for (int64_t j = 0; j < kp; ++j) {
        const float e = expf(logit(j) - mx);
        sum += e;
        weighted += e * __bfloat162float(keys[(row + j) * d + c]);
      }
      weighted *= g / sum;
      for (int64_t j = 0; j < kp; ++j) {
        const int64_t at = (row + j) * d + c;
        const float alpha = expf(logit(j) - mx) / sum;
        const float dlogit = alpha * (g * __bfloat162float(keys[at]) - weighted);
        dkeys[at] = __float2bfloat16(g * alpha);
        dgate[at] = __float2bfloat16(dlogit);
        partial[j * kPoolThreads + threadIdx.x] += dlogit;
      }
    }
  }
  __syncthreads();
  if (y == 0 && c < d)
    for (int64_t j = 0; j < kp; ++j) {
      float total = 0.0f;
      for (int r = 0; r < kPoolRows; ++r) total += partial[j * kPoolThreads + r * kPoolChannels + x];
      atomicAdd(dape + j * d + c, total);
    }
}

}  // namespace

void attention_mass(const cpu::SparseAttentionShape& s, const __nv_bfloat16* q, const __nv_bfloat16* kv,
                    const int32_t* selected, float* mass, cudaStream_t stream) {
  check(s.tokens >= 0 && s.heads > 0 && s.qk_dim > 0 && s.v_dim >= 0 && s.width >= 0,
        "attention_mass: expected tokens >= 0, heads, qk_dim > 0, v_dim, width >= 0, got tokens ", s.tokens,
        ", heads ", s.heads, ", qk_dim ", s.qk_dim, ", v_dim ", s.v_dim, ", width ", s.width);
  check(s.key_heads() > 0 && s.heads % s.key_heads() == 0, "attention_mass: ", s.heads,
        " query heads cannot share ", s.key_heads(), " key heads");
  if (s.tokens == 0 || s.width == 0) return;
  check(s.tokens < (int64_t{1} << 31), "attention_mass: ", s.tokens,
        " tokens are too many CTAs for one launch");
  const size_t per_warp = static_cast<size_t>(s.width + s.qk_dim) * sizeof(float);
  int warps = kMassWarps;
  while (warps > 1 && warps * per_warp > (48u << 10)) --warps;
  warps = static_cast<int>(std::min<int64_t>(warps, s.heads));
  const size_t bytes = warps * per_warp;
  allow_shared_memory(attention_mass_kernel, bytes, "attention_mass: width ", s.width, " and qk_dim ",
                      s.qk_dim);
  attention_mass_kernel<<<static_cast<unsigned>(s.tokens), warps * 32, bytes, stream>>>(
      q, kv, selected, mass, s.heads, s.key_heads(), s.qk_dim, s.qk_dim + s.v_dim, s.width,
      static_cast<float>(s.scale));
  SPINDLE_LAUNCHED("attention_mass_kernel");
}

void indexer_kl_backward(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                         const __nv_bfloat16* head_weights, const int32_t* selected, const float* mass,
                         float scale, __nv_bfloat16* dq, float* dpool_keys, __nv_bfloat16* dhead_weights,
                         double* kl_sum, cudaStream_t stream) {
  check(s.first_query >= 0 && s.first_query <= s.tokens && s.heads > 0 && s.head_dim > 0 && s.kpool > 0 &&
            s.topk >= 0,
        "indexer_kl_backward: expected 0 <= first_query <= tokens, topk >= 0 and heads, head_dim, kpool > 0, "
        "got first_query ",
        s.first_query, ", tokens ", s.tokens, ", heads ", s.heads, ", head_dim ", s.head_dim, ", kpool ",
        s.kpool, ", topk ", s.topk);
  const int64_t queries = s.queries();  // the kernel's rows; pools come from the selection
  if (queries == 0) return;
  const int64_t runs = s.topk / s.kpool;
  const size_t bytes =
      static_cast<size_t>(2 * s.heads * s.head_dim + 2 * s.heads + 3 * runs + kKlWarps * 2 * s.head_dim) *
      sizeof(float);
  allow_shared_memory(indexer_kl_backward_kernel, bytes, "indexer_kl_backward: heads ", s.heads,
                      ", head_dim ", s.head_dim, " and topk / kpool ", runs);
  int device = 0, sms = 0, per_sm = 0;
  SPINDLE_CUDA(cudaGetDevice(&device));
  SPINDLE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  SPINDLE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, indexer_kl_backward_kernel,
                                                             kKlWarps * 32, bytes));
  check(per_sm > 0, "indexer_kl_backward: no CTA of ", bytes, " bytes of shared memory fits on an SM");
  const int64_t blocks = std::min<int64_t>(queries, static_cast<int64_t>(sms) * per_sm);
  indexer_kl_backward_kernel<<<static_cast<unsigned>(blocks), kKlWarps * 32, bytes, stream>>>(
      q, pool_keys, head_weights, selected, mass, dq, dpool_keys, dhead_weights, kl_sum, queries, s.heads,
      s.head_dim, s.kpool, runs, s.width(), scale, 1.0f / std::sqrt(static_cast<float>(s.head_dim)));
  SPINDLE_LAUNCHED("indexer_kl_backward_kernel");
}

void indexer_pool_keys_backward(const cpu::IndexerShape& s, const __nv_bfloat16* keys,
                                const __nv_bfloat16* gate, const __nv_bfloat16* ape, const float* dpool_keys,
                                __nv_bfloat16* dkeys, __nv_bfloat16* dgate, float* dape,
                                cudaStream_t stream) {
  check(s.tokens >= 0 && s.kpool > 0 && s.head_dim > 0,
        "indexer_pool_keys_backward: expected tokens >= 0 and kpool, head_dim > 0, got tokens ", s.tokens,
        ", kpool ", s.kpool, ", head_dim ", s.head_dim);
  const int64_t pools = s.complete_pools(), d = s.head_dim;
  // The incomplete pool feeds no pooled key: its tokens' gradients are zero (bf16 zero is all-zero bits).
  const int64_t pooled = pools * s.kpool * d, rest = s.tokens * d - pooled;
  if (rest > 0) {
    SPINDLE_CUDA(
        cudaMemsetAsync(dkeys + pooled, 0, static_cast<size_t>(rest) * sizeof(__nv_bfloat16), stream));
    SPINDLE_CUDA(
        cudaMemsetAsync(dgate + pooled, 0, static_cast<size_t>(rest) * sizeof(__nv_bfloat16), stream));
  }
  if (pools == 0) return;
  const size_t bytes = static_cast<size_t>(s.kpool) * kPoolThreads * sizeof(float);
  allow_shared_memory(indexer_pool_keys_backward_kernel, bytes, "indexer_pool_keys_backward: kpool ",
                      s.kpool);
  const dim3 grid(
      static_cast<unsigned>((d + kPoolChannels - 1) / kPoolChannels),
      static_cast<unsigned>(std::min<int64_t>((pools + kPoolRows - 1) / kPoolRows, kPoolBlocksMax)));
  indexer_pool_keys_backward_kernel<<<grid, kPoolThreads, bytes, stream>>>(keys, gate, ape, dpool_keys, dkeys,
                                                                           dgate, dape, pools, d, s.kpool);
  SPINDLE_LAUNCHED("indexer_pool_keys_backward_kernel");
}

}  // namespace spindle::cuda
