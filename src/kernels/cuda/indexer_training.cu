// DSA indexer training: the attention mass (CUDA cores, for the paths whose attention backward
// does not sum it), the KL backward (tensor cores) and the pooling's backward. See
// indexer_training.h for the contracts and launch shapes.
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/indexer_training.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/warp_reduce.cuh"

namespace spindle::cuda {

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMassWarps = 4;
constexpr int kKlWarps = 4;
constexpr int kPoolChannels = 32, kPoolRows = 8, kPoolThreads = kPoolChannels * kPoolRows;
constexpr int64_t kPoolBlocksMax = 1024;  // pool-walking CTAs per channel tile: fills the GPU

struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

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

// q . k over the warp's lanes (lane c, c + 32, ...); q in shared memory as fp32.
__device__ __forceinline__ float warp_dot(const float* q, const __nv_bfloat16* k, int64_t n, int lane) {
  float dot = 0.0f;
  for (int64_t c = lane; c < n; c += 32) dot += q[c] * __bfloat162float(k[c]);
  return warp_reduce(dot, Sum());
}

__global__ void __launch_bounds__(kMassWarps * 32)
    attention_mass_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                          const int32_t* __restrict__ selected, float* __restrict__ mass, int64_t H,
                          int64_t KH, int64_t dqk, int64_t stride, int64_t width, float scale) {
  wait_for_earlier_kernels();
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

// The KL backward's shared memory for one query (see indexer_training.h): bf16 tiles padded to the
// tensor cores' 16 (heads, head_dim, runs), rows 8 bf16 (or fp32) longer so that ldmatrix and the
// fragments' stores meet no bank conflicts.
struct KlLayout {
  int64_t heads, dim, runs;                                       // padded to 16
  int64_t q_stride, g_stride, z_stride;                           // elements per row
  int64_t q, keys, g_hi, g_lo, z, w, score, target, pool, bytes;  // byte offsets
  __host__ __device__ KlLayout(int64_t H, int64_t d, int64_t R) {
    heads = (H + 15) / 16 * 16;
    dim = (d + 15) / 16 * 16;
    runs = (R + 15) / 16 * 16;
    q_stride = dim + 8;
    g_stride = runs + 8;
    z_stride = runs + 8;
    q = 0;                               // [heads, q_stride] bf16: the query's heads
    keys = q + heads * q_stride * 2;     // [runs, q_stride] bf16: the chosen pools' keys
    g_hi = keys + runs * q_stride * 2;   // [heads, g_stride] bf16: d loss / d z, high part
    g_lo = g_hi + heads * g_stride * 2;  //   and what it left
    z = g_lo + heads * g_stride * 2;     // [heads, z_stride] fp32: q_h . k_r / sqrt(d)
    w = z + heads * z_stride * 4;        // [heads] fp32 head weights
    score = w + heads * 4;               // [runs] fp32 scores, then d loss / d score
    target = score + runs * 4;           // [runs] fp32 attention mass per run
    pool = target + runs * 4;            // [runs] int32 the run's pool, -1 when unused
    bytes = pool + runs * 4;
  }
};

// A 16 x 16 bf16 A fragment from a row-major [m, k] tile (ldmatrix: lane l names row l % 16 of the
// columns (l / 16) * 8 on).
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const __nv_bfloat16* tile, int64_t stride,
                                       int lane) {
  ldmatrix_x4(a, shared_address(tile + (lane % 16) * stride + (lane / 16) * 8));
}

// The same fragment from a [k, m] tile: the transposed matrices, k rows (l / 16) * 8 on, m columns
// ((l / 8) % 2) * 8 on.
__device__ __forceinline__ void load_a_transposed(uint32_t (&a)[4], const __nv_bfloat16* tile, int64_t stride,
                                                  int lane) {
  ldmatrix_x4_trans(a, shared_address(tile + ((lane / 16) * 8 + lane % 8) * stride + ((lane / 8) % 2) * 8));
}

// B fragments of two n8 tiles (b[0..1] the first, b[2..3] the second) from an [n, k] tile.
__device__ __forceinline__ void load_b_pair(uint32_t (&b)[4], const __nv_bfloat16* tile, int64_t stride,
                                            int lane) {
  ldmatrix_x4(b, shared_address(tile + ((lane / 16) * 8 + lane % 8) * stride + ((lane / 8) % 2) * 8));
}

