// Chunked lm_head + cross-entropy: the products through cuBLASLt, the row statistics and the
// softmax gradient in lm_loss.cu. Row-major matrices are the transposed column-major ones that
// cuBLASLt sees, so each row-major product below is written as its column-major transpose.
#include "kernels/cuda/lm_loss.h"

#include <algorithm>

#include "backend/cuda/check.h"
#include "kernels/cuda/convert.h"

namespace spindle::cuda {

namespace {

constexpr size_t kAlignFloats = 64;  // 256-byte aligned workspace regions

size_t round_up(size_t n) { return (n + kAlignFloats - 1) / kAlignFloats * kAlignFloats; }

// Row stride of the logits chunk: a multiple of 8 elements keeps bf16 and fp32 rows 16-byte aligned.
int64_t chunk_ld(int64_t V, int64_t vocab_chunk) { return (std::min(V, vocab_chunk) + 7) / 8 * 8; }

// A token block's logits over the whole vocabulary: chunk j's at j * kept_chunk_stride (ld C_max
// and aligned as the forward's one-chunk buffer, so that the products are the same); the last
// chunk needs only its own columns of its last row.
size_t kept_chunk_stride(int64_t Lb, int64_t V, int64_t vocab_chunk) {
  return round_up(static_cast<size_t>(Lb * chunk_ld(V, vocab_chunk)));
}
size_t kept_logits_floats(int64_t Lb, int64_t V, int64_t vocab_chunk) {
  const int64_t chunks = (V + vocab_chunk - 1) / vocab_chunk, last = V - (chunks - 1) * vocab_chunk;
  return static_cast<size_t>(chunks - 1) * kept_chunk_stride(Lb, V, vocab_chunk) +
         static_cast<size_t>((Lb - 1) * chunk_ld(V, vocab_chunk) + last);
}

}  // namespace

LmHeadLoss::LmHeadLoss(int64_t vocab_chunk, int64_t token_block)
    : vocab_chunk_(vocab_chunk), token_block_(token_block) {
  check(vocab_chunk > 0 && vocab_chunk % 8 == 0,
        "LmHeadLoss: vocab_chunk must be a positive multiple of 8, got ", vocab_chunk);
  check(token_block > 0, "LmHeadLoss: token_block must be positive, got ", token_block);
}

size_t LmHeadLoss::forward_workspace_bytes(int64_t L, int64_t V) const {
  const size_t Lb = static_cast<size_t>(std::min(L, token_block_)),
               C = static_cast<size_t>(chunk_ld(V, vocab_chunk_));
  return (round_up(Lb * C) + 3 * round_up(Lb)) * sizeof(float);
}

size_t LmHeadLoss::forward_backward_workspace_bytes(int64_t L, int64_t D, int64_t V) const {
  const size_t Lb = static_cast<size_t>(std::min(L, token_block_)),
               C = static_cast<size_t>(chunk_ld(V, vocab_chunk_));
  return (round_up(kept_logits_floats(static_cast<int64_t>(Lb), V, vocab_chunk_)) + 4 * round_up(Lb) +
          round_up((Lb * C + 1) / 2) + round_up(Lb * static_cast<size_t>(D))) *
         sizeof(float);
}

void LmHeadLoss::ensure_workspace(size_t bytes) {
  const size_t floats = (bytes + sizeof(float) - 1) / sizeof(float);
  if (workspace_.size() < floats) {
    workspace_ = DeviceBuffer<float>();  // release first: the old and new never coexist
    workspace_ = DeviceBuffer<float>(floats, MemoryCategory::Workspace);
  }
}

void LmHeadLoss::fold_block(const __nv_bfloat16* hidden_block, const __nv_bfloat16* weight,
                            const int32_t* target_block, int64_t Lb, int64_t D, int64_t V, float* logits,
                            size_t chunk_stride, float* row_stats, size_t stats_stride, float* logprob_block,
                            float* lse_block, cudaStream_t stream) {
  const int64_t C_max = chunk_ld(V, vocab_chunk_);
  float *run_max = row_stats, *run_sum = row_stats + stats_stride, *target_logit = run_sum + stats_stride;
  for (int64_t c0 = 0; c0 < V; c0 += vocab_chunk_) {
    const int64_t C = std::min(vocab_chunk_, V - c0);
    float* chunk_logits = logits + c0 / vocab_chunk_ * chunk_stride;
    // logits[Lb, C] row-major (ld C_max) = h W_c^T; column-major: [C, Lb] = W_c^T(op T on [D, C]) * h^T([D,
    // Lb]).
    gemm_.matmul(true, false, C, Lb, D, weight + c0 * D, D, hidden_block, D, chunk_logits, CUDA_R_32F, C_max,
                 1.0f, 0.0f, stream, Gemm::Rows::N);
    lm_loss_detail::fold_chunk(chunk_logits, C_max, target_block, Lb, c0, C, run_max, run_sum, target_logit,
                               c0 == 0, c0 + C >= V, logprob_block, lse_block, stream);
  }
}

void LmHeadLoss::forward(const __nv_bfloat16* hidden, const __nv_bfloat16* weight, const int32_t* target,
                         float* logprob, float* lse, float* loss, int64_t L, int64_t D, int64_t V,
                         cudaStream_t stream) {
  check(V > 0 && D > 0, "LmHeadLoss::forward: empty head ", V, "x", D);
  if (L == 0) {
    if (loss) SPINDLE_CUDA(cudaMemsetAsync(loss, 0, sizeof(float), stream));
    return;
  }
  ensure_workspace(forward_workspace_bytes(L, V));
  const int64_t Lb_max = std::min(L, token_block_), C_max = chunk_ld(V, vocab_chunk_);
  float* logits = workspace_.data();
  float* row_stats = logits + round_up(static_cast<size_t>(Lb_max * C_max));
  for (int64_t r0 = 0; r0 < L; r0 += token_block_)
    fold_block(hidden + r0 * D, weight, target + r0, std::min(token_block_, L - r0), D, V, logits, 0,
               row_stats, round_up(static_cast<size_t>(Lb_max)), logprob + r0, lse ? lse + r0 : nullptr,
               stream);
  if (loss) lm_loss_detail::mean_loss(logprob, target, L, loss, stream);
}

void LmHeadLoss::forward_backward(const __nv_bfloat16* hidden, const __nv_bfloat16* weight,
                                  const int32_t* target, float* logprob, float* lse, float* loss, float scale,
                                  __nv_bfloat16* dhidden, float* dweight, int64_t L, int64_t D, int64_t V,
                                  cudaStream_t stream) {
  check(V > 0 && D > 0, "LmHeadLoss::forward_backward: empty head ", V, "x", D);
  if (L == 0) {
    if (loss) SPINDLE_CUDA(cudaMemsetAsync(loss, 0, sizeof(float), stream));
    return;
  }
  ensure_workspace(forward_backward_workspace_bytes(L, D, V));
  const int64_t Lb_max = std::min(L, token_block_), C_max = chunk_ld(V, vocab_chunk_);
  const size_t kept = round_up(kept_logits_floats(Lb_max, V, vocab_chunk_)),
               stride = kept_chunk_stride(Lb_max, V, vocab_chunk_);
  const size_t rows = round_up(static_cast<size_t>(Lb_max));  // one value per row of a block
  float* logits = workspace_.data();
  float* row_stats = logits + kept;        // running max, sum and target logit
  float* row_lse = row_stats + 3 * rows;   // when the caller keeps none
  float* dlogits_floats = row_lse + rows;  // bf16 [Lb, C_max]
  auto* dlogits = reinterpret_cast<__nv_bfloat16*>(dlogits_floats);
  float* dh = dlogits_floats + round_up(static_cast<size_t>((Lb_max * C_max + 1) / 2));
  for (int64_t r0 = 0; r0 < L; r0 += token_block_) {
    const int64_t Lb = std::min(token_block_, L - r0);
    float* block_lse = lse ? lse + r0 : row_lse;
    fold_block(hidden + r0 * D, weight, target + r0, Lb, D, V, logits, stride, row_stats, rows, logprob + r0,
               block_lse, stream);
    for (int64_t c0 = 0; c0 < V; c0 += vocab_chunk_) {
      const int64_t C = std::min(vocab_chunk_, V - c0);
      lm_loss_detail::softmax_grad(logits + c0 / vocab_chunk_ * stride, C_max, target + r0, block_lse, Lb, c0,
                                   C, scale, dlogits, stream);
      // dh[Lb, D] (+)= dl[Lb, C] W_c[C, D]; column-major: [D, Lb] = W_c^T([D, C], op N) * dl^T([C, Lb],
      // op N).
      gemm_.matmul(false, false, D, Lb, C, weight + c0 * D, D, dlogits, C_max, dh, CUDA_R_32F, D, 1.0f,
                   c0 == 0 ? 0.0f : 1.0f, stream, Gemm::Rows::N);
      // dW_c[C, D] += dl^T h; column-major: [D, C] = h^T([D, Lb], op N) * dl([C, Lb] stored, op T).
      if (dweight)
        gemm_.matmul(false, true, D, C, Lb, hidden + r0 * D, D, dlogits, C_max, dweight + c0 * D, CUDA_R_32F,
                     D, 1.0f, 1.0f, stream, Gemm::Rows::K);
    }
    f32_to_bf16(dh, dhidden + r0 * D, Lb * D, stream);
  }
  if (loss) lm_loss_detail::mean_loss(logprob, target, L, loss, stream);
}

}  // namespace spindle::cuda
