// The mHC kernels at one streamed chunk of the 4B config (hc_mult 4, hidden 2048, 20 Sinkhorn
// iterations; 16,384 tokens by default): each entry point of kernels/cuda/mhc.h timed by CUDA
// events (median of a few launches), with the bytes it must move at the least (the budgets in
// mhc.cu's header: streams and their gradients bf16) and the bandwidth that makes. A residual
// site's backward runs hc_coefficients once more (or, from the mix a recomputation kept,
// hc_coefficients_from_mix) and each of the backward kernels once; its forward hc_coefficients and
// hc_combine.
//     build/bench_mhc [tokens]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "cuda_timing.cuh"
#include "kernels/cuda/mhc.h"
#include "kernels/cuda/norms.h"

using namespace spindle;
using namespace spindle::cuda;

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 16384;
  const int64_t H = 4, D = 2048, K = H * D, M = (2 + H) * H;
  const cpu::HcShape s{T, H, D, 1e-6, 1e-6, 20};
  auto streams = random_bf16(T * K, 1), y = random_bf16(T * D, 2), d_collapsed = random_bf16(T * D, 3);
  auto norm_weight = random_bf16(D, 18);
  const float fn_scale = 1.0f / std::sqrt(static_cast<float>(K));
  auto fn = random_f32(M * K, 4, -fn_scale, fn_scale), base = random_f32(M, 5, -0.5f, 0.5f),
       scale = random_f32(3, 6, 0.5f, 1.5f);
  auto pre = random_f32(T * H, 7, 0, 1), post = random_f32(T * H, 8, 0, 1),
       comb = random_f32(T * H * H, 9, 0, 1);
  auto dout = random_bf16(T * K, 10), dstreams = random_bf16(T * K, 11);
  auto d_pre = random_f32(T * H, 12, -1, 1), d_post = random_f32(T * H, 13, -1, 1),
       d_comb = random_f32(T * H * H, 14, -1, 1);
  auto dfn = random_f32(M * K, 15, -1, 1), dbase = random_f32(M, 16, -1, 1),
       dscale = random_f32(3, 17, -1, 1);
  DeviceBuffer<__nv_bfloat16> collapsed(static_cast<size_t>(T * D), MemoryCategory::Activations),
      normed(static_cast<size_t>(T * D), MemoryCategory::Activations),
      out(static_cast<size_t>(T * K), MemoryCategory::Activations),
      dy(static_cast<size_t>(T * D), MemoryCategory::Activations);
  DeviceBuffer<float> workspace(static_cast<size_t>(hc_coefficients_backward_workspace(s)),
                                MemoryCategory::Workspace),
      mix(static_cast<size_t>(hc_mix_floats(s)), MemoryCategory::Activations);
  SPINDLE_CUDA(cudaDeviceSynchronize());

  const double bf16_streams = 2.0 * T * K, row = 2.0 * T * D;  // the streams' gradients bf16 as well
  std::printf("mHC at %lld tokens, hc_mult %lld, hidden %lld (least bytes each must move; GB/s):\n",
              static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(D));
  const auto report = [&](const char* name, double bytes, double ms) {
    std::printf("  %-30s %8.3f ms  %7.0f MB  %6.0f GB/s\n", name, ms, bytes / 1e6, bytes / ms / 1e6);
  };
  report("hc_coefficients", bf16_streams + row,
         median_ms(
             [&] {
               hc_coefficients(s, streams.data(), fn.data(), base.data(), scale.data(), pre.data(),
                               post.data(), comb.data(), collapsed.data(), {}, nullptr);
             },
             5));
  // As a recomputation or a site's backward runs it: the mix written out.
  report("hc_coefficients, writing the mix", bf16_streams + row,
         median_ms(
             [&] {
               hc_coefficients(s, streams.data(), fn.data(), base.data(), scale.data(), pre.data(),
                               post.data(), comb.data(), collapsed.data(), {}, nullptr, mix.data());
             },
             5));
  // As a site's backward runs it from the mix the recomputation kept.
  report("hc_coefficients_from_mix", bf16_streams + row,
         median_ms(
             [&] {
               hc_coefficients_from_mix(s, streams.data(), mix.data(), base.data(), scale.data(), pre.data(),
                                        post.data(), comb.data(), collapsed.data(), {}, nullptr);
             },
             5));
  // With the site's norm, as the model runs it (HcNorm): in the collapse, against a pass of its own.
  const HcNorm norm{norm_weight.data(), normed.data(), 1e-6f};
  // Each coefficient kernel with the norm's own pass after it (HcNorm{}), and with the norm fused.
  const auto from_mix = [&](const HcNorm& n) {
    hc_coefficients_from_mix(s, streams.data(), mix.data(), base.data(), scale.data(), pre.data(),
                             post.data(), comb.data(), collapsed.data(), n, nullptr);
  };
  const auto mixing = [&](const HcNorm& n) {
    hc_coefficients(s, streams.data(), fn.data(), base.data(), scale.data(), pre.data(), post.data(),
                    comb.data(), collapsed.data(), n, nullptr, mix.data());
  };
  const auto norm_pass = [&] {
    rms_norm_forward(collapsed.data(), norm.weight, norm.normed, T, D, norm.eps, nullptr);
  };
  report("from_mix + rms_norm_forward", bf16_streams + 3 * row,
         median_ms(
             [&] {
               from_mix({});
               norm_pass();
             },
             5));
  report("from_mix, normed in the collapse", bf16_streams + 2 * row, median_ms([&] { from_mix(norm); }, 5));
  report("mix + rms_norm_forward", bf16_streams + 3 * row,
         median_ms(
             [&] {
               mixing({});
               norm_pass();
             },
             5));
  report("mix, normed in the collapse", bf16_streams + 2 * row, median_ms([&] { mixing(norm); }, 5));
  report("hc_combine", 2 * bf16_streams + row,
         median_ms(
             [&] { hc_combine(s, streams.data(), y.data(), post.data(), comb.data(), out.data(), nullptr); },
             5));
  // The combine with the next site's mix of its output (the forward passes' form since it exists):
  // against hc_combine + hc_coefficients, which reads the output again for the mix.
  report("hc_combine_mix", 2 * bf16_streams + row,
         median_ms(
             [&] {
               hc_combine_mix(s, streams.data(), y.data(), post.data(), comb.data(), out.data(), fn.data(),
                              mix.data(), nullptr);
             },
             5));
  report("hc_combine_backward", 3 * bf16_streams + row,
         median_ms(
             [&] {
               hc_combine_backward(s, streams.data(), post.data(), comb.data(), dout.data(), dstreams.data(),
                                   dy.data(), d_comb.data(), nullptr);
             },
             5));
  // As the model runs it where y is known before the combine's backward: d_post in the same pass.
  report("hc_combine_backward + d_post", 3 * bf16_streams + 2 * row,
         median_ms(
             [&] {
               hc_combine_backward(s, streams.data(), post.data(), comb.data(), dout.data(), dstreams.data(),
                                   dy.data(), d_comb.data(), nullptr, y.data(), d_post.data());
             },
             5));
  // As the model runs it: the streams' gradient left to the coefficients' stream pass.
  report("hc_combine_backward + d_post, no dstreams", 2 * bf16_streams + 2 * row,
         median_ms(
             [&] {
               hc_combine_backward(s, streams.data(), post.data(), comb.data(), dout.data(), nullptr,
                                   dy.data(), d_comb.data(), nullptr, y.data(), d_post.data());
             },
             5));
  // A site's backward inputs as the model runs them where y is kept: the two calls, and one pass.
  report("from_mix normed + combine bwd", 3 * bf16_streams + 4 * row,
         median_ms(
             [&] {
               from_mix(norm);
               hc_combine_backward(s, streams.data(), post.data(), comb.data(), dout.data(), nullptr,
                                   dy.data(), d_comb.data(), nullptr, y.data(), d_post.data());
             },
             5));
  report("hc_site_backward_inputs", 2 * bf16_streams + 4 * row,
         median_ms(
             [&] {
               hc_site_backward_inputs(s, streams.data(), mix.data(), base.data(), scale.data(), pre.data(),
                                       post.data(), comb.data(), collapsed.data(), norm,
                                       {dout.data(), y.data(), dy.data(), d_comb.data(), d_post.data()},
                                       nullptr);
             },
             5));
  report("hc_post_gradient", bf16_streams + row,
         median_ms([&] { hc_post_gradient(s, y.data(), dout.data(), d_post.data(), nullptr); }, 5));
  report("hc_coefficients_backward", 3 * bf16_streams + row,
         median_ms(
             [&] {
               hc_coefficients_backward(s, streams.data(), mix.data(), fn.data(), base.data(), scale.data(),
                                        d_pre.data(), d_post.data(), d_comb.data(), d_collapsed.data(),
                                        nullptr, nullptr, dstreams.data(), dfn.data(), dbase.data(),
                                        dscale.data(), workspace.data(), nullptr);
             },
             5));
  // As the model runs it: dstreams written from the combine's dout and comb as well.
  report("hc_coefficients_backward + comb^T dout", 3 * bf16_streams + row,
         median_ms(
             [&] {
               hc_coefficients_backward(s, streams.data(), mix.data(), fn.data(), base.data(), scale.data(),
                                        d_pre.data(), d_post.data(), d_comb.data(), d_collapsed.data(),
                                        comb.data(), dout.data(), dstreams.data(), dfn.data(), dbase.data(),
                                        dscale.data(), workspace.data(), nullptr);
             },
             5));
  return 0;
}
