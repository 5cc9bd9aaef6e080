// MLA's absorbed sparse attention on the tensor cores: every head of query t attends over the same
// selected tokens' rows of one shared latent (the key is a row's first dk values, the value its
// first dv), so the heads of a query form the M dimension of real matrix products. The contract
// is cpu::sparse_attention with one key head and kv = [latent | latent[:dv]] (kernels/cpu/dsa.h).
//
// The forward runs on wgmma (sparse_mla_hopper.h) when dk and dv are multiples of 64, the backward
// (sparse_mla_backward_hopper.h) when dk = dv = 512; otherwise on the kernels below.
//
// Launch: one CTA of 16 warps per (query, group of up to 32 heads); the selected rows are gathered
// 64 at a time into shared memory with cp.async (double-buffered) and multiplied with mma.sync
// m16n8k16 (bf16 in, fp32 accumulate):
//   forward: S = Q K^T (each warp 8 of the 64 keys), an online softmax over the tile's rows in
//   fp32, O += P V (16-column units of the output dealt to the warps in turn, accumulators in
//   registers); writes out and the row's
//   log-sum-exp for the backward.
//   backward: per tile, S and dP = dO V^T (each warp 16 keys over half of dk and dv, the halves
//   summed through shared memory), P = exp(S - lse),
//   dS = P (dP - rowsum(dO o O)) scale; dQ += dS K in registers (16-column units per warp); the
//   latent's gradient dS^T Q + P^T dO ([64 keys, dk], fp32) staged 32 rows at a time in the
//   tile's spent key buffer and added to its rows by TMA bulk reductions (many queries select the
//   same row), which run while the warps go on. Where asked, P summed over the heads per slot
//   (the attention mass that trains the indexer) from the fp32 probabilities, at no extra pass.
// Limits: dk and dv multiples of 16 with dv <= dk <= 512 (shared memory), rows 16-byte aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace spindle::cuda {

struct SparseMlaShape {
  int64_t tokens;  // queries, and rows of the latent
  int64_t heads;
  int64_t dk;             // query and key width
  int64_t dv;             // value width, <= dk
  int64_t width;          // selected slots per query (negative entries are unused)
  int64_t latent_stride;  // elements from one latent row to the next, >= dk
  float scale;            // softmax scale
};

// Empty when the kernels take this shape, else why not (for a loud fallback).
std::string sparse_mla_unsupported(const SparseMlaShape& s);

// q: [tokens, heads, dk] bf16; latent: [tokens, latent_stride] bf16; selected: [tokens, width];
// out: [tokens, heads, dv] bf16 (written; zero for a query with no selected row); lse: [tokens,
// heads] fp32, the natural log-sum-exp of the scaled scores (+inf with no selected row).
void sparse_mla_forward(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                        const int32_t* selected, __nv_bfloat16* out, float* lse, cudaStream_t stream);

// From the forward's out and lse and dout ([tokens, heads, dv] bf16): dq [tokens, heads, dk] bf16
// written; d_latent [tokens, latent_stride] fp32, the first dk values of each selected row
// accumulated (zero it first). mass, unless null: [tokens, width] fp32 accumulated (zero it first)
// with the softmax's probabilities summed over the heads, cpu::attention_mass's contract (zero on
// unused slots); deterministic while heads <= 32 (one CTA per query). On wgmma where its kernel
// takes the shape (sparse_mla_backward_hopper.h), else sparse_mla_backward_mma.
void sparse_mla_backward(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                         const int32_t* selected, const __nv_bfloat16* out, const float* lse,
                         const __nv_bfloat16* dout, __nv_bfloat16* dq, float* d_latent, float* mass,
                         cudaStream_t stream);

// The backward above on mma.sync, one query a CTA, whatever the shape sparse_mla_unsupported takes
// (the benches and tests compare it with the others).
void sparse_mla_backward_mma(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                             const int32_t* selected, const __nv_bfloat16* out, const float* lse,
                             const __nv_bfloat16* dout, __nv_bfloat16* dq, float* d_latent, float* mass,
                             cudaStream_t stream);

}  // namespace spindle::cuda
