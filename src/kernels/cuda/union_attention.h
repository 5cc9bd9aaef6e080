// The sparse attention over a chunk's selected keys made explicit, version 1 (docs/UNION_ATTENTION.md):
// the distinct tokens a chunk's queries select (the union U), each query's selection as bits over
// U, and the attention with per-head keys and values of U's tokens as cuBLAS products batched
// over the heads, on blocks of the chunk's queries, with the masked softmax and its backward as
// passes over the scores between them. The same function as cpu::sparse_attention with per-head
// keys (kv_heads = heads), for the chunk's queries.
//
// Layouts (row-major):
//   selected [queries, width]          int32, token ids < span, negative for unused slots
//   q        [queries, heads, qk_dim]  bf16
//   kv       [u, heads, qk_dim + v_dim] bf16: U's keys and values (kv_b_proj's layout), U's order
//   out      [queries, heads, v_dim]   bf16;  lse [queries, heads] fp32 (natural log; +inf: nothing
//                                             selected)
//   dq       [queries, heads, qk_dim]  bf16, written;  dkv like kv, fp32, written
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/device_memory.h"
#include "kernels/cuda/gemm.h"

namespace spindle::cuda {

struct UnionAttentionShape {
  int64_t queries, heads, qk_dim, v_dim, width;
  int64_t span;  // every selected token id is below it (the chunk's end)
  float scale;
};

// The chunk's union: keys [count], ascending; masks [queries][words], bit j % 32 of word j / 32:
// the query selected keys[j]. count is on the host: building it synchronises the stream once.
struct ChunkUnion {
  int64_t count = 0, words = 0;
  DeviceBuffer<int32_t> keys;
  DeviceBuffer<uint32_t> masks;
};
ChunkUnion chunk_union(const UnionAttentionShape& s, const int32_t* selected, cudaStream_t stream);

// rows[j] = latent[keys[j]] (bf16, `cols` values of rows `stride` apart): the union's latent rows,
// [count, cols].
void gather_union_rows(const __nv_bfloat16* latent, int64_t stride, const ChunkUnion& u, int64_t cols,
                       __nv_bfloat16* rows, cudaStream_t stream);
// d_latent[keys[j]] += d_rows[j] (fp32; U's tokens are distinct, so no two rows meet).
void add_union_rows(const float* d_rows, const ChunkUnion& u, int64_t cols, float* d_latent, int64_t stride,
                    cudaStream_t stream);

// Queries in blocks of `block` (the scores of a block: heads x block x u fp32, twice in the
// backward).
void union_attention_forward(Gemm& gemm, const UnionAttentionShape& s, const ChunkUnion& u,
                             const __nv_bfloat16* q, const __nv_bfloat16* kv, __nv_bfloat16* out, float* lse,
                             int64_t block, cudaStream_t stream);
void union_attention_backward(Gemm& gemm, const UnionAttentionShape& s, const ChunkUnion& u,
                              const __nv_bfloat16* q, const __nv_bfloat16* kv, const __nv_bfloat16* out,
                              const float* lse, const __nv_bfloat16* dout, __nv_bfloat16* dq, float* dkv,
                              int64_t block, cudaStream_t stream);

}  // namespace spindle::cuda