// The same from a [k, n] tile.
__device__ __forceinline__ void load_b_pair_transposed(uint32_t (&b)[4], const __nv_bfloat16* tile,
                                                       int64_t stride, int lane) {
  ldmatrix_x4_trans(b, shared_address(tile + (((lane / 8) % 2) * 8 + lane % 8) * stride + (lane / 16) * 8));
}

// acc += (hi + lo) B over `steps` k16 steps, a 16 x 16 output tile (two n8 tiles): A from both
// parts at element a0 (a_step further each step; a [k, m] tile when kTransposed, else [m, k]), B
// from the [k, n] tile b (16 rows further each step).
template <bool kTransposed>
__device__ __forceinline__ void split_times(float (&acc)[2][4], const __nv_bfloat16* const (&parts)[2],
                                            int64_t a0, int64_t a_step, int64_t a_stride,
                                            const __nv_bfloat16* b, int64_t b_stride, int64_t steps,
                                            int lane) {
  for (int64_t kk = 0; kk < steps; ++kk) {
    uint32_t bf[4];
    load_b_pair_transposed(bf, b + kk * 16 * b_stride, b_stride, lane);
    for (const __nv_bfloat16* part : parts) {
      uint32_t a[4];
      if constexpr (kTransposed) {
        load_a_transposed(a, part + a0 + kk * a_step, a_stride, lane);
      } else {
        load_a(a, part + a0 + kk * a_step, a_stride, lane);
      }
      mma_bf16(acc[0], a, bf[0], bf[1]);
      mma_bf16(acc[1], a, bf[2], bf[3]);
    }
  }
}

