// MLA's sparse attention over a chunk's union and tails, version 1; see union_attention.h.
#include <algorithm>
#include <cmath>
#include <cub/device/device_scan.cuh>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/convert.h"
#include "kernels/cuda/log2_domain.h"
#include "kernels/cuda/union_attention.h"
#include "kernels/cuda/union_attention_hopper.h"

namespace spindle::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kMaxTail = 32;  // a tail's slots, one lane each
// The fused forward's queries a launch: their tails' keys and values expanded at once (64 MB).
constexpr int64_t kFusedGroup = 4096;
static_assert(kFusedGroup % 64 == 0, "groups of whole blocks of the fused kernels' queries");

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

__global__ void mark_selected_kernel(const int32_t* selected, int64_t queries, int64_t width, int64_t pooled,
                                     int64_t span, int32_t* flags) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= queries * pooled) return;
  const int32_t t = selected[i / pooled * width + i % pooled];
  if (t >= 0 && t < span) flags[t] = 1;  // racing writers all write 1
}

__global__ void write_keys_kernel(const int32_t* flags, const int32_t* slots, int64_t span, int32_t* keys) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t < span && flags[t]) keys[slots[t]] = static_cast<int32_t>(t);
}

__global__ void write_masks_kernel(const int32_t* selected, int64_t queries, int64_t width, int64_t pooled,
                                   int64_t span, const int32_t* slots, int64_t words, uint32_t* masks) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= queries * pooled) return;
  const int64_t query = i / pooled;
  const int32_t t = selected[query * width + i % pooled];
  if (t < 0 || t >= span) return;
  const int32_t j = slots[t];
  atomicOr(masks + query * words + j / 32, 1u << (j % 32));
}

// What the softmax kernels know of a block: its queries b0 .. b0 + block of the chunk, the union's
// scores [heads][block][u] and the tail's [heads][block][rows] (the block's latent rows from `low`).
struct BlockScores {
  const uint32_t* masks;
  int64_t words, u;
  const int32_t* selected;
  int64_t width, pooled, b0, block, heads, rows, low;
};

// Lane j's tail slot of query `query` (chunk-relative) as an index into the block's rows, or -1.
__device__ __forceinline__ int64_t tail_row(const BlockScores& b, int64_t query, int lane) {
  if (lane >= b.width - b.pooled) return -1;
  const int32_t t = b.selected[query * b.width + b.pooled + lane];
  if (t < 0) return -1;
  const int64_t r = t - b.low;
  if (r < 0 || r >= b.rows) __trap();  // a tail token outside its query's reach: not the indexer's layout
  return r;
}

// One warp per score row (head h, query b0 + r): the row's maximum and sum over its selected keys
// of both segments (log2 domain), then P = exp2(s - m) / l as bf16 (zero where not selected) and
// the log-sum-exp.
__global__ void union_softmax_kernel(BlockScores b, const float* scores, const float* tail_scores,
                                     float scale2, bf16* probs, bf16* tail_probs, float* lse) {
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= b.heads * b.block) return;
  const int64_t h = row / b.block, query = b.b0 + row % b.block;
  const float* s = scores + row * b.u;
  const float* ts = tail_scores + row * b.rows;
  const uint32_t* mask = b.masks + query * b.words;
  const int64_t mine = tail_row(b, query, lane);
  float m = -INFINITY, l = 0.0f;
  const auto add = [&](float x) {
    if (x > m) {
      l = l * exp2_ftz(m - x) + 1.0f;
      m = x;
    } else {
      l += exp2_ftz(x - m);
    }
  };
  for (int64_t j = lane; j < b.u; j += 32)
    if ((mask[j / 32] >> (j % 32)) & 1u) add(s[j] * scale2);
  if (mine >= 0) add(ts[mine] * scale2);
  for (int offset = 16; offset > 0; offset /= 2) {
    const float mo = __shfl_xor_sync(0xffffffffu, m, offset), lo = __shfl_xor_sync(0xffffffffu, l, offset);
    const float mn = fmaxf(m, mo);
    l = mn == -INFINITY ? 0.0f : l * exp2_ftz(m - mn) + lo * exp2_ftz(mo - mn);
    m = mn;
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  bf16* p = probs + row * b.u;
  for (int64_t j = lane; j < b.u; j += 32) {
    const bool selected = (mask[j / 32] >> (j % 32)) & 1u;
    p[j] = __float2bfloat16(selected ? exp2_ftz(s[j] * scale2 - m) * inv : 0.0f);
  }
  bf16* tp = tail_probs + row * b.rows;
  for (int64_t j = lane; j < b.rows; j += 32) tp[j] = __float2bfloat16(0.0f);
  __syncwarp();
  if (mine >= 0) tp[mine] = __float2bfloat16(exp2_ftz(ts[mine] * scale2 - m) * inv);
  if (lane == 0) lse[query * b.heads + h] = l > 0.0f ? (m + log2f(l)) / kLog2e : INFINITY;
}

