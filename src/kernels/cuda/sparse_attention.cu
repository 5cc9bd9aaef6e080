// DSA attention over selected indices, forward and backward (version 1: correct first, CUDA
// cores, fp32 arithmetic). One warp per (query, head), up to 4 heads of one query per CTA; the
// warp's 32 lanes split the channels (lane c, c+32, ...), so the query row and the accumulators
// in shared memory are lane-private and need no barrier. The selected indices are read 32 at a
// time (one per lane) and broadcast with shuffles. Online softmax: a running max m, denominator l
// and rescaled accumulator, so no width-sized buffer exists anywhere.
//
// Backward: pass 1 recomputes m, l and sum_s p_s dp_s (dp_s = dout . v_s) online; pass 2 forms
// p_s and ds_s = p_s (dp_s - sum) * scale and writes dq (registers of the warp, then bf16) and
// adds ds_s q into dk_s and p_s dout into dv_s with fp32 atomics, because several queries select
// the same key. The alternative, for a later version: build a transposed index (for each key, the
// (query, slot) pairs that chose it, by a counting sort over `selected`), then let one CTA own
// each key row and sum its contributions without atomics, deterministically, writing bf16 or fp32
// dkv once; it costs a sort and a second walk over the queries' statistics (m, l, sum per query
// and head, saved by pass 1).
//
// The absorbed form's fast path is sparse_mla.cu (all heads of a query against the same gathered
// latent rows on the tensor cores); this kernel serves the expanded form and any shape that one
// does not take (loudly). Next for it: bf16x2/16-byte loads, several slots per warp in flight.
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/sparse_attention.h"
#include "kernels/cuda/warp_reduce.cuh"