// One query's KL gradient on the tensor cores (see indexer_training.h). z = q k^T / sqrt(d) is kept
// in shared memory between the scores and the gradients; d loss / d z enters the two gradient
// products as bf16 hi + lo, so that they keep fp32 accuracy (q and the keys are bf16 already).
__global__ void __launch_bounds__(kKlWarps * 32) indexer_kl_backward_kernel(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ pool_keys,
    const __nv_bfloat16* __restrict__ head_weights, const int32_t* __restrict__ selected,
    const float* __restrict__ mass, __nv_bfloat16* __restrict__ dq, float* __restrict__ dpool_keys,
    __nv_bfloat16* __restrict__ dhead_weights, double* __restrict__ sums, int64_t queries, int64_t H,
    int64_t d, int64_t kp, int64_t runs, int64_t width, float scale, float score_scale) {
  wait_for_earlier_kernels();
  extern __shared__ __align__(16) unsigned char kl_smem[];
  __shared__ float scratch[kKlWarps];
  const KlLayout lay(H, d, runs);
  auto* qs = reinterpret_cast<__nv_bfloat16*>(kl_smem + lay.q);
  auto* ks = reinterpret_cast<__nv_bfloat16*>(kl_smem + lay.keys);
  auto* g_hi = reinterpret_cast<__nv_bfloat16*>(kl_smem + lay.g_hi);
  auto* g_lo = reinterpret_cast<__nv_bfloat16*>(kl_smem + lay.g_lo);
  auto* zs = reinterpret_cast<float*>(kl_smem + lay.z);
  auto* ws = reinterpret_cast<float*>(kl_smem + lay.w);
  auto* score = reinterpret_cast<float*>(kl_smem + lay.score);
  auto* target = reinterpret_cast<float*>(kl_smem + lay.target);
  auto* pool = reinterpret_cast<int*>(kl_smem + lay.pool);
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int g = lane / 4, c = lane % 4;
  const int64_t qst = lay.q_stride, gst = lay.g_stride, zst = lay.z_stride;
  const int64_t m_tiles = lay.heads / 16, d_pairs = lay.dim / 16, r_tiles = lay.runs / 16;
  const __nv_bfloat16* const parts[2] = {g_hi, g_lo};
  const bool rows_16_byte = d % 8 == 0;  // every row of q and the keys starts 16-byte aligned
  double kl_local = 0.0;                 // thread 0's sums over this CTA's queries
  int64_t trained_local = 0, closed_local = 0;
  for (int64_t t = blockIdx.x; t < queries; t += gridDim.x) {  // t: a row of the chunk
    // The chosen complete pools: runs of kpool slots at the front of the selection, named by
    // their first slot.
    float count = 0.0f, mass_sum = 0.0f;
    for (int64_t r = threadIdx.x; r < lay.runs; r += blockDim.x) {
      const int32_t first = r < runs ? selected[t * width + r * kp] : -1;
      float m = 0.0f;
      if (first >= 0) {
        for (int64_t j = 0; j < kp; ++j) m += mass[t * width + r * kp + j];
        count += 1.0f;
        mass_sum += m;
      }
      pool[r] = first >= 0 ? static_cast<int>(first / kp) : -1;
      target[r] = m;
    }
    for (int64_t h = threadIdx.x; h < lay.heads; h += blockDim.x)
      ws[h] = h < H ? __bfloat162float(head_weights[t * H + h]) : 0.0f;
    count = block_reduce(count, scratch, Sum());  // its barriers publish pool[] and ws[]
    mass_sum = block_reduce(mass_sum, scratch, Sum());
    if (count < 2.0f || mass_sum <= 0.0f) {  // one pool or no mass: nothing to learn, zeros
      for (int64_t i = threadIdx.x; i < H * d; i += blockDim.x) dq[t * H * d + i] = __float2bfloat16(0.0f);
      for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dhead_weights[t * H + h] = __float2bfloat16(0.0f);
      continue;  // nothing past the reductions was read: the next query may overwrite
    }
    ++trained_local;
    // The query's heads and its pools' keys, zero past H, d and the used runs.
    const __nv_bfloat16* qt = q + t * H * d;
    if (rows_16_byte) {
      const int64_t pieces = lay.dim / 8;
      for (int64_t i = threadIdx.x; i < lay.heads * pieces; i += blockDim.x) {
        const int64_t h = i / pieces, col = i % pieces * 8;
        const bool valid = h < H && col < d;
        copy16(qs + h * qst + col, valid ? qt + h * d + col : qt, valid);
      }
      for (int64_t i = threadIdx.x; i < lay.runs * pieces; i += blockDim.x) {
        const int64_t r = i / pieces, col = i % pieces * 8;
        const bool valid = pool[r] >= 0 && col < d;
        copy16(ks + r * qst + col, valid ? pool_keys + pool[r] * d + col : pool_keys, valid);
      }
      copy_commit();
      copy_wait_all();
    } else {
      const __nv_bfloat16 zero = __float2bfloat16(0.0f);
      for (int64_t i = threadIdx.x; i < lay.heads * lay.dim; i += blockDim.x) {
        const int64_t h = i / lay.dim, col = i % lay.dim;
        qs[h * qst + col] = h < H && col < d ? qt[h * d + col] : zero;
      }
      for (int64_t i = threadIdx.x; i < lay.runs * lay.dim; i += blockDim.x) {
        const int64_t r = i / lay.dim, col = i % lay.dim;
        ks[r * qst + col] = pool[r] >= 0 && col < d ? pool_keys[pool[r] * d + col] : zero;
      }
    }
    __syncthreads();
    // z = q k^T / sqrt(d): [heads, runs], a warp per 16 x 16 tile.
    for (int64_t tile = warp; tile < m_tiles * r_tiles; tile += kKlWarps) {
      const int64_t mi = tile / r_tiles, ni = tile % r_tiles;
      float acc[2][4] = {};
      for (int64_t kk = 0; kk < d_pairs; ++kk) {
        uint32_t a[4], b[4];
        load_a(a, qs + mi * 16 * qst + kk * 16, qst, lane);
        load_b_pair(b, ks + ni * 16 * qst + kk * 16, qst, lane);
        mma_bf16(acc[0], a, b[0], b[1]);
        mma_bf16(acc[1], a, b[2], b[3]);
      }
      for (int n = 0; n < 2; ++n) {
        float* z = zs + (mi * 16 + g) * zst + ni * 16 + n * 8 + 2 * c;
        *reinterpret_cast<float2*>(z) = make_float2(acc[n][0] * score_scale, acc[n][1] * score_scale);
        *reinterpret_cast<float2*>(z + 8 * zst) =
            make_float2(acc[n][2] * score_scale, acc[n][3] * score_scale);
      }
    }
    __syncthreads();
    // score_r = sum_h w_h relu(z_hr); the indexer's softmax over the chosen pools against the
    // normalised mass. Each run stays with one thread from here to the gradient it leaves in
    // score[r] (zero for unused and padding runs).
    for (int64_t r = threadIdx.x; r < runs; r += blockDim.x) {
      if (pool[r] < 0) continue;
      float sc = 0.0f;
      for (int64_t h = 0; h < H; ++h) sc += ws[h] * fmaxf(zs[h * zst + r], 0.0f);
      score[r] = sc;
    }
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
    for (int64_t r = threadIdx.x; r < lay.runs; r += blockDim.x) {
      if (pool[r] < 0) {
        score[r] = 0.0f;
        continue;
      }
      const float shifted = score[r] - mx, pi = target[r] / mass_sum;
      kl += pi > 0.0f ? pi * (logf(pi) - (shifted - log_z)) : 0.0f;  // log rho without underflow
      score[r] = (expf(shifted) / z_sum - pi) * scale;
    }
    kl = block_reduce(kl, scratch, Sum());  // its barriers also publish score[]
    if (threadIdx.x == 0) kl_local += kl;
    // Where the relu passes, d loss / d z_hr = dscore_r w_h and d loss / d w_h = sum_r dscore_r z_hr;
    // the 1 / sqrt(d) of z goes into the first.
    int open = 0;  // a relu of this thread's passes (padding has z = 0: closed)
    for (int64_t i = threadIdx.x; i < lay.heads * lay.runs; i += blockDim.x) {
      const int64_t h = i / lay.runs, r = i % lay.runs;
      open |= zs[h * zst + r] > 0.0f;
      const float gz = zs[h * zst + r] > 0.0f ? score[r] * ws[h] * score_scale : 0.0f;
      const Bf16Split split = split_bf16(gz);
      g_hi[h * gst + r] = split.hi;
      g_lo[h * gst + r] = split.lo;
    }
    for (int64_t h = warp; h < H; h += kKlWarps) {
      float dw = 0.0f;
      for (int64_t r = lane; r < runs; r += 32) dw += score[r] * fmaxf(zs[h * zst + r], 0.0f);
      dw = warp_reduce(dw, Sum());
      if (lane == 0) dhead_weights[t * H + h] = __float2bfloat16(dw);
    }
    if (__syncthreads_or(open) == 0 && threadIdx.x == 0) ++closed_local;
    // dq = G k: [heads, d] over the runs.
    for (int64_t tile = warp; tile < m_tiles * d_pairs; tile += kKlWarps) {
      const int64_t mi = tile / d_pairs, ni = tile % d_pairs;
      float acc[2][4] = {};
      split_times<false>(acc, parts, mi * 16 * gst, 16, gst, ks + ni * 16, qst, r_tiles, lane);
      for (int n = 0; n < 2; ++n)
        for (int e = 0; e < 4; ++e) {
          const int64_t h = mi * 16 + g + (e / 2) * 8, col = ni * 16 + n * 8 + 2 * c + e % 2;
          if (h < H && col < d) dq[(t * H + h) * d + col] = __float2bfloat16(acc[n][e]);
        }
    }
    // dpool += G^T q: [runs, d] over the heads, added where the run names a pool.
    for (int64_t tile = warp; tile < r_tiles * d_pairs; tile += kKlWarps) {
      const int64_t mi = tile / d_pairs, ni = tile % d_pairs;
      float acc[2][4] = {};
      split_times<true>(acc, parts, mi * 16, 16 * gst, gst, qs + ni * 16, qst, m_tiles, lane);
      for (int half = 0; half < 2; ++half) {
        const int p = pool[mi * 16 + g + half * 8];
        if (p < 0) continue;
        float* row = dpool_keys + static_cast<int64_t>(p) * d;
        for (int n = 0; n < 2; ++n) {
          const int64_t col = ni * 16 + n * 8 + 2 * c;
          const float x = acc[n][2 * half], y = acc[n][2 * half + 1];
          if (col + 1 < d && d % 2 == 0) {
            atomicAdd(reinterpret_cast<float2*>(row + col), make_float2(x, y));
          } else {
            if (col < d) atomicAdd(row + col, x);
            if (col + 1 < d) atomicAdd(row + col + 1, y);
          }
        }
      }
    }
    __syncthreads();  // the next query overwrites shared memory
  }
  if (threadIdx.x == 0 && trained_local > 0) {
    atomicAdd(sums, kl_local);
    atomicAdd(sums + 1, static_cast<double>(trained_local));
    if (closed_local > 0) atomicAdd(sums + 2, static_cast<double>(closed_local));
  }
}

