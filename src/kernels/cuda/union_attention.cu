// The sparse attention over a chunk's union, version 1; see union_attention.h.
#include <algorithm>
#include <cmath>
#include <cub/device/device_scan.cuh>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/log2_domain.h"
#include "kernels/cuda/union_attention.h"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

__global__ void mark_selected_kernel(const int32_t* selected, int64_t n, int64_t span, int32_t* flags) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int32_t t = selected[i];
  if (t >= 0 && t < span) flags[t] = 1;  // racing writers all write 1
}

__global__ void write_keys_kernel(const int32_t* flags, const int32_t* slots, int64_t span, int32_t* keys) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t < span && flags[t]) keys[slots[t]] = static_cast<int32_t>(t);
}

__global__ void write_masks_kernel(const int32_t* selected, int64_t queries, int64_t width, int64_t span,
                                   const int32_t* slots, int64_t words, uint32_t* masks) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= queries * width) return;
  const int32_t t = selected[i];
  if (t < 0 || t >= span) return;
  const int32_t j = slots[t];
  atomicOr(masks + (i / width) * words + j / 32, 1u << (j % 32));
}

// One warp per score row (head h, query b0 + r of the block): the row's maximum and sum over its
// selected keys (scores in the log2 domain), then P = exp2(s - m) / l as bf16 and the log-sum-exp.
// scores, probs: [heads][block][u].
__global__ void union_softmax_kernel(const float* scores, const uint32_t* masks, int64_t words, int64_t b0,
                                     int64_t block, int64_t heads, int64_t u, float scale2,
                                     __nv_bfloat16* probs, float* lse) {
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= heads * block) return;
  const int64_t h = row / block, query = b0 + row % block;
  const float* s = scores + row * u;
  const uint32_t* mask = masks + query * words;
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = lane; j < u; j += 32) {
    if (!((mask[j / 32] >> (j % 32)) & 1u)) continue;
    const float x = s[j] * scale2;
    if (x > m) {
      l = l * exp2_ftz(m - x) + 1.0f;
      m = x;
    } else {
      l += exp2_ftz(x - m);
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float mo = __shfl_xor_sync(0xffffffffu, m, offset), lo = __shfl_xor_sync(0xffffffffu, l, offset);
    const float mn = fmaxf(m, mo);
    l = (mn == -INFINITY) ? 0.0f : l * exp2_ftz(m - mn) + lo * exp2_ftz(mo - mn);
    m = mn;
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  __nv_bfloat16* p = probs + row * u;
  for (int64_t j = lane; j < u; j += 32) {
    const bool selected = (mask[j / 32] >> (j % 32)) & 1u;
    p[j] = __float2bfloat16(selected ? exp2_ftz(s[j] * scale2 - m) * inv : 0.0f);
  }
  if (lane == 0) lse[query * heads + h] = l > 0.0f ? (m + log2f(l)) / kLog2e : INFINITY;
}

// One warp per (query, head): D = dout . out over the values.
__global__ void output_dot_kernel(const __nv_bfloat16* dout, const __nv_bfloat16* out, int64_t rows,
                                  int64_t dv, float* dot) {
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float sum = 0.0f;
  for (int64_t i = lane; i < dv; i += 32)
    sum += __bfloat162float(dout[row * dv + i]) * __bfloat162float(out[row * dv + i]);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) dot[row] = sum;
}

