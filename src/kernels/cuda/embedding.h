// The model's entry and exit over the mHC residual streams [tokens, H, D]: every stream starts
// as the token's embedding row, and the exit is the mean of the streams. Activations and the
// streams' gradients in bf16, the embedding's gradient in fp32, math in fp32. CPU reference: the
// embedding and exit loops of model/forward.cpp and model/backward.cpp.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::cuda {

// streams[t, h, :] = embed[tokens[t], :] for every h; token ids must be rows of embed.
void embed_streams(const int32_t* tokens, const __nv_bfloat16* embed, __nv_bfloat16* streams,
                   int64_t tokens_count, int64_t H, int64_t D, cudaStream_t stream);

// dembed[tokens[t], :] += sum_h dstreams[t, h, :] (fp32 atomics), except for tokens equal to
// skip_id (the padding token; -1 skips none).
void embed_backward(const int32_t* tokens, const __nv_bfloat16* dstreams, float* dembed, int64_t tokens_count,
                    int64_t H, int64_t D, int32_t skip_id, cudaStream_t stream);

// mean[t, :] = sum_h streams[t, h, :] / H.
void stream_mean(const __nv_bfloat16* streams, __nv_bfloat16* mean, int64_t tokens_count, int64_t H,
                 int64_t D, cudaStream_t stream);

// dstreams[t, h, :] = dmean[t, :] / H (written).
void stream_mean_backward(const __nv_bfloat16* dmean, __nv_bfloat16* dstreams, int64_t tokens_count,
                          int64_t H, int64_t D, cudaStream_t stream);

}  // namespace spindle::cuda
