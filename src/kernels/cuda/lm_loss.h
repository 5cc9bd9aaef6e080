// The lm_head fused with cross-entropy, in vocabulary chunks: never an L x V logits buffer.
//
// hidden [L, D] bf16, head weight [V, D] bf16, targets [L] int32 (-1, or any negative value,
// = ignored). The tokens are taken in blocks of at most `token_block` rows and, inside a block,
// the vocabulary in chunks of at most `vocab_chunk` rows of the weight:
//   forward:  logits[Lb, C] (fp32) = hidden_block * W_chunk^T (cuBLASLt, bf16 in, fp32 accumulate);
//             an online max / sum-exp per row and the target's logit are kept across chunks;
//             logprob[r] = logit[r, target[r]] - logsumexp(logits[r, :]).
//   forward_backward (training): the forward with each chunk's logits kept, so the block's logits
//             over the whole vocabulary are computed once; then, chunk by chunk, dlogits =
//             (softmax - onehot) * scale in bf16, dhidden_block (fp32) += dlogits * W_chunk,
//             dW_chunk (fp32, the caller's buffer) += dlogits^T * hidden_block; dhidden is written
//             in bf16 after the last chunk.
// Workspace (owned, grown on demand, category Workspace), with Lb = min(L, token_block) and
// C = min(V, vocab_chunk):
//   forward:          Lb*C*4 (fp32 logits) + Lb*12 bytes (running max, sum, target logit);
//   forward_backward: about Lb*V*4 (the block's logits) + Lb*C*2 (bf16 dlogits) + Lb*D*4 (fp32
//                     dhidden) + Lb*16 bytes; plus cuBLASLt's own 32 MiB.
// The default token block, 2048, keeps the weight gradient's products (K = Lb) compute-bound, for
// 1.35 GB of workspace at GLM's 154,880 tokens and D 2048.
// Matches cpu::target_log_probs, cpu::target_log_probs_backward and cpu::linear_backward.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/device_memory.h"
#include "kernels/cuda/gemm.h"

namespace spindle::cuda {

class LmHeadLoss {
 public:
  explicit LmHeadLoss(int64_t vocab_chunk = 16384, int64_t token_block = 2048);
  LmHeadLoss(const LmHeadLoss&) = delete;
  LmHeadLoss& operator=(const LmHeadLoss&) = delete;

  int64_t vocab_chunk() const { return vocab_chunk_; }
  int64_t token_block() const { return token_block_; }
  // Device bytes forward / forward_backward need besides cuBLASLt's workspace (see above).
  size_t forward_workspace_bytes(int64_t L, int64_t V) const;
  size_t forward_backward_workspace_bytes(int64_t L, int64_t D, int64_t V) const;

  // logprob [L] (fp32, written; 0 at ignored positions); lse [L] (fp32, written, may be null):
  // each row's log-sum-exp; loss (fp32 device scalar, may be null): mean of -logprob over the
  // positions not ignored (0 if none).
  void forward(const __nv_bfloat16* hidden, const __nv_bfloat16* weight, const int32_t* target,
               float* logprob, float* lse, float* loss, int64_t L, int64_t D, int64_t V, cudaStream_t stream);

  // forward's outputs, and the gradients of -scale * sum_r logprob[r] (scale = 1 / number of
  // targets for the mean loss): dhidden [L, D] bf16 written; dweight [V, D] fp32 accumulated (may be
  // null).
  void forward_backward(const __nv_bfloat16* hidden, const __nv_bfloat16* weight, const int32_t* target,
                        float* logprob, float* lse, float* loss, float scale, __nv_bfloat16* dhidden,
                        float* dweight, int64_t L, int64_t D, int64_t V, cudaStream_t stream);

 private:
  void ensure_workspace(size_t bytes);
  // One token block's logits chunk by chunk over the vocabulary (chunk j's at logits + j *
  // chunk_stride, ld the chunk's width rounded to 8: stride 0 reuses one chunk's buffer), folded
  // into the running max, sum and target logit (row_stats, stats_stride apart), then logprob and lse.
  void fold_block(const __nv_bfloat16* hidden_block, const __nv_bfloat16* weight, const int32_t* target_block,
                  int64_t Lb, int64_t D, int64_t V, float* logits, size_t chunk_stride, float* row_stats,
                  size_t stats_stride, float* logprob_block, float* lse_block, cudaStream_t stream);

  int64_t vocab_chunk_, token_block_;
  Gemm gemm_;
  DeviceBuffer<float> workspace_;
};

// Kernels of lm_loss.cu (launch wrappers; rows of `logits` are ld floats apart).
namespace lm_loss_detail {
// Folds a chunk [c0, c0 + C) of rows' logits into the running max / sum-exp / target logit;
// first: initialise; last: write lse and logprob (and the mean loss when loss is non-null
// and this is the final token block, see forward).
void fold_chunk(const float* logits, int64_t ld, const int32_t* target, int64_t rows, int64_t c0, int64_t C,
                float* run_max, float* run_sum, float* target_logit, bool first, bool last, float* logprob,
                float* lse, cudaStream_t stream);
// dlogits[r, j] (bf16) = (exp(logits[r, j] - lse[r]) - [c0 + j == target[r]]) * scale; 0 for ignored rows.
void softmax_grad(const float* logits, int64_t ld, const int32_t* target, const float* lse, int64_t rows,
                  int64_t c0, int64_t C, float scale, __nv_bfloat16* dlogits, cudaStream_t stream);
// loss = mean of -logprob over targets >= 0 (0 when none).
void mean_loss(const float* logprob, const int32_t* target, int64_t L, float* loss, cudaStream_t stream);
}  // namespace lm_loss_detail

}  // namespace spindle::cuda
