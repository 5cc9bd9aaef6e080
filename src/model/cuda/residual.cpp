#include "model/cuda/residual.h"

#include <utility>

#include "core/error.h"
#include "kernels/cuda/mhc.h"
#include "kernels/cuda/norms.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/modules.h"

namespace spindle::cuda {

namespace {

cpu::HcShape hc_shape(const ModelConfig& c, int64_t L) {
  return {L, c.hc_mult, c.hidden_size, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters};
}

// The site's mix (where asked for or kept), coefficients, collapsed input and normalised sublayer
// input; combined: the combine's backward came in the same pass (site_inputs' combine_grad).
struct SiteActivations {
  DeviceBuffer<float> mix, pre, post, comb;
  DeviceBuffer<bf16> collapsed, normed;
  bool combined = false;
};

// With `kept` holding a site's mix (taken), the coefficients come from it; else from the product,
// which writes the mix out where `with_mix`. `combine_grad`: the backward's, computed in the same pass
// where the coefficients come from the kept mix and hc_site_backward_fused.
SiteActivations site_inputs(Context& ctx, const ModelConfig& c, const HyperConnectionWeights& hc,
                            const Tensor& norm, int64_t L, const bf16* streams, bool with_mix,
                            SiteMix* kept = nullptr, const HcCombineGrad* combine_grad = nullptr) {
  const int64_t H = c.hc_mult, D = c.hidden_size;
  const cpu::HcShape shape = hc_shape(c, L);
  const TimedScope timed = ctx.timed("mhc");
  SiteActivations a;
  const bool from_mix = kept != nullptr && kept->mix.size() != 0;
  if (from_mix) {
    check(kept->mix.size() == static_cast<size_t>(hc_mix_floats(shape)), "residual site: a kept mix of ",
          kept->mix.size(), " values for ", L, " tokens");
    a.mix = std::move(kept->mix);
  } else if (with_mix) {
    a.mix = activations_f32(hc_mix_floats(shape));
  }
  a.pre = activations_f32(L * H);
  a.post = activations_f32(L * H);
  a.comb = activations_f32(L * H * H);
  a.collapsed = activations(L * D);
  a.normed = activations(L * D);
  const HcNorm site_norm{bf16_data(norm), a.normed.data(), static_cast<float>(c.rms_norm_eps)};
  a.combined = from_mix && combine_grad != nullptr &&
               hc_site_backward_fused(shape, streams, a.collapsed.data(), site_norm, *combine_grad);
  if (a.combined) {
    hc_site_backward_inputs(shape, streams, a.mix.data(), f32_data(hc.base), f32_data(hc.scale), a.pre.data(),
                            a.post.data(), a.comb.data(), a.collapsed.data(), site_norm, *combine_grad,
                            ctx.stream());
  } else if (from_mix) {
    hc_coefficients_from_mix(shape, streams, a.mix.data(), f32_data(hc.base), f32_data(hc.scale),
                             a.pre.data(), a.post.data(), a.comb.data(), a.collapsed.data(), site_norm,
                             ctx.stream());
  } else {
    hc_coefficients(shape, streams, f32_data(hc.fn), f32_data(hc.base), f32_data(hc.scale), a.pre.data(),
                    a.post.data(), a.comb.data(), a.collapsed.data(), site_norm, ctx.stream(),
                    with_mix ? a.mix.data() : nullptr);
  }
  ctx.record.note("mhc", "cuda 64-token tiles (Sinkhorn in fp32)");
  ctx.record.note("mhc/norm", hc_norm_fused(shape, streams, a.collapsed.data(), site_norm)
                                  ? "cuda in the collapse"
                                  : "cuda rms_norm_forward after the collapse (hidden not a multiple of 8, "
                                    "or rows not 16-byte aligned)");
  return a;
}

}  // namespace

void residual_site_forward(Context& ctx, const ModelConfig& c, const HyperConnectionWeights& hc,
                           const Tensor& norm, int64_t L, const bf16* streams, bf16* next,
                           const SublayerForward& sublayer, DeviceBuffer<bf16>* keep_y, SiteMix* keep_mix,
                           SiteChain* chain, SiteCombine* keep_combine) {
  const cpu::HcShape shape = hc_shape(c, L);
  SiteMix* handed = chain != nullptr && chain->mix.mix.size() != 0 ? &chain->mix : nullptr;
  SiteActivations a = site_inputs(ctx, c, hc, norm, L, streams, keep_mix != nullptr, handed);
  sublayer(a.normed.data(), a.collapsed.data());  // the sublayer output reuses `collapsed`
  const TimedScope timed = ctx.timed("mhc");
  const bf16* y = a.collapsed.data();
  if (next == nullptr) {
    if (chain != nullptr) chain->mix = SiteMix();
  } else if (chain != nullptr && chain->next != nullptr &&
             hc_combine_mix_supported(shape, streams, y, next)) {
    chain->mix.mix = activations_f32(hc_mix_floats(shape));
    hc_combine_mix(shape, streams, y, a.post.data(), a.comb.data(), next, f32_data(chain->next->fn),
                   chain->mix.mix.data(), ctx.stream());
    ctx.record.note("mhc/combine", "cuda combine with the next site's mix (hc_combine_mix)");
  } else {
    hc_combine(shape, streams, y, a.post.data(), a.comb.data(), next, ctx.stream());
    if (chain != nullptr) chain->mix = SiteMix();
  }
  if (keep_y != nullptr) *keep_y = std::move(a.collapsed);
  if (keep_mix != nullptr) *keep_mix = SiteMix{std::move(a.mix)};
  if (keep_combine != nullptr) *keep_combine = SiteCombine{std::move(a.post), std::move(a.comb)};
}

void residual_site_output(Context& ctx, const ModelConfig& c, int64_t L, const bf16* streams, const bf16* y,
                          const SiteCombine& combine, bf16* next) {
  const int64_t H = c.hc_mult;
  check(combine.post.size() == static_cast<size_t>(L * H) &&
            combine.comb.size() == static_cast<size_t>(L * H * H),
        "residual site output: kept coefficients of ", combine.post.size(), " and ", combine.comb.size(),
        " values for ", L, " tokens");
  const TimedScope timed = ctx.timed("mhc");
  hc_combine(hc_shape(c, L), streams, y, combine.post.data(), combine.comb.data(), next, ctx.stream());
}

void residual_site_backward(Context& ctx, const ModelConfig& c, const HyperConnectionWeights& hc,
                            const Tensor& norm, int64_t L, const bf16* streams, DeviceBuffer<bf16>& dstreams,
                            HyperConnectionWeights& ghc, Tensor& gnorm, const SublayerForward& sublayer,
                            const SublayerBackward& sublayer_backward, DeviceBuffer<bf16>* kept_y,
                            SiteMix* kept_mix) {
  const int64_t H = c.hc_mult, D = c.hidden_size;
  const cpu::HcShape shape = hc_shape(c, L);
  const cudaStream_t s = ctx.stream();
  const bool y_kept = kept_y != nullptr && kept_y->size() != 0;
  check(!y_kept || kept_y->size() == static_cast<size_t>(L * D), "residual site backward: a kept output of ",
        y_kept ? kept_y->size() : 0, " values for ", L, " tokens");
  DeviceBuffer<bf16> y = y_kept ? std::move(*kept_y) : activations(L * D);
  // The combine's backward: with y kept, in the site inputs' pass over the streams where it can
  // (its outputs allocated first), else a pass of its own once the sublayer has made y again.
  DeviceBuffer<bf16> dy;
  DeviceBuffer<float> d_post, d_comb;
  const auto combine_outputs = [&] {
    dy = activations(L * D);
    d_post = activations_f32(L * H);
    d_comb = activations_f32(L * H * H);
  };
  if (y_kept) combine_outputs();
  const HcCombineGrad combine_grad{dstreams.data(), y.data(), dy.data(), d_comb.data(), d_post.data()};
  SiteActivations a =
      site_inputs(ctx, c, hc, norm, L, streams, true, kept_mix, y_kept ? &combine_grad : nullptr);
  if (sublayer && !y_kept) sublayer(a.normed.data(), y.data());
  const bool y_before = sublayer || y_kept;  // else the sublayer's backward recomputes it

  DeviceBuffer<bf16> d_in = activations(L * H * D);
  DeviceBuffer<float> d_normed = activations_f32(L * D);
  if (!y_kept) combine_outputs();
  ctx.record.note("mhc/combine_backward",
                  a.combined ? "cuda in the site inputs' pass over the streams (hc_site_backward_inputs)"
                             : "cuda hc_combine_backward, a pass of its own");
  if (!a.combined) {
    const TimedScope timed = ctx.timed("mhc");
    // d_post comes here, while dout is read anyway, when y is known already (kept, or recomputed above).
    // The combine's part of the streams' gradient comes with the coefficients' below (d_in written once).
    hc_combine_backward(shape, streams, a.post.data(), a.comb.data(), dstreams.data(), nullptr, dy.data(),
                        d_comb.data(), s, y_before ? y.data() : nullptr, y_before ? d_post.data() : nullptr);
  }
  sublayer_backward(a.normed.data(), dy.data(), d_normed.data(), y_before ? nullptr : y.data());
  const TimedScope timed = ctx.timed("mhc");
  if (!y_before) hc_post_gradient(shape, y.data(), dstreams.data(), d_post.data(), s);

  DeviceBuffer<bf16>& d_collapsed = dy;
  rms_norm_backward(a.collapsed.data(), bf16_data(norm), d_normed.data(), d_collapsed.data(), f32_data(gnorm),
                    L, D, static_cast<float>(c.rms_norm_eps), s);
  DeviceBuffer<float> workspace = activations_f32(hc_coefficients_backward_workspace(shape));
  hc_coefficients_backward(shape, streams, a.mix.data(), f32_data(hc.fn), f32_data(hc.base),
                           f32_data(hc.scale), nullptr, d_post.data(), d_comb.data(), d_collapsed.data(),
                           a.comb.data(), dstreams.data(), d_in.data(), f32_data(ghc.fn), f32_data(ghc.base),
                           f32_data(ghc.scale), workspace.data(), s);
  dstreams = std::move(d_in);
}

}  // namespace spindle::cuda
