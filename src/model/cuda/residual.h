// The mHC residual around each sublayer on the GPU (the CPU's model/residual.h):
//   pre, post, comb, collapsed = hc(streams);  y = sublayer(rms_norm(collapsed));
//   streams' = post * y + comb^T streams
// Streams and their gradients are bf16 [tokens, H, D] (kernels/cuda/mhc.h says why).
#pragma once

#include <functional>

#include "backend/cuda/device_memory.h"
#include "model/config.h"
#include "model/cuda/context.h"
#include "model/weights.h"

namespace spindle::cuda {

using SublayerForward = std::function<void(const __nv_bfloat16* normed, __nv_bfloat16* y)>;
// Writes the input gradient into dnormed (fp32, modules.h) and accumulates the sublayer's parameter
// gradients; where y is not null, also writes the sublayer's output there (a backward that
// recomputes its forward anyway gives it for one projection more).
using SublayerBackward = std::function<void(const __nv_bfloat16* normed, const __nv_bfloat16* dy,
                                            float* dnormed, __nv_bfloat16* y)>;

// A site's mHC mix (fp32 [tokens, (2 + H) H + 1], kernels/cuda/mhc.h), kept from a recomputation
// for the site's backward: its coefficients come from it without the product over the streams.
struct SiteMix {
  DeviceBuffer<float> mix;
};

// A site's combine coefficients (fp32 post [tokens, H] and comb [tokens, H, H]), kept from a
// recomputation so that the site's output streams can be made again (residual_site_output).
struct SiteCombine {
  DeviceBuffer<float> post, comb;
};

// The mix handed from one site to the next in a forward pass: a site's combine also multiplies its
// output by the next site's fn where hc_combine_mix takes the shape, and the next site takes its
// coefficients from that mix instead of reading its streams for the product again.
struct SiteChain {
  const HyperConnectionWeights* next = nullptr;  // the next site's weights; null at the last site
  SiteMix mix;  // on entry the mix of this site's streams, or empty; on return the next site's, or empty
};

// streams (input) -> next (output), both [tokens, H, D]; the sublayer's output [tokens, D] goes
// to `keep_y`, the mix to `keep_mix` and the combine's coefficients to `keep_combine`, each if
// given; `chain` as SiteChain says, if given. With `next` null there is no combine: the sublayer
// runs for what it leaves behind (a streamed forward's carries), and the chain ends there.
void residual_site_forward(Context& ctx, const ModelConfig& c, const HyperConnectionWeights& hc,
                           const Tensor& norm, int64_t L, const __nv_bfloat16* streams, __nv_bfloat16* next,
                           const SublayerForward& sublayer, DeviceBuffer<__nv_bfloat16>* keep_y = nullptr,
                           SiteMix* keep_mix = nullptr, SiteChain* chain = nullptr,
                           SiteCombine* keep_combine = nullptr);

// The site's output streams `next` again from its input `streams`, its sublayer's output y and its
// combine's coefficients, kept from residual_site_forward: bit for bit that pass's output.
void residual_site_output(Context& ctx, const ModelConfig& c, int64_t L, const __nv_bfloat16* streams,
                          const __nv_bfloat16* y, const SiteCombine& combine, __nv_bfloat16* next);

// `streams` is the site's input; dstreams holds the gradient of its output on entry and of its
// input on return. The combine's backward needs the sublayer's output y: taken from `kept_y`
// where it holds it; else `sublayer`, where set, recomputes it before the sublayer's backward;
// where empty, sublayer_backward writes it. The coefficients come from the mix in `kept_mix` where
// it holds one (taken), else from the product again.
void residual_site_backward(Context& ctx, const ModelConfig& c, const HyperConnectionWeights& hc,
                            const Tensor& norm, int64_t L, const __nv_bfloat16* streams,
                            DeviceBuffer<__nv_bfloat16>& dstreams, HyperConnectionWeights& ghc, Tensor& gnorm,
                            const SublayerForward& sublayer, const SublayerBackward& sublayer_backward,
                            DeviceBuffer<__nv_bfloat16>* kept_y = nullptr, SiteMix* kept_mix = nullptr);

}  // namespace spindle::cuda