namespace spindle::cuda {

namespace {

constexpr int kMaxWarps = 4;
constexpr unsigned kFull = 0xffffffffu;

__global__ void __launch_bounds__(kMaxWarps * 32)
    sparse_attention_forward_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                                    const int32_t* __restrict__ selected, __nv_bfloat16* __restrict__ out,
                                    int64_t H, int64_t KH, int64_t dqk, int64_t dv, int64_t width,
                                    float scale, int warps) {
  wait_for_earlier_kernels();
  extern __shared__ float smem[];
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int64_t groups = (H + warps - 1) / warps;
  const int64_t t = blockIdx.x / groups;
  const int64_t h = (blockIdx.x % groups) * warps + warp;
  if (h >= H) return;  // no CTA-wide barrier follows
  const int64_t stride = dqk + dv;
  float* qs = smem + warp * stride;  // [dqk] the query, pre-scaled
  float* acc = qs + dqk;             // [dv] running output
  const __nv_bfloat16* qh = q + (t * H + h) * dqk;
  for (int64_t c = lane; c < dqk; c += 32) qs[c] = __bfloat162float(qh[c]) * scale;
  for (int64_t c = lane; c < dv; c += 32) acc[c] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int32_t* idx = selected + t * width;
  for (int64_t i0 = 0; i0 < width; i0 += 32) {
    const int32_t mine = i0 + lane < width ? idx[i0 + lane] : -1;
    const int n = static_cast<int>(width - i0 < 32 ? width - i0 : 32);
    for (int j = 0; j < n; ++j) {
      const int32_t sel = __shfl_sync(kFull, mine, j);
      if (sel < 0) continue;  // warp-uniform
      const __nv_bfloat16* k = kv + (static_cast<int64_t>(sel) * KH + h % KH) * stride;
      float dot = 0.0f;
      for (int64_t c = lane; c < dqk; c += 32) dot += qs[c] * __bfloat162float(k[c]);
      dot = warp_sum(dot);
      const float m_new = fmaxf(m, dot);
      const float correction = expf(m - m_new);  // 0 on the first slot (m = -inf)
      const float p = expf(dot - m_new);
      l = l * correction + p;
      const __nv_bfloat16* v = k + dqk;
      for (int64_t c = lane; c < dv; c += 32) acc[c] = acc[c] * correction + p * __bfloat162float(v[c]);
      m = m_new;
    }
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // no selected slot: zeros, as on the CPU
  __nv_bfloat16* o = out + (t * H + h) * dv;
  for (int64_t c = lane; c < dv; c += 32) o[c] = __float2bfloat16(acc[c] * inv);
}

__global__ void __launch_bounds__(kMaxWarps * 32)
    sparse_attention_backward_kernel(const __nv_bfloat16* __restrict__ q,
                                     const __nv_bfloat16* __restrict__ kv,
                                     const int32_t* __restrict__ selected,
                                     const __nv_bfloat16* __restrict__ dout, __nv_bfloat16* __restrict__ dq,
                                     float* __restrict__ dkv, int64_t H, int64_t KH, int64_t dqk, int64_t dv,
                                     int64_t width, float scale, int warps) {
  wait_for_earlier_kernels();
  extern __shared__ float smem[];
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int64_t groups = (H + warps - 1) / warps;
  const int64_t t = blockIdx.x / groups;
  const int64_t h = (blockIdx.x % groups) * warps + warp;
  if (h >= H) return;
  const int64_t stride = dqk + dv;
  float* qs = smem + warp * (2 * dqk + dv);  // [dqk] the query (not scaled)
  float* go = qs + dqk;                      // [dv] dout
  float* dqs = go + dv;                      // [dqk] dq accumulator
  const __nv_bfloat16* qh = q + (t * H + h) * dqk;
  const __nv_bfloat16* gh = dout + (t * H + h) * dv;
  for (int64_t c = lane; c < dqk; c += 32) {
    qs[c] = __bfloat162float(qh[c]);
    dqs[c] = 0.0f;
  }
  for (int64_t c = lane; c < dv; c += 32) go[c] = __bfloat162float(gh[c]);
  const int32_t* idx = selected + t * width;

  // Pass 1: softmax statistics and sum_s p_s dp_s, online.
  float m = -INFINITY, l = 0.0f, weighted = 0.0f;
  for (int64_t i0 = 0; i0 < width; i0 += 32) {
    const int32_t mine = i0 + lane < width ? idx[i0 + lane] : -1;
    const int n = static_cast<int>(width - i0 < 32 ? width - i0 : 32);
    for (int j = 0; j < n; ++j) {
      const int32_t sel = __shfl_sync(kFull, mine, j);
      if (sel < 0) continue;
      const __nv_bfloat16* k = kv + (static_cast<int64_t>(sel) * KH + h % KH) * stride;
      float dot = 0.0f, dp = 0.0f;
      for (int64_t c = lane; c < dqk; c += 32) dot += qs[c] * __bfloat162float(k[c]);
      for (int64_t c = lane; c < dv; c += 32) dp += go[c] * __bfloat162float(k[dqk + c]);
      for (int offset = 16; offset > 0; offset /= 2) {
        dot += __shfl_xor_sync(kFull, dot, offset);
        dp += __shfl_xor_sync(kFull, dp, offset);
      }
      dot *= scale;
      const float m_new = fmaxf(m, dot);
      const float correction = expf(m - m_new);
      const float p = expf(dot - m_new);
      l = l * correction + p;
      weighted = weighted * correction + p * dp;
      m = m_new;
    }
  }
  const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
  weighted *= inv_l;

  // Pass 2: gradients.
  for (int64_t i0 = 0; i0 < width; i0 += 32) {
    const int32_t mine = i0 + lane < width ? idx[i0 + lane] : -1;
    const int n = static_cast<int>(width - i0 < 32 ? width - i0 : 32);
    for (int j = 0; j < n; ++j) {
      const int32_t sel = __shfl_sync(kFull, mine, j);
      if (sel < 0) continue;
      const int64_t row = (static_cast<int64_t>(sel) * KH + h % KH) * stride;
      const __nv_bfloat16* k = kv + row;
      float dot = 0.0f, dp = 0.0f;
      for (int64_t c = lane; c < dqk; c += 32) dot += qs[c] * __bfloat162float(k[c]);
      for (int64_t c = lane; c < dv; c += 32) dp += go[c] * __bfloat162float(k[dqk + c]);
      for (int offset = 16; offset > 0; offset /= 2) {
        dot += __shfl_xor_sync(kFull, dot, offset);
        dp += __shfl_xor_sync(kFull, dp, offset);
      }
      const float p = expf(dot * scale - m) * inv_l;
      const float ds = p * (dp - weighted) * scale;
      float* dk = dkv + row;
      for (int64_t c = lane; c < dqk; c += 32) {
        dqs[c] += ds * __bfloat162float(k[c]);
        atomicAdd(dk + c, ds * qs[c]);
      }
      for (int64_t c = lane; c < dv; c += 32) atomicAdd(dk + dqk + c, p * go[c]);
    }
  }
  __nv_bfloat16* dqh = dq + (t * H + h) * dqk;
  for (int64_t c = lane; c < dqk; c += 32) dqh[c] = __float2bfloat16(dqs[c]);
}

struct Launch {
  unsigned blocks;
  int warps;
  size_t shared_bytes;
};

// Warps per CTA and dynamic shared memory for `floats_per_warp` fp32 values per warp; raises the
// kernel's shared-memory limit when needed and fails (naming the widths) when even one warp does
// not fit.
template <class Kernel>
Launch plan_launch(Kernel kernel, const cpu::SparseAttentionShape& s, int64_t floats_per_warp,
                   const char* name) {
  check(s.tokens >= 0 && s.heads > 0 && s.qk_dim > 0 && s.v_dim > 0 && s.width >= 0, name,
        ": expected tokens >= 0, heads, qk_dim, v_dim > 0 and width >= 0, got tokens ", s.tokens, ", heads ",
        s.heads, ", qk_dim ", s.qk_dim, ", v_dim ", s.v_dim, ", width ", s.width);
  check(s.key_heads() > 0 && s.heads % s.key_heads() == 0, name, ": ", s.heads, " query heads cannot share ",
        s.key_heads(), " key heads");
  const size_t per_warp = static_cast<size_t>(floats_per_warp) * sizeof(float);
  int warps = kMaxWarps;
  while (warps > 1 && warps * per_warp > (48u << 10)) --warps;
  warps = static_cast<int>(std::min<int64_t>(warps, s.heads));
  const size_t bytes = warps * per_warp;
  allow_shared_memory(kernel, bytes, name, ": qk_dim ", s.qk_dim, " and v_dim ", s.v_dim, " (", warps,
                      " warps)");
  const int64_t blocks = s.tokens * ((s.heads + warps - 1) / warps);
  check(blocks < (int64_t{1} << 31), name, ": ", s.tokens, " tokens x ", s.heads, " heads is too many CTAs (",
        blocks, ") for one launch");
  return {static_cast<unsigned>(blocks), warps, bytes};
}

}  // namespace

void sparse_attention_forward(const cpu::SparseAttentionShape& s, const __nv_bfloat16* q,
                              const __nv_bfloat16* kv, const int32_t* selected, __nv_bfloat16* out,
                              cudaStream_t stream) {
  const Launch launch =
      plan_launch(sparse_attention_forward_kernel, s, s.qk_dim + s.v_dim, "sparse_attention_forward");
  if (launch.blocks == 0) return;
  launch_kernel(sparse_attention_forward_kernel, launch.blocks, launch.warps * 32, launch.shared_bytes,
                stream, q, kv, selected, out, s.heads, s.key_heads(), s.qk_dim, s.v_dim, s.width,
                static_cast<float>(s.scale), launch.warps);
  SPINDLE_LAUNCHED("sparse_attention_forward_kernel");
}

void sparse_attention_backward(const cpu::SparseAttentionShape& s, const __nv_bfloat16* q,
                               const __nv_bfloat16* kv, const int32_t* selected, const __nv_bfloat16* dout,
                               __nv_bfloat16* dq, float* dkv, cudaStream_t stream) {
  const Launch launch =
      plan_launch(sparse_attention_backward_kernel, s, 2 * s.qk_dim + s.v_dim, "sparse_attention_backward");
  if (launch.blocks == 0) return;
  launch_kernel(sparse_attention_backward_kernel, launch.blocks, launch.warps * 32, launch.shared_bytes,
                stream, q, kv, selected, dout, dq, dkv, s.heads, s.key_heads(), s.qk_dim, s.v_dim, s.width,
                static_cast<float>(s.scale), launch.warps);
  SPINDLE_LAUNCHED("sparse_attention_backward_kernel");
}

}  // namespace spindle::cuda