// Per score of the block: P = exp2(s scale2 - lse2) where selected (else 0), dS = P (dP - D) scale,
// both bf16 ([heads][block][u]).
__global__ void union_softmax_backward_kernel(const float* scores, const float* dprobs, const uint32_t* masks,
                                              int64_t words, int64_t b0, int64_t block, int64_t heads,
                                              int64_t u, float scale2, float scale, const float* lse,
                                              const float* dot, __nv_bfloat16* probs,
                                              __nv_bfloat16* dscores) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= heads * block * u) return;
  const int64_t row = i / u, j = i % u, h = row / block, query = b0 + row % block;
  const bool selected = (masks[query * words + j / 32] >> (j % 32)) & 1u;
  const float l = lse[query * heads + h];
  const float p = selected && l != INFINITY ? exp2_ftz(scores[i] * scale2 - l * kLog2e) : 0.0f;
  probs[i] = __float2bfloat16(p);
  dscores[i] = __float2bfloat16(p * (dprobs[i] - dot[query * heads + h]) * scale);
}

__global__ void gather_rows_kernel(const __nv_bfloat16* latent, int64_t stride, const int32_t* keys,
                                   int64_t n, int64_t cols, __nv_bfloat16* rows) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n * cols) rows[i] = latent[keys[i / cols] * stride + i % cols];
}

__global__ void add_rows_kernel(const float* d_rows, const int32_t* keys, int64_t n, int64_t cols,
                                float* d_latent, int64_t stride) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n * cols) d_latent[keys[i / cols] * stride + i % cols] += d_rows[i];
}

__global__ void fill_kernel(float* x, int64_t n, float value) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = value;
}

}  // namespace

