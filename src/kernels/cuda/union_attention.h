// MLA's sparse attention over a chunk of queries with the selected keys made explicit
// (docs/UNION_ATTENTION.md). Keys and values of a token are kv_b_proj's product of its latent row.
// Two segments, in one softmax:
//   - the union U: the distinct tokens of the chunk's pool slots (each row's first `pooled`), each
//     query's pool slots as bits over U, their keys and values made once for the chunk;
//   - the tail: each query's last width - pooled slots (its own incomplete pool, within width -
//     pooled tokens before it), over the consecutive latent rows of its block of queries.
// The attention runs in flash-style kernels on wgmma (union_attention_hopper.h), for the shapes
// they take (union_fused_unsupported). The same function as cpu::sparse_attention with per-head
// keys (kv_heads = heads) over keys and values kv_b_proj makes from the latent, for the chunk's
// queries; a selection row holds no token twice.
//
// Layouts (row-major):
//   selected [queries, width]          int32: token ids below first + queries, negative unused
//   q        [queries, heads, qk_dim]  bf16
//   latent   [first + queries, stride] bf16, the first `rank` values of a row its latent;
//   kv_b_proj [heads (qk_dim + v_dim), rank] bf16: head h's key rows, then its value rows
//   out      [queries, heads, v_dim]   bf16;  lse [queries, heads] fp32 (natural log; +inf: nothing
//                                             selected)
//   dq       [queries, heads, qk_dim]  bf16, written; d_latent (fp32, like latent) and d_kv_b_proj
//                                      (fp32, like kv_b_proj) accumulated
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "backend/cuda/device_memory.h"
#include "kernels/cuda/gemm.h"

namespace spindle::cuda {

struct UnionAttentionShape {
  int64_t queries, heads, qk_dim, v_dim, width;
  int64_t pooled;  // the slots of a row that make the union; the rest are its tail
  int64_t first;   // the chunk's first query's position
  float scale;
  int64_t tail() const { return width - pooled; }
  int64_t span() const { return first + queries; }  // every selected token is below it
};

struct UnionLatent {
  const __nv_bfloat16* latent;
  int64_t stride, rank;
  const __nv_bfloat16* kv_b_proj;
};

// The chunk's union: keys [count], ascending; masks [queries][words], bit j % 32 of word j / 32:
// the query's pool slots hold keys[j]. count is on the host: building it synchronises the stream.
// The union's buffers (these and the attention's) hold `capacity` keys, the count rounded to a few
// sizes (geometric_capacity), so the next chunk's and layer's unions reuse the cached blocks.
struct ChunkUnion {
  int64_t count = 0, words = 0, capacity = 0;
  DeviceBuffer<int32_t> keys;
  DeviceBuffer<uint32_t> masks;
};
// Over most_keys keys, only the count: no buffers allocated or written (the caller takes another form).
ChunkUnion chunk_union(const UnionAttentionShape& s, const int32_t* selected, cudaStream_t stream,
                       int64_t most_keys = std::numeric_limits<int64_t>::max());

// The shape must be one the fused kernels take (union_fused_unsupported empty).
void union_attention_forward(Gemm& gemm, const UnionAttentionShape& s, const ChunkUnion& u,
                             const UnionLatent& lat, const int32_t* selected, const __nv_bfloat16* q,
                             __nv_bfloat16* out, float* lse, cudaStream_t stream);
// mass, unless null: the attention's probabilities summed over the heads at each selected slot,
// [queries, width] fp32 (written; zero at unused slots), for the indexer's KL training; the
// selection must then be in the indexer's layout (pool slots ascending, then -1, the tail after).
void union_attention_backward(Gemm& gemm, const UnionAttentionShape& s, const ChunkUnion& u,
                              const UnionLatent& lat, const int32_t* selected, const __nv_bfloat16* q,
                              const __nv_bfloat16* out, const float* lse, const __nv_bfloat16* dout,
                              __nv_bfloat16* dq, float* d_latent, float* d_kv_b_proj, float* mass,
                              cudaStream_t stream);

}  // namespace spindle::cuda