// One warp per (query, head): D = dout . out over the values.
__global__ void output_dot_kernel(const bf16* dout, const bf16* out, int64_t rows, int64_t dv, float* dot) {
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float sum = 0.0f;
  for (int64_t i = lane; i < dv; i += 32)
    sum += __bfloat162float(dout[row * dv + i]) * __bfloat162float(out[row * dv + i]);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) dot[row] = sum;
}

// The union segment, per score: P = exp2(s scale2 - lse2) where selected (else 0), dS = P (dP - D)
// scale, both bf16.
__global__ void union_softmax_backward_kernel(BlockScores b, const float* scores, const float* dprobs,
                                              float scale2, float scale, const float* lse, const float* dot,
                                              bf16* probs, bf16* dscores) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= b.heads * b.block * b.u) return;
  const int64_t row = i / b.u, j = i % b.u, h = row / b.block, query = b.b0 + row % b.block;
  const bool selected = (b.masks[query * b.words + j / 32] >> (j % 32)) & 1u;
  const float l = lse[query * b.heads + h];
  const float p = selected && l != INFINITY ? exp2_ftz(scores[i] * scale2 - l * kLog2e) : 0.0f;
  probs[i] = __float2bfloat16(p);
  dscores[i] = __float2bfloat16(p * (dprobs[i] - dot[query * b.heads + h]) * scale);
}

// The tail segment, one warp per score row: the same on the row's tail slots, zero elsewhere.
__global__ void tail_softmax_backward_kernel(BlockScores b, const float* scores, const float* dprobs,
                                             float scale2, float scale, const float* lse, const float* dot,
                                             bf16* probs, bf16* dscores) {
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= b.heads * b.block) return;
  const int64_t h = row / b.block, query = b.b0 + row % b.block;
  const int64_t mine = tail_row(b, query, lane);
  for (int64_t j = lane; j < b.rows; j += 32) {
    probs[row * b.rows + j] = __float2bfloat16(0.0f);
    dscores[row * b.rows + j] = __float2bfloat16(0.0f);
  }
  __syncwarp();
  const float l = lse[query * b.heads + h];
  if (mine < 0 || l == INFINITY) return;
  const int64_t i = row * b.rows + mine;
  const float p = exp2_ftz(scores[i] * scale2 - l * kLog2e);
  probs[i] = __float2bfloat16(p);
  dscores[i] = __float2bfloat16(p * (dprobs[i] - dot[query * b.heads + h]) * scale);
}

__global__ void gather_rows_kernel(const bf16* latent, int64_t stride, const int32_t* keys, int64_t n,
                                   int64_t cols, bf16* rows) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n * cols) rows[i] = latent[keys[i / cols] * stride + i % cols];
}