ChunkUnion chunk_union(const UnionAttentionShape& s, const int32_t* selected, cudaStream_t stream) {
  check(s.span > 0 && s.span <= (int64_t{1} << 31), "chunk_union: a span of ", s.span, " tokens");
  DeviceBuffer<int32_t> flags(static_cast<size_t>(s.span), MemoryCategory::Workspace),
      slots(static_cast<size_t>(s.span), MemoryCategory::Workspace);
  SPINDLE_CUDA(cudaMemsetAsync(flags.data(), 0, flags.size() * sizeof(int32_t), stream));
  const int64_t entries = s.queries * s.width;
  if (entries > 0) {
    mark_selected_kernel<<<blocks_for(entries), kThreads, 0, stream>>>(selected, entries, s.span,
                                                                       flags.data());
    SPINDLE_LAUNCHED("mark_selected_kernel");
  }
  size_t scratch_bytes = 0;
  const int span = static_cast<int>(s.span);
  SPINDLE_CUDA(
      cub::DeviceScan::ExclusiveSum(nullptr, scratch_bytes, flags.data(), slots.data(), span, stream));
  DeviceBuffer<unsigned char> scratch(std::max<size_t>(scratch_bytes, 1), MemoryCategory::Workspace);
  SPINDLE_CUDA(
      cub::DeviceScan::ExclusiveSum(scratch.data(), scratch_bytes, flags.data(), slots.data(), span, stream));
  int32_t last[2] = {0, 0};  // the last token's slot and flag
  SPINDLE_CUDA(
      cudaMemcpyAsync(&last[0], slots.data() + s.span - 1, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  SPINDLE_CUDA(
      cudaMemcpyAsync(&last[1], flags.data() + s.span - 1, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  SPINDLE_CUDA(cudaStreamSynchronize(stream));
  ChunkUnion u;
  u.count = last[0] + last[1];
  u.words = (u.count + 31) / 32;
  u.keys =
      DeviceBuffer<int32_t>(static_cast<size_t>(std::max<int64_t>(u.count, 1)), MemoryCategory::Workspace);
  u.masks = DeviceBuffer<uint32_t>(static_cast<size_t>(std::max<int64_t>(s.queries * u.words, 1)),
                                   MemoryCategory::Workspace);
  if (u.count == 0) return u;
  write_keys_kernel<<<blocks_for(s.span), kThreads, 0, stream>>>(flags.data(), slots.data(), s.span,
                                                                 u.keys.data());
  SPINDLE_LAUNCHED("write_keys_kernel");
  SPINDLE_CUDA(cudaMemsetAsync(u.masks.data(), 0, u.masks.size() * sizeof(uint32_t), stream));
  write_masks_kernel<<<blocks_for(entries), kThreads, 0, stream>>>(selected, s.queries, s.width, s.span,
                                                                   slots.data(), u.words, u.masks.data());
  SPINDLE_LAUNCHED("write_masks_kernel");
  return u;
}

void gather_union_rows(const __nv_bfloat16* latent, int64_t stride, const ChunkUnion& u, int64_t cols,
                       __nv_bfloat16* rows, cudaStream_t stream) {
  if (u.count == 0) return;
  gather_rows_kernel<<<blocks_for(u.count * cols), kThreads, 0, stream>>>(latent, stride, u.keys.data(),
                                                                          u.count, cols, rows);
  SPINDLE_LAUNCHED("gather_rows_kernel");
}

void add_union_rows(const float* d_rows, const ChunkUnion& u, int64_t cols, float* d_latent, int64_t stride,
                    cudaStream_t stream) {
  if (u.count == 0) return;
  add_rows_kernel<<<blocks_for(u.count * cols), kThreads, 0, stream>>>(d_rows, u.keys.data(), u.count, cols,
                                                                       d_latent, stride);
  SPINDLE_LAUNCHED("add_rows_kernel");
}

void union_attention_forward(Gemm& gemm, const UnionAttentionShape& s, const ChunkUnion& u,
                             const __nv_bfloat16* q, const __nv_bfloat16* kv, __nv_bfloat16* out, float* lse,
                             int64_t block, cudaStream_t stream) {
  check(block > 0, "union attention: a block of ", block, " queries");
  const int64_t H = s.heads, dqk = s.qk_dim, dv = s.v_dim, n = u.count, kv_row = H * (dqk + dv);
  if (s.queries == 0) return;
  if (n == 0) {  // nothing selected: zero outputs, log-sum-exp +inf (as the CPU's)
    SPINDLE_CUDA(
        cudaMemsetAsync(out, 0, static_cast<size_t>(s.queries * H * dv) * sizeof(__nv_bfloat16), stream));
    fill_kernel<<<blocks_for(s.queries * H), kThreads, 0, stream>>>(lse, s.queries * H, INFINITY);
    SPINDLE_LAUNCHED("fill_kernel");
    return;
  }
  const int64_t rows = std::min(block, s.queries);
  DeviceBuffer<float> scores(static_cast<size_t>(H * rows * n), MemoryCategory::Workspace);
  DeviceBuffer<__nv_bfloat16> probs(static_cast<size_t>(H * rows * n), MemoryCategory::Workspace);
  const float scale2 = s.scale * kLog2e;
  for (int64_t b0 = 0; b0 < s.queries; b0 += block) {
    const int64_t B = std::min(block, s.queries - b0);
    // S_h^T [u, B] = K_h [u, dqk] Q_h^T, every head in one launch.
    gemm.matmul_batched(true, false, n, B, dqk, kv, kv_row, dqk + dv, q + b0 * H * dqk, H * dqk, dqk,
                        scores.data(), CUDA_R_32F, n, B * n, H, 1.0f, 0.0f, stream);
    union_softmax_kernel<<<blocks_for(H * B * 32), kThreads, 0, stream>>>(
        scores.data(), u.masks.data(), u.words, b0, B, H, n, scale2, probs.data(), lse);
    SPINDLE_LAUNCHED("union_softmax_kernel");
    // O_h^T [dv, B] = V_h^T [dv, u] P_h^T.
    gemm.matmul_batched(false, false, dv, B, n, kv + dqk, kv_row, dqk + dv, probs.data(), n, B * n,
                        out + b0 * H * dv, CUDA_R_16BF, H * dv, dv, H, 1.0f, 0.0f, stream);
  }
}

void union_attention_backward(Gemm& gemm, const UnionAttentionShape& s, const ChunkUnion& u,
                              const __nv_bfloat16* q, const __nv_bfloat16* kv, const __nv_bfloat16* out,
                              const float* lse, const __nv_bfloat16* dout, __nv_bfloat16* dq, float* dkv,
                              int64_t block, cudaStream_t stream) {
  check(block > 0, "union attention backward: a block of ", block, " queries");
  const int64_t H = s.heads, dqk = s.qk_dim, dv = s.v_dim, n = u.count, kv_row = H * (dqk + dv);
  if (s.queries == 0) return;
  if (n == 0) {  // nothing selected: no gradient reaches q
    SPINDLE_CUDA(
        cudaMemsetAsync(dq, 0, static_cast<size_t>(s.queries * H * dqk) * sizeof(__nv_bfloat16), stream));
    return;
  }
  DeviceBuffer<float> dot(static_cast<size_t>(s.queries * H), MemoryCategory::Workspace);
  output_dot_kernel<<<blocks_for(s.queries * H * 32), kThreads, 0, stream>>>(dout, out, s.queries * H, dv,
                                                                             dot.data());
  SPINDLE_LAUNCHED("output_dot_kernel");
  const int64_t rows = std::min(block, s.queries), cells = H * rows * n;
  DeviceBuffer<float> scores(static_cast<size_t>(cells), MemoryCategory::Workspace),
      dprobs(static_cast<size_t>(cells), MemoryCategory::Workspace);
  DeviceBuffer<__nv_bfloat16> probs(static_cast<size_t>(cells), MemoryCategory::Workspace),
      dscores(static_cast<size_t>(cells), MemoryCategory::Workspace);
  const float scale2 = s.scale * kLog2e;
  for (int64_t b0 = 0; b0 < s.queries; b0 += block) {
    const int64_t B = std::min(block, s.queries - b0);
    const float accumulate = b0 == 0 ? 0.0f : 1.0f;  // dkv: written by the first block, then summed
    gemm.matmul_batched(true, false, n, B, dqk, kv, kv_row, dqk + dv, q + b0 * H * dqk, H * dqk, dqk,
                        scores.data(), CUDA_R_32F, n, B * n, H, 1.0f, 0.0f, stream);
    // dP_h^T [u, B] = V_h [u, dv] dO_h^T.
    gemm.matmul_batched(true, false, n, B, dv, kv + dqk, kv_row, dqk + dv, dout + b0 * H * dv, H * dv, dv,
                        dprobs.data(), CUDA_R_32F, n, B * n, H, 1.0f, 0.0f, stream);
    union_softmax_backward_kernel<<<blocks_for(H * B * n), kThreads, 0, stream>>>(
        scores.data(), dprobs.data(), u.masks.data(), u.words, b0, B, H, n, scale2, s.scale, lse, dot.data(),
        probs.data(), dscores.data());
    SPINDLE_LAUNCHED("union_softmax_backward_kernel");
    // dV_h^T [dv, u] (+)= dO_h^T [dv, B] P_h; dK_h^T [dqk, u] (+)= Q_h^T dS_h.
    gemm.matmul_batched(false, true, dv, n, B, dout + b0 * H * dv, H * dv, dv, probs.data(), n, B * n,
                        dkv + dqk, CUDA_R_32F, kv_row, dqk + dv, H, 1.0f, accumulate, stream);
    gemm.matmul_batched(false, true, dqk, n, B, q + b0 * H * dqk, H * dqk, dqk, dscores.data(), n, B * n, dkv,
                        CUDA_R_32F, kv_row, dqk + dv, H, 1.0f, accumulate, stream);
    // dQ_h^T [dqk, B] = K_h^T [dqk, u] dS_h^T.
    gemm.matmul_batched(false, false, dqk, B, n, kv, kv_row, dqk + dv, dscores.data(), n, B * n,
                        dq + b0 * H * dqk, CUDA_R_16BF, H * dqk, dqk, H, 1.0f, 0.0f, stream);
  }
}

}  // namespace spindle::cuda
