// mHC hyper-connections on the GPU, fused per token. Streams and collapsed/sublayer activations
// in bf16; fn [(2 + H) H, H D], base [(2 + H) H], scale [3] and the coefficients pre [tokens, H],
// post [tokens, H], comb [tokens, H, H] in fp32; all math in fp32. H = hc_mult (1 to 8).
// Gradients of the streams are bf16 too [tokens, H, D] (dstreams, dout), computed in fp32 and
// rounded once when stored (to nearest even): they are half of the site backward's bytes. Measured
// on the CPU (45 layers, hidden 64, 4,096 tokens, f32 against f64), rounding them to bf16 after
// every site takes the whole gradient's relative error from 6.2e-4 to 1.8e-3 (layers 0-14: 6.6e-4
// to 1.9e-3), next to 1.05e-3 for the sublayers' bf16 dy alone and a cosine of 0.998 between the
// GPU's bf16 forward and the CPU's (docs/PERF.md, "The residual streams' gradient in bf16?").
// CPU reference: kernels/cpu/mhc.h (same names, same argument order; its hc_combine_backward is
// split in two here: hc_combine_backward and hc_post_gradient; hc_coefficients_backward takes the
// mix that hc_coefficients wrote instead of multiplying it again).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/mhc.h"

namespace spindle::cuda {

// Floats of a site's mix: [tokens, (2 + H) H + 1], each token's streams times fn^T and (last) their
// sum of squares, all the coefficients are computed from.
int64_t hc_mix_floats(const cpu::HcShape& s);

// The site's RMS norm of its collapsed input: normed = rms_norm(collapsed, eps) * weight (bf16 [tokens,
// D]), the arithmetic of kernels/cuda/norms.h's rms_norm_forward but for the order of the sum of
// squares. The coefficient kernels apply it as they write collapsed, where hidden is a multiple of 8 on
// 16-byte aligned rows (hc_norm_fused); elsewhere rms_norm_forward runs after them.
// HcNorm{} (normed null): no norm.
struct HcNorm {
  const __nv_bfloat16* weight = nullptr;
  __nv_bfloat16* normed = nullptr;
  float eps = 0.0f;
};
bool hc_norm_fused(const cpu::HcShape& s, const __nv_bfloat16* streams, const __nv_bfloat16* collapsed,
                   const HcNorm& norm);

// What hc_combine_backward writes given y and no dstreams, for hc_site_backward_inputs: dout [tokens,
// H, D] and y [tokens, D] in; dy (bf16), d_comb and d_post (fp32) out.
struct HcCombineGrad {
  const __nv_bfloat16* dout = nullptr;
  const __nv_bfloat16* y = nullptr;
  __nv_bfloat16* dy = nullptr;
  float* d_comb = nullptr;
  float* d_post = nullptr;
};

// pre, post, comb (exact Sinkhorn of cpu::hc_coefficients), collapsed = sum_h pre[h] streams[h]
// (bf16 [tokens, D]) and its norm; all written, and the mix (hc_mix_floats) where `mix` is given.
void hc_coefficients(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* fn, const float* base,
                     const float* scale, float* pre, float* post, float* comb, __nv_bfloat16* collapsed,
                     const HcNorm& norm, cudaStream_t stream, float* mix = nullptr);

// hc_coefficients from the mix it wrote for these streams (kept since): the same pre, post, comb,
// collapsed and normed, bit for bit, without the product.
void hc_coefficients_from_mix(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* mix,
                              const float* base, const float* scale, float* pre, float* post, float* comb,
                              __nv_bfloat16* collapsed, const HcNorm& norm, cudaStream_t stream);

// A site's backward inputs in one pass over its streams: hc_coefficients_from_mix (the norm in the
// collapse) and hc_combine_backward's dy, d_comb and d_post from `grad`, the same bits as the two
// calls. Where hc_site_backward_fused: rows in 16-byte vectors.
bool hc_site_backward_fused(const cpu::HcShape& s, const __nv_bfloat16* streams,
                            const __nv_bfloat16* collapsed, const HcNorm& norm, const HcCombineGrad& grad);
void hc_site_backward_inputs(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* mix,
                             const float* base, const float* scale, float* pre, float* post, float* comb,
                             __nv_bfloat16* collapsed, const HcNorm& norm, const HcCombineGrad& grad,
                             cudaStream_t stream);

// out[t, h, :] = post[t, h] * y[t, :] + sum_j comb[t, j, h] * streams[t, j, :] (bf16, written).
void hc_combine(const cpu::HcShape& s, const __nv_bfloat16* streams, const __nv_bfloat16* y,
                const float* post, const float* comb, __nv_bfloat16* out, cudaStream_t stream);

// hc_combine and, in the same pass, the next site's mix of its output (what hc_coefficients would
// write for `out` with the next site's fn_next; the sum in another order, so equal to fp32 rounding):
// the next site then takes hc_coefficients_from_mix and does not read its streams for the product.
// Where hc_combine_mix_supported: hc_mult 4, hidden a multiple of 32, 16-byte aligned rows.
bool hc_combine_mix_supported(const cpu::HcShape& s, const __nv_bfloat16* streams, const __nv_bfloat16* y,
                              const __nv_bfloat16* out);
void hc_combine_mix(const cpu::HcShape& s, const __nv_bfloat16* streams, const __nv_bfloat16* y,
                    const float* post, const float* comb, __nv_bfloat16* out, const float* fn_next,
                    float* mix, cudaStream_t stream);

// Backward of hc_combine, the part that needs no y (so that y may come from the sublayer's
// backward, after dy): dstreams (bf16), dy (bf16) and d_comb (fp32) written (the CPU version
// accumulates dstreams). dstreams may be null: hc_coefficients_backward then writes that part.
// Given y (when it is known before this call) it writes d_post too, as hc_post_gradient would.
void hc_combine_backward(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* post,
                         const float* comb, const __nv_bfloat16* dout, __nv_bfloat16* dstreams,
                         __nv_bfloat16* dy, float* d_comb, cudaStream_t stream,
                         const __nv_bfloat16* y = nullptr, float* d_post = nullptr);

// The rest of hc_combine's backward: d_post[t, h] = dout[t, h, :] . y[t, :] (fp32, written).
void hc_post_gradient(const cpu::HcShape& s, const __nv_bfloat16* y, const __nv_bfloat16* dout, float* d_post,
                      cudaStream_t stream);

// Floats of workspace hc_coefficients_backward needs: tokens * (2 (2 + H) H + 1 + H).
int64_t hc_coefficients_backward_workspace(const cpu::HcShape& s);

// Backward of hc_coefficients (with the collapse), given the mix hc_coefficients wrote for these
// streams: d_pre (may be null: zero), d_post, d_comb fp32,
// d_collapsed bf16. dfn, dbase, dscale (fp32) accumulated; dstreams (bf16) accumulated, or, given the
// site's comb and the gradient dout of hc_combine's output (both or neither), written as
// hc_combine's part (what hc_combine_backward with null dstreams leaves out) plus this one's.
// `workspace` holds hc_coefficients_backward_workspace(s) floats, used by this call only.
void hc_coefficients_backward(const cpu::HcShape& s, const __nv_bfloat16* streams, const float* mix,
                              const float* fn, const float* base, const float* scale, const float* d_pre,
                              const float* d_post, const float* d_comb, const __nv_bfloat16* d_collapsed,
                              const float* comb, const __nv_bfloat16* dout, __nv_bfloat16* dstreams,
                              float* dfn, float* dbase, float* dscale, float* workspace, cudaStream_t stream);

}  // namespace spindle::cuda