// d_latent[row(r)] += d_rows[r]: row(r) = keys[r] where keys are given (the union's tokens, distinct),
// else low + r (the block's consecutive rows).
__global__ void add_rows_kernel(const float* d_rows, const int32_t* keys, int64_t low, int64_t n,
                                int64_t cols, float* d_latent, int64_t stride) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * cols) return;
  const int64_t r = i / cols, row = keys != nullptr ? keys[r] : low + r;
  d_latent[row * stride + i % cols] += d_rows[i];
}

// Keys and values [n, heads (qk + v)] of n latent rows (`stride` apart) by kv_b_proj.
void expand(Gemm& gemm, const UnionLatent& lat, const bf16* rows, int64_t stride, int64_t n, int64_t kv_row,
            bf16* kv, cudaStream_t stream) {
  gemm.matmul(true, false, kv_row, n, lat.rank, lat.kv_b_proj, lat.rank, rows, stride, kv, CUDA_R_16BF,
              kv_row, 1.0f, 0.0f, stream);
}

// The gradient [n, heads (qk + v)] of n rows' keys and values back through kv_b_proj: the rows'
// latent gradient d_rows [n, rank] (written) and kv_b_proj's (accumulated).
void expand_backward(Gemm& gemm, const UnionLatent& lat, const bf16* rows, int64_t stride, int64_t n,
                     int64_t kv_row, const bf16* dkv, float* d_rows, float* d_kv_b_proj, cudaStream_t stream) {
  gemm.linear_backward_input(dkv, lat.kv_b_proj, d_rows, n, lat.rank, kv_row, 0.0f, stream);
  gemm.matmul(false, true, lat.rank, kv_row, n, rows, stride, dkv, kv_row, d_kv_b_proj, CUDA_R_32F, lat.rank,
              1.0f, 1.0f, stream);
}
void expand_backward(Gemm& gemm, const UnionLatent& lat, const bf16* rows, int64_t stride, int64_t n,
                     int64_t kv_row, const float* dkv, float* d_rows, float* d_kv_b_proj, cudaStream_t stream) {
  DeviceBuffer<bf16> dkv16(static_cast<size_t>(n * kv_row), MemoryCategory::Workspace);
  f32_to_bf16(dkv, dkv16.data(), n * kv_row, stream);
  expand_backward(gemm, lat, rows, stride, n, kv_row, dkv16.data(), d_rows, d_kv_b_proj, stream);
}

// A block's place: its queries' tails reach back `tail` tokens, so its latent rows are low .. high.
struct Block {
  int64_t b0, rows, low;
};
Block block_at(const UnionAttentionShape& s, int64_t b0, int64_t B) {
  const int64_t low = std::max<int64_t>(0, s.first + b0 - s.tail()), high = s.first + b0 + B;
  return {b0, high - low, low};
}

// The most tail rows of a group of the fused kernels' queries.
int64_t most_fused_tail_rows(const UnionAttentionShape& s, int64_t group) {
  int64_t most = 0;
  for (int64_t g0 = 0; g0 < s.queries; g0 += group) {
    const TailRows t = union_fused_tail_rows(s, g0, std::min(s.queries, g0 + group));
    most = std::max(most, t.high - t.low);
  }
  return most;
}

BlockScores block_scores(const UnionAttentionShape& s, const ChunkUnion& u, const int32_t* selected,
                         const Block& k, int64_t B) {
  return {u.masks.data(), u.words, u.count, selected, s.width, s.pooled, k.b0, B, s.heads, k.rows, k.low};
}

}  // namespace