__global__ void __launch_bounds__(kPoolThreads)
    indexer_pool_keys_backward_kernel(const __nv_bfloat16* __restrict__ keys,
                                      const __nv_bfloat16* __restrict__ gate,
                                      const __nv_bfloat16* __restrict__ ape,
                                      const float* __restrict__ dpool_keys, __nv_bfloat16* __restrict__ dkeys,
                                      __nv_bfloat16* __restrict__ dgate, float* __restrict__ dape,
                                      int64_t pools, int64_t d, int64_t kp) {
  wait_for_earlier_kernels();
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
  launch_kernel(attention_mass_kernel, static_cast<unsigned>(s.tokens), warps * 32, bytes, stream, q, kv,
                selected, mass, s.heads, s.key_heads(), s.qk_dim, s.qk_dim + s.v_dim, s.width,
                static_cast<float>(s.scale));
  SPINDLE_LAUNCHED("attention_mass_kernel");
}

void indexer_kl_backward(const cpu::IndexerShape& s, const __nv_bfloat16* q, const __nv_bfloat16* pool_keys,
                         const __nv_bfloat16* head_weights, const int32_t* selected, const float* mass,
                         float scale, __nv_bfloat16* dq, float* dpool_keys, __nv_bfloat16* dhead_weights,
                         double* sums, cudaStream_t stream) {
  check(s.first_query >= 0 && s.first_query <= s.tokens && s.heads > 0 && s.head_dim > 0 && s.kpool > 0 &&
            s.topk >= 0,
        "indexer_kl_backward: expected 0 <= first_query <= tokens, topk >= 0 and heads, head_dim, kpool > 0, "
        "got first_query ",
        s.first_query, ", tokens ", s.tokens, ", heads ", s.heads, ", head_dim ", s.head_dim, ", kpool ",
        s.kpool, ", topk ", s.topk);
  const int64_t queries = s.queries();  // the kernel's rows; pools come from the selection
  if (queries == 0) return;
  const int64_t runs = s.topk / s.kpool;
  const auto bytes = static_cast<size_t>(KlLayout(s.heads, s.head_dim, runs).bytes);
  allow_shared_memory(indexer_kl_backward_kernel, bytes, "indexer_kl_backward: heads ", s.heads,
                      ", head_dim ", s.head_dim, " and topk / kpool ", runs);
  int device = 0, sms = 0, per_sm = 0;
  SPINDLE_CUDA(cudaGetDevice(&device));
  SPINDLE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  SPINDLE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, indexer_kl_backward_kernel,
                                                             kKlWarps * 32, bytes));
  check(per_sm > 0, "indexer_kl_backward: no CTA of ", bytes, " bytes of shared memory fits on an SM");
  const int64_t blocks = std::min<int64_t>(queries, static_cast<int64_t>(sms) * per_sm);
  launch_kernel(indexer_kl_backward_kernel, static_cast<unsigned>(blocks), kKlWarps * 32, bytes, stream, q,
                pool_keys, head_weights, selected, mass, dq, dpool_keys, dhead_weights, sums, queries,
                s.heads, s.head_dim, s.kpool, runs, s.width(), scale,
                1.0f / std::sqrt(static_cast<float>(s.head_dim)));
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
  launch_kernel(indexer_pool_keys_backward_kernel, grid, kPoolThreads, bytes, stream, keys, gate, ape,
                dpool_keys, dkeys, dgate, dape, pools, d, s.kpool);
  SPINDLE_LAUNCHED("indexer_pool_keys_backward_kernel");
}

}  // namespace spindle::cuda
