// The row normalisations, the short convolution and KDA's decay at the shapes a streamed 16k chunk
// of the 4B config gives them (16,384 tokens by default): each timed by CUDA events (median of a few
// launches), with the bytes it must move at the least and the bandwidth that makes.
//     build/bench_norms [tokens]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "cuda_timing.cuh"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/kda_gates.h"
#include "kernels/cuda/norms.h"

using namespace spindle;
using namespace spindle::cuda;

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 16384;
  const int64_t D = 2048, heads = 16, head_dim = 128, kv_rank = 512, q_rank = 1024, conv = 4;
  auto x = random_bf16(T * D, 1), dy = random_bf16(T * D, 2), gate = random_bf16(T * D, 3),
       w = random_bf16(D, 4);
  auto dy32 = random_f32(T * D, 5, -1, 1), dw = random_f32(D, 6, -1, 1),
       taps = random_f32(D * conv, 7, -1, 1);
  DeviceBuffer<__nv_bfloat16> y(static_cast<size_t>(T * D), MemoryCategory::Activations),
      dx(static_cast<size_t>(T * D), MemoryCategory::Activations),
      dgate(static_cast<size_t>(T * D), MemoryCategory::Activations);
  SPINDLE_CUDA(cudaDeviceSynchronize());
  const float eps = 1e-6f;
  std::printf("Row norms and the short conv at %lld tokens (least bytes each must move; GB/s):\n",
              static_cast<long long>(T));
  const auto report = [&](const char* name, double bytes, double ms) {
    std::printf("  %-44s %8.3f ms  %7.0f MB  %6.0f GB/s\n", name, ms, bytes / 1e6, bytes / ms / 1e6);
  };
  const auto time = [](const auto& run) { return median_ms(run, 10); };
  // A residual site's norm (rows of the hidden size), DSA's latent norms, KDA's gated output norm.
  for (const int64_t width : {D, q_rank, kv_rank}) {
    const int64_t rows = T * D / width;
    const double row_bytes = 2.0 * T * D;
    char name[64];
    std::snprintf(name, sizeof(name), "rms_norm_forward, rows of %lld", static_cast<long long>(width));
    report(name, 2 * row_bytes,
           time([&] { rms_norm_forward(x.data(), w.data(), y.data(), rows, width, eps, nullptr); }));
    std::snprintf(name, sizeof(name), "rms_norm_backward, rows of %lld", static_cast<long long>(width));
    report(name, 3 * row_bytes, time([&] {
             rms_norm_backward(x.data(), w.data(), dy.data(), dx.data(), dw.data(), rows, width, eps,
                               nullptr);
           }));
  }
  report("rms_norm_backward, fp32 dy, rows of 2048", 2.0 * T * D * 4, time([&] {
           rms_norm_backward(x.data(), w.data(), dy32.data(), dx.data(), dw.data(), T, D, eps, nullptr);
         }));
  report("gated_rms_norm_forward, rows of 128", 2.0 * T * D * 3, time([&] {
           gated_rms_norm_forward(x.data(), w.data(), gate.data(), y.data(), T * heads, head_dim, eps,
                                  nullptr);
         }));
  report("gated_rms_norm_backward, rows of 128", 2.0 * T * D * 5, time([&] {
           gated_rms_norm_backward(x.data(), w.data(), gate.data(), dy.data(), dx.data(), dgate.data(),
                                   dw.data(), T * heads, head_dim, eps, nullptr);
         }));
  report("causal_conv_silu, 2048 channels", 2.0 * T * D * 2,
         time([&] { causal_conv_silu(x.data(), D, taps.data(), y.data(), T, D, conv, nullptr); }));
  // dw holds the taps' gradient, channels x K (the norms' dw above has only D values).
  auto dtaps = random_f32(D * conv, 11, -1, 1);
  report("causal_conv_silu_backward, 2048 channels", 2.0 * T * D * 3, time([&] {
           causal_conv_silu_backward(x.data(), D, taps.data(), dy.data(), dx.data(), D, dtaps.data(), T, D,
                                     conv, nullptr);
         }));
  {
    // As the KDA layer calls them: x in the k columns of the projections side by side (q, k, v, then
    // the two low-rank: rows 3 D + 2 head_dim = 6400 values apart at the 4B config), the backward's
    // dx into the k columns of the stacked gradients (b's too: rows 6416 apart).
    const int64_t x_ld = 3 * D + 2 * head_dim, ld = x_ld + heads;
    auto projected = random_bf16(T * x_ld, 12);
    DeviceBuffer<__nv_bfloat16> stacked(static_cast<size_t>(T * ld), MemoryCategory::Activations);
    report("causal_conv_silu, x rows 6400 apart", 2.0 * T * D * 2, time([&] {
             causal_conv_silu(projected.data() + D, x_ld, taps.data(), y.data(), T, D, conv, nullptr);
           }));
    // q's and k's: their l2 norms (heads of 128) on their own, then in the conv's pass (the window's
    // carried rows skipped).
    report("l2_normalize_forward, rows of 128", 2.0 * T * D * 2,
           time([&] { l2_normalize_forward(y.data(), dx.data(), T * heads, head_dim, eps, 1.0f, nullptr); }));
    report("causal_conv_silu_l2, x rows 6400 apart", 2.0 * T * D * 2, time([&] {
             causal_conv_silu_l2(projected.data(), x_ld, taps.data(), dx.data(), conv - 1, T, D, conv,
                                 head_dim, eps, 1.0f, nullptr);
           }));
    report("causal_conv_silu_backward, x, dx strided", 2.0 * T * D * 3, time([&] {
             causal_conv_silu_backward(projected.data() + D, x_ld, taps.data(), dy.data(), stacked.data() + D,
                                       ld, dtaps.data(), T, D, conv, nullptr);
           }));
    // Their backward: the norm's on its own, then inside the conv's backward's pass.
    report("l2_normalize_backward, rows of 128", 2.0 * T * D * 3, time([&] {
             l2_normalize_backward(y.data(), dy.data(), dx.data(), T * heads, head_dim, eps, 1.0f, nullptr);
           }));
    report("causal_conv_silu_l2_backward, x, dx strided", 2.0 * T * D * 3, time([&] {
             causal_conv_silu_l2_backward(projected.data() + D, x_ld, taps.data(), dy.data(), conv - 1,
                                          stacked.data() + D, ld, dtaps.data(), T, D, conv, head_dim, eps,
                                          1.0f, nullptr);
           }));
  }
  // The decay over fp32 [T, 2048] (the 4B config: no lower bound, the softplus form; with one, the
  // sigmoid form); the backward writes bf16 df.
  auto f = random_f32(T * D, 8, -4, 4), bias = random_f32(D, 9, -1, 1), a_log = random_f32(heads, 10, -1, 1);
  DeviceBuffer<float> g(static_cast<size_t>(T * D), MemoryCategory::Activations),
      d_bias(static_cast<size_t>(D), MemoryCategory::Gradients),
      d_a_log(static_cast<size_t>(heads), MemoryCategory::Gradients);
  for (const bool bounded : {false, true}) {
    const KdaDecayShape s{T, heads, head_dim, bounded, -5.0f};
    report(bounded ? "kda_decay_forward, bounded" : "kda_decay_forward", 2.0 * T * D * 4,
           time([&] { kda_decay_forward(s, f.data(), bias.data(), a_log.data(), g.data(), nullptr); }));
    report(bounded ? "kda_decay_backward, bounded" : "kda_decay_backward", 2.0 * T * D * 5, time([&] {
             kda_decay_backward(s, f.data(), bias.data(), a_log.data(), dy32.data(), dx.data(), d_bias.data(),
                                d_a_log.data(), nullptr);
           }));
  }
  return 0;
}