ChunkUnion chunk_union(const UnionAttentionShape& s, const int32_t* selected, cudaStream_t stream) {
  const int64_t span = s.span();
  check(span > 0 && span <= (int64_t{1} << 31), "chunk_union: a span of ", span, " tokens");
  check(s.pooled >= 0 && s.tail() >= 0 && s.tail() <= kMaxTail, "chunk_union: ", s.pooled,
        " pooled slots of ", s.width, " (a tail of at most ", kMaxTail, ")");
  DeviceBuffer<int32_t> flags(static_cast<size_t>(span), MemoryCategory::Workspace),
      slots(static_cast<size_t>(span), MemoryCategory::Workspace);
  SPINDLE_CUDA(cudaMemsetAsync(flags.data(), 0, flags.size() * sizeof(int32_t), stream));
  const int64_t entries = s.queries * s.pooled;
  if (entries > 0) {
    mark_selected_kernel<<<blocks_for(entries), kThreads, 0, stream>>>(selected, s.queries, s.width, s.pooled,
                                                                       span, flags.data());
    SPINDLE_LAUNCHED("mark_selected_kernel");
  }
  size_t scratch_bytes = 0;
  SPINDLE_CUDA(cub::DeviceScan::ExclusiveSum(nullptr, scratch_bytes, flags.data(), slots.data(),
                                             static_cast<int>(span), stream));
  DeviceBuffer<unsigned char> scratch(std::max<size_t>(scratch_bytes, 1), MemoryCategory::Workspace);
  SPINDLE_CUDA(cub::DeviceScan::ExclusiveSum(scratch.data(), scratch_bytes, flags.data(), slots.data(),
                                             static_cast<int>(span), stream));
  int32_t last[2] = {0, 0};  // the last token's slot and flag
  SPINDLE_CUDA(
      cudaMemcpyAsync(&last[0], slots.data() + span - 1, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  SPINDLE_CUDA(
      cudaMemcpyAsync(&last[1], flags.data() + span - 1, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  SPINDLE_CUDA(cudaStreamSynchronize(stream));
  ChunkUnion u;
  u.count = last[0] + last[1];
  u.words = (u.count + 31) / 32;
  u.keys =
      DeviceBuffer<int32_t>(static_cast<size_t>(std::max<int64_t>(u.count, 1)), MemoryCategory::Workspace);
  u.masks = DeviceBuffer<uint32_t>(static_cast<size_t>(std::max<int64_t>(s.queries * u.words, 1)),
                                   MemoryCategory::Workspace);
  if (u.count == 0) return u;
  write_keys_kernel<<<blocks_for(span), kThreads, 0, stream>>>(flags.data(), slots.data(), span,
                                                               u.keys.data());
  SPINDLE_LAUNCHED("write_keys_kernel");
  SPINDLE_CUDA(cudaMemsetAsync(u.masks.data(), 0, u.masks.size() * sizeof(uint32_t), stream));
  write_masks_kernel<<<blocks_for(entries), kThreads, 0, stream>>>(
      selected, s.queries, s.width, s.pooled, span, slots.data(), u.words, u.masks.data());
  SPINDLE_LAUNCHED("write_masks_kernel");
  return u;
}

void union_attention_forward(Gemm& gemm, const UnionAttentionShape& s, const ChunkUnion& u,
                             const UnionLatent& lat, const int32_t* selected, const bf16* q, bf16* out,
                             float* lse, int64_t block, cudaStream_t stream) {
  check(block > 0, "union attention: a block of ", block, " queries");
  if (s.queries == 0) return;
  const int64_t H = s.heads, dqk = s.qk_dim, dv = s.v_dim, n = u.count, kv_row = H * (dqk + dv);
  const int64_t most = std::min(block, s.queries), most_rows = most + s.tail();
  // The union's keys and values, once for the chunk.
  DeviceBuffer<bf16> union_rows(static_cast<size_t>(std::max<int64_t>(n, 1) * lat.rank),
                                MemoryCategory::Workspace),
      union_kv(static_cast<size_t>(std::max<int64_t>(n, 1) * kv_row), MemoryCategory::Workspace);
  if (n > 0) {
    gather_rows_kernel<<<blocks_for(n * lat.rank), kThreads, 0, stream>>>(
        lat.latent, lat.stride, u.keys.data(), n, lat.rank, union_rows.data());
    SPINDLE_LAUNCHED("gather_rows_kernel");
    expand(gemm, lat, union_rows.data(), lat.rank, n, kv_row, union_kv.data(), stream);
  }
  if (union_fused_unsupported(s).empty()) {
    // Version 2: one kernel over the union and the tails, the tails' rows expanded a group at a time.
    const int64_t group = std::min(s.queries, kFusedGroup);
    const int64_t most_tail = most_fused_tail_rows(s, group);
    DeviceBuffer<bf16> tail_kv(static_cast<size_t>(most_tail * kv_row), MemoryCategory::Workspace);
    for (int64_t g0 = 0; g0 < s.queries; g0 += group) {
      const int64_t g1 = std::min(s.queries, g0 + group);
      const TailRows t = union_fused_tail_rows(s, g0, g1);
      expand(gemm, lat, lat.latent + t.low * lat.stride, lat.stride, t.high - t.low, kv_row, tail_kv.data(),
             stream);
      union_attention_forward_fused(s, u, union_kv.data(), tail_kv.data(), t, g0, g1, selected, q, out, lse,
                                    stream);
    }
    return;
  }
  DeviceBuffer<float> scores(static_cast<size_t>(std::max<int64_t>(H * most * n, 1)),
                             MemoryCategory::Workspace),
      tail_scores(static_cast<size_t>(H * most * most_rows), MemoryCategory::Workspace);
  DeviceBuffer<bf16> probs(scores.size(), MemoryCategory::Workspace),
      tail_probs(tail_scores.size(), MemoryCategory::Workspace),
      tail_kv(static_cast<size_t>(most_rows * kv_row), MemoryCategory::Workspace);
  const float scale2 = s.scale * kLog2e;
  for (int64_t b0 = 0; b0 < s.queries; b0 += block) {
    const int64_t B = std::min(block, s.queries - b0);
    const Block k = block_at(s, b0, B);
    expand(gemm, lat, lat.latent + k.low * lat.stride, lat.stride, k.rows, kv_row, tail_kv.data(), stream);
    // S_h^T [u, B] = K_h [u, dqk] Q_h^T, every head in one launch; the same over the block's rows.
    if (n > 0)
      gemm.matmul_batched(true, false, n, B, dqk, union_kv.data(), kv_row, dqk + dv, q + b0 * H * dqk,
                          H * dqk, dqk, scores.data(), CUDA_R_32F, n, B * n, H, 1.0f, 0.0f, stream);
    gemm.matmul_batched(true, false, k.rows, B, dqk, tail_kv.data(), kv_row, dqk + dv, q + b0 * H * dqk,
                        H * dqk, dqk, tail_scores.data(), CUDA_R_32F, k.rows, B * k.rows, H, 1.0f, 0.0f,
                        stream);
    union_softmax_kernel<<<blocks_for(H * B * 32), kThreads, 0, stream>>>(
        block_scores(s, u, selected, k, B), scores.data(), tail_scores.data(), scale2, probs.data(),
        tail_probs.data(), lse);
    SPINDLE_LAUNCHED("union_softmax_kernel");
    // O_h^T [dv, B] = V_h^T [dv, u] P_h^T + V_tail,h^T P_tail,h^T.
    if (n > 0)
      gemm.matmul_batched(false, false, dv, B, n, union_kv.data() + dqk, kv_row, dqk + dv, probs.data(), n,
                          B * n, out + b0 * H * dv, CUDA_R_16BF, H * dv, dv, H, 1.0f, 0.0f, stream);
    gemm.matmul_batched(false, false, dv, B, k.rows, tail_kv.data() + dqk, kv_row, dqk + dv,
                        tail_probs.data(), k.rows, B * k.rows, out + b0 * H * dv, CUDA_R_16BF, H * dv, dv, H,
                        1.0f, n > 0 ? 1.0f : 0.0f, stream);
  }
}

void union_attention_backward(Gemm& gemm, const UnionAttentionShape& s, const ChunkUnion& u,
                              const UnionLatent& lat, const int32_t* selected, const bf16* q, const bf16* out,
                              const float* lse, const bf16* dout, bf16* dq, float* d_latent,
                              float* d_kv_b_proj, int64_t block, cudaStream_t stream) {
  check(block > 0, "union attention backward: a block of ", block, " queries");
  if (s.queries == 0) return;
  const int64_t H = s.heads, dqk = s.qk_dim, dv = s.v_dim, n = u.count, kv_row = H * (dqk + dv);
  const int64_t most = std::min(block, s.queries), most_rows = most + s.tail();
  DeviceBuffer<float> dot(static_cast<size_t>(s.queries * H), MemoryCategory::Workspace);
  output_dot_kernel<<<blocks_for(s.queries * H * 32), kThreads, 0, stream>>>(dout, out, s.queries * H, dv,
                                                                             dot.data());
  SPINDLE_LAUNCHED("output_dot_kernel");
  const size_t union_cells = static_cast<size_t>(std::max<int64_t>(n, 1));
  DeviceBuffer<bf16> union_rows(union_cells * lat.rank, MemoryCategory::Workspace),
      union_kv(union_cells * kv_row, MemoryCategory::Workspace);
  if (n > 0) {
    gather_rows_kernel<<<blocks_for(n * lat.rank), kThreads, 0, stream>>>(
        lat.latent, lat.stride, u.keys.data(), n, lat.rank, union_rows.data());
    SPINDLE_LAUNCHED("gather_rows_kernel");
    expand(gemm, lat, union_rows.data(), lat.rank, n, kv_row, union_kv.data(), stream);
  }
  if (union_fused_unsupported(s).empty()) {
    // Version 2: the union's gradient from every query at once, the tails' a group at a time.
    const UnionBackwardInputs in{q, lse, dout, dot.data()};
    if (n > 0) {
      DeviceBuffer<bf16> union_dkv(union_cells * kv_row, MemoryCategory::Workspace);
      union_attention_backward_fused_union(s, u, union_kv.data(), selected, in, union_dkv.data(), stream);
      DeviceBuffer<float> union_d_rows(static_cast<size_t>(n * lat.rank), MemoryCategory::Workspace);
      expand_backward(gemm, lat, union_rows.data(), lat.rank, n, kv_row, union_dkv.data(), union_d_rows.data(),
                      d_kv_b_proj, stream);
      add_rows_kernel<<<blocks_for(n * lat.rank), kThreads, 0, stream>>>(union_d_rows.data(), u.keys.data(), 0,
                                                                         n, lat.rank, d_latent, lat.stride);
      SPINDLE_LAUNCHED("add_rows_kernel");
    }
    const int64_t group = std::min(s.queries, kFusedGroup), most_tail = most_fused_tail_rows(s, group);
    DeviceBuffer<bf16> tail_kv(static_cast<size_t>(most_tail * kv_row), MemoryCategory::Workspace),
        tail_dkv(static_cast<size_t>(most_tail * kv_row), MemoryCategory::Workspace);
    DeviceBuffer<float> tail_d_rows(static_cast<size_t>(most_tail * lat.rank), MemoryCategory::Workspace);
    DeviceBuffer<uint32_t> tail_masks(static_cast<size_t>(s.queries * 4), MemoryCategory::Workspace);
    for (int64_t g0 = 0; g0 < s.queries; g0 += group) {
      const int64_t g1 = std::min(s.queries, g0 + group);
      const TailRows t = union_fused_tail_rows(s, g0, g1);
      const bf16* tail_latent = lat.latent + t.low * lat.stride;
      expand(gemm, lat, tail_latent, lat.stride, t.high - t.low, kv_row, tail_kv.data(), stream);
      union_attention_backward_fused_tails(s, u, union_kv.data(), tail_kv.data(), t, g0, g1, selected, in,
                                           tail_masks.data(), dq, tail_dkv.data(), stream);
      expand_backward(gemm, lat, tail_latent, lat.stride, t.high - t.low, kv_row, tail_dkv.data(),
                      tail_d_rows.data(), d_kv_b_proj, stream);
      add_rows_kernel<<<blocks_for((t.high - t.low) * lat.rank), kThreads, 0, stream>>>(
          tail_d_rows.data(), nullptr, t.low, t.high - t.low, lat.rank, d_latent, lat.stride);
      SPINDLE_LAUNCHED("add_rows_kernel");
    }
    return;
  }
  DeviceBuffer<float> union_dkv(union_cells * kv_row, MemoryCategory::Workspace);
  const size_t cells = static_cast<size_t>(std::max<int64_t>(H * most * n, 1)),
               tail_cells = static_cast<size_t>(H * most * most_rows);
  DeviceBuffer<float> scores(cells, MemoryCategory::Workspace), dprobs(cells, MemoryCategory::Workspace),
      tail_scores(tail_cells, MemoryCategory::Workspace), tail_dprobs(tail_cells, MemoryCategory::Workspace),
      tail_dkv(static_cast<size_t>(most_rows * kv_row), MemoryCategory::Workspace),
      tail_d_rows(static_cast<size_t>(most_rows * lat.rank), MemoryCategory::Workspace);
  DeviceBuffer<bf16> probs(cells, MemoryCategory::Workspace), dscores(cells, MemoryCategory::Workspace),
      tail_probs(tail_cells, MemoryCategory::Workspace), tail_dscores(tail_cells, MemoryCategory::Workspace),
      tail_kv(static_cast<size_t>(most_rows * kv_row), MemoryCategory::Workspace);
  const float scale2 = s.scale * kLog2e;
  for (int64_t b0 = 0; b0 < s.queries; b0 += block) {
    const int64_t B = std::min(block, s.queries - b0);
    const Block k = block_at(s, b0, B);
    const BlockScores bs = block_scores(s, u, selected, k, B);
    const bf16* tail_latent = lat.latent + k.low * lat.stride;
    expand(gemm, lat, tail_latent, lat.stride, k.rows, kv_row, tail_kv.data(), stream);
    const bf16 *qb = q + b0 * H * dqk, *dob = dout + b0 * H * dv;
    if (n > 0) {
      // S_h^T = K_h Q_h^T and dP_h^T [u, B] = V_h [u, dv] dO_h^T; then P and dS.
      gemm.matmul_batched(true, false, n, B, dqk, union_kv.data(), kv_row, dqk + dv, qb, H * dqk, dqk,
                          scores.data(), CUDA_R_32F, n, B * n, H, 1.0f, 0.0f, stream);
      gemm.matmul_batched(true, false, n, B, dv, union_kv.data() + dqk, kv_row, dqk + dv, dob, H * dv, dv,
                          dprobs.data(), CUDA_R_32F, n, B * n, H, 1.0f, 0.0f, stream);
      union_softmax_backward_kernel<<<blocks_for(H * B * n), kThreads, 0, stream>>>(
          bs, scores.data(), dprobs.data(), scale2, s.scale, lse, dot.data(), probs.data(), dscores.data());
      SPINDLE_LAUNCHED("union_softmax_backward_kernel");
      // dV_h^T [dv, u] (+)= dO_h^T [dv, B] P_h; dK_h^T [dqk, u] (+)= Q_h^T dS_h: summed over the blocks.
      const float accumulate = b0 == 0 ? 0.0f : 1.0f;
      gemm.matmul_batched(false, true, dv, n, B, dob, H * dv, dv, probs.data(), n, B * n,
                          union_dkv.data() + dqk, CUDA_R_32F, kv_row, dqk + dv, H, 1.0f, accumulate, stream);
      gemm.matmul_batched(false, true, dqk, n, B, qb, H * dqk, dqk, dscores.data(), n, B * n,
                          union_dkv.data(), CUDA_R_32F, kv_row, dqk + dv, H, 1.0f, accumulate, stream);
      // dQ_h^T [dqk, B] = K_h^T [dqk, u] dS_h^T.
      gemm.matmul_batched(false, false, dqk, B, n, union_kv.data(), kv_row, dqk + dv, dscores.data(), n,
                          B * n, dq + b0 * H * dqk, CUDA_R_16BF, H * dqk, dqk, H, 1.0f, 0.0f, stream);
    }
    // The tail segment over the block's rows, the same products.
    gemm.matmul_batched(true, false, k.rows, B, dqk, tail_kv.data(), kv_row, dqk + dv, qb, H * dqk, dqk,
                        tail_scores.data(), CUDA_R_32F, k.rows, B * k.rows, H, 1.0f, 0.0f, stream);
    gemm.matmul_batched(true, false, k.rows, B, dv, tail_kv.data() + dqk, kv_row, dqk + dv, dob, H * dv, dv,
                        tail_dprobs.data(), CUDA_R_32F, k.rows, B * k.rows, H, 1.0f, 0.0f, stream);
    tail_softmax_backward_kernel<<<blocks_for(H * B * 32), kThreads, 0, stream>>>(
        bs, tail_scores.data(), tail_dprobs.data(), scale2, s.scale, lse, dot.data(), tail_probs.data(),
        tail_dscores.data());
    SPINDLE_LAUNCHED("tail_softmax_backward_kernel");
    gemm.matmul_batched(false, true, dv, k.rows, B, dob, H * dv, dv, tail_probs.data(), k.rows, B * k.rows,
                        tail_dkv.data() + dqk, CUDA_R_32F, kv_row, dqk + dv, H, 1.0f, 0.0f, stream);
    gemm.matmul_batched(false, true, dqk, k.rows, B, qb, H * dqk, dqk, tail_dscores.data(), k.rows,
                        B * k.rows, tail_dkv.data(), CUDA_R_32F, kv_row, dqk + dv, H, 1.0f, 0.0f, stream);
    gemm.matmul_batched(false, false, dqk, B, k.rows, tail_kv.data(), kv_row, dqk + dv, tail_dscores.data(),
                        k.rows, B * k.rows, dq + b0 * H * dqk, CUDA_R_16BF, H * dqk, dqk, H, 1.0f,
                        n > 0 ? 1.0f : 0.0f, stream);
    // The block's rows' gradient to the latent (consecutive blocks share rows: their adds run in turn).
    expand_backward(gemm, lat, tail_latent, lat.stride, k.rows, kv_row, tail_dkv.data(), tail_d_rows.data(),
                    d_kv_b_proj, stream);
    add_rows_kernel<<<blocks_for(k.rows * lat.rank), kThreads, 0, stream>>>(
        tail_d_rows.data(), nullptr, k.low, k.rows, lat.rank, d_latent, lat.stride);
    SPINDLE_LAUNCHED("add_rows_kernel");
  }
  if (n == 0) return;
  DeviceBuffer<float> union_d_rows(static_cast<size_t>(n * lat.rank), MemoryCategory::Workspace);
  expand_backward(gemm, lat, union_rows.data(), lat.rank, n, kv_row, union_dkv.data(), union_d_rows.data(),
                  d_kv_b_proj, stream);
  add_rows_kernel<<<blocks_for(n * lat.rank), kThreads, 0, stream>>>(union_d_rows.data(), u.keys.data(), 0, n,
                                                                     lat.rank, d_latent, lat.stride);
  SPINDLE_LAUNCHED("add_rows_kernel");
}

}  // namespace spindle::cuda
