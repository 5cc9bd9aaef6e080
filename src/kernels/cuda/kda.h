// Kimi Delta Attention (the gated delta rule) on the GPU, chunked over C = 64 tokens. CPU
// reference: cpu::kda_recurrence and cpu::kda_recurrence_backward (kernels/cpu/kda.h); the
// chunked restatement implemented here is test KdaRecurrenceMatchesChunkedForm
// (tests/unit/test_kernels.cpp). Activations bf16, log decays, betas, states and all math fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::cuda {

constexpr int64_t kKdaChunk = 64;    // tokens per chunk
constexpr int64_t kKdaMaxDim = 128;  // dk, dv <= this

// The decay bound of a diagonal block's mma form (the preps' chunk_matrices, kda_chunk.cuh, and
// kda_backward.cu's grad kernel): exp(G_t - G_s), s and t in one sub-chunk of 16 tokens, as
// exp(G_t - G_m) exp(G_m - G_s) from its middle token m, where no factor exceeds
// 2^kKdaHalfDecayBound if G falls by at most that (log2 domain) over each half of every sub-chunk.
// GLM's lower bound of -5 per token makes at most 57.7 over 8 tokens; a chunk past it takes the
// element-by-element form.
constexpr float kKdaHalfDecayBound = 64.0f;

inline int64_t kda_chunks(int64_t tokens) { return (tokens + kKdaChunk - 1) / kKdaChunk; }

// The forward runs in segments of this many chunks, in three launches each: a chunk-parallel
// prep (the intra-chunk matrices and the chunk's WY form), the sequential state pass over the
// segment (heads x value tiles), and a chunk-parallel output pass. The workspace holds one
// segment's blocks of kKdaForwardBlockFloats per chunk and head (kda.cu has the layout).
constexpr int64_t kKdaSegmentChunks = 256;
constexpr int64_t kKdaForwardBlockFloats = kKdaChunk * kKdaChunk + 3 * kKdaChunk * kKdaMaxDim + kKdaMaxDim;
inline int64_t kda_forward_workspace_floats(int64_t tokens, int64_t heads) {
  const int64_t chunks = kda_chunks(tokens) < kKdaSegmentChunks ? kda_chunks(tokens) : kKdaSegmentChunks;
  return chunks * heads * kKdaForwardBlockFloats;
}

// A chunk's intra-chunk matrices (docs/KDA.md), fp32, packed by rows of their lower triangles: A
// below the diagonal, Aq through it, Tinv below it (its diagonal is one): 24 KB per chunk and head
// (kda_chunk.cuh has the layout). The streaming executor keeps them from a chunk's recomputation
// for its backward (kept_matrices below: [chunks, heads, kKdaKeptFloats]), which then does not
// compute them a third time, and with them the chunk's u = Tinv diag(beta) (v - exp(G) k S), fp32
// [C, kKdaMaxDim] after the matrices (the forward's state pass writes it there), so that the
// backward's gradient kernel does not compute it again either.
constexpr int64_t kKdaMatrixFloats = kKdaChunk * (kKdaChunk - 1) + kKdaChunk * (kKdaChunk + 1) / 2;
constexpr int64_t kKdaKeptFloats = kKdaMatrixFloats + kKdaChunk * kKdaMaxDim;
inline int64_t kda_kept_matrices_floats(int64_t tokens, int64_t heads) {
  return kda_chunks(tokens) * heads * kKdaKeptFloats;
}

// Forward. q, k: [tokens, heads, dk] (q l2-normalised and scaled, k l2-normalised); v: [tokens,
// heads, dv]; g: [tokens, heads, dk] log decay (<= 0); beta: [tokens, heads]; out: [tokens, heads,
// dv], or null for the states alone (a streamed chunk's carry). initial_state: fp32 [heads, dk, dv], the
// state before the first token (a streamed chunk's carry), or null for zero. chunk_states: fp32 [chunks + 1,
// heads, dk, dv], the state entering each chunk (entry 0 the initial state, entry `chunks` the final state),
// kept for the backward. workspace: kda_forward_workspace_floats(tokens, heads) floats. kept_matrices, if not
// null, receives every chunk's A, Aq, Tinv and u (kda_kept_matrices_floats) for kda_chunked_backward.
void kda_chunked_forward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                         const float* g, const float* beta, __nv_bfloat16* out, float* chunk_states,
                         float* workspace, int64_t tokens, int64_t heads, int64_t dk, int64_t dv,
                         cudaStream_t stream, const float* initial_state = nullptr,
                         float* kept_matrices = nullptr);

// Backward from chunk_states (as kda_chunked_forward wrote them) and dout (bf16 [tokens, heads,
// dv]), chunk-parallel (kda_backward.cu, docs/KDA.md "GPU backward kernels"): only the [dk, dv]
// state gradient passes from chunk to chunk; everything else runs over chunks x heads at once.
// d_final_state: fp32 [heads, dk, dv], the gradient reaching the final state (from a later chunk
// of a streamed sequence), or null for none; d_initial_state, if not null, receives the gradient
// of the initial state. kept_matrices, if not null: what kda_chunked_forward wrote there for the
// same q, k, v, g, beta and chunk states, taken instead of computed again; the gradient kernel then
// also takes Kb dS' from the state pass, and dbeta from the terms of X = v - exp(G) k S - A u
// (docs/KDA.md, "u kept"): the same gradients, summed in another order. dq, dk: bf16 [tokens,
// heads, dk] and dv: bf16 [tokens, heads, dv] (each rounded once: the convs' backward takes them in
// bf16, q's and k's through their l2 norms); dg: fp32 [tokens, heads, dk]; dbeta: fp32 [tokens,
// heads]; every output is written exactly once (no atomics: equal from run to run). The workspace
// (kda_backward_workspace_floats) holds one segment's A, Aq and Tinv (kKdaMatrixFloats per chunk and
// head; not with kept matrices), the state pass's operands, and the state gradients at its chunks'
// boundaries (fp32 [segment + 1, heads, dk, dv]); segments of this many chunks:
constexpr int64_t kKdaBackwardSegmentChunks = 128;
// Per chunk and head, besides A, Aq and Tinv: the state pass's operands W, Kb [C, kKdaMaxDim]
// and G_last (kda_backward.cu has the layout), and with kept matrices its product Kb dS' [C,
// kKdaMaxDim]; one more [heads, dk, dv] carries the state gradient from segment to segment.
constexpr int64_t kKdaBackwardOpsFloats = 2 * kKdaChunk * kKdaMaxDim + kKdaMaxDim;
inline int64_t kda_backward_workspace_floats(int64_t tokens, int64_t heads, int64_t dk, int64_t dv,
                                             bool matrices_kept = false) {
  const int64_t chunks =
      kda_chunks(tokens) < kKdaBackwardSegmentChunks ? kda_chunks(tokens) : kKdaBackwardSegmentChunks;
  return chunks * heads *
             ((matrices_kept ? kKdaChunk * kKdaMaxDim : kKdaMatrixFloats) + kKdaBackwardOpsFloats) +
         (chunks + 2) * heads * dk * dv;
}
void kda_chunked_backward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                          const float* g, const float* beta, const __nv_bfloat16* dout,
                          const float* chunk_states, __nv_bfloat16* dq, __nv_bfloat16* dk_out,
                          __nv_bfloat16* dv_out, float* dg, float* dbeta, float* workspace, int64_t tokens,
                          int64_t heads, int64_t dk, int64_t dv, cudaStream_t stream,
                          const float* d_final_state = nullptr, float* d_initial_state = nullptr,
                          const float* kept_matrices = nullptr);

}  // namespace spindle::cuda
