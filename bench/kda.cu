// The KDA recurrence at one streamed chunk of the 4B config (16 heads, dk = dv = 128; 16,384
// tokens by default): kda_chunked_forward (prep, state scan and output over chunks of 64) and
// kda_chunked_backward (kernels/cuda/kda.h) timed by CUDA events (median of a few launches), with
// the model FLOPs of model/flops.h (6 dk dv per token and head) for scale. The streamed step runs
// the forward twice per chunk and layer (the forward pass and the recomputation; the backward
// takes the recomputation's output and chunk states) and the backward once. Then the two as the
// streamed step runs them with kept outputs: the recomputation's forward also writes the chunk
// matrices (kept_matrices), the backward takes them.
//     build/bench_kda [tokens]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "cuda_timing.cuh"
#include "kernels/cuda/kda.h"

using namespace spindle;
using namespace spindle::cuda;

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 16384;
  const int64_t H = 16, dk = 128, dv = 128;
  auto q = random_bf16(T * H * dk, 1), k = random_bf16(T * H * dk, 2), v = random_bf16(T * H * dv, 3),
       dout = random_bf16(T * H * dv, 4);
  auto g = random_f32(T * H * dk, 5, -0.1f, 0.0f), beta = random_f32(T * H, 6, 0.0f, 1.0f);
  const auto floats = [](int64_t n) {
    return DeviceBuffer<float>(static_cast<size_t>(n), MemoryCategory::Activations);
  };
  DeviceBuffer<__nv_bfloat16> out(static_cast<size_t>(T * H * dv), MemoryCategory::Activations),
      dvv(static_cast<size_t>(T * H * dv), MemoryCategory::Activations),
      dq(static_cast<size_t>(T * H * dk), MemoryCategory::Activations),
      dkk(static_cast<size_t>(T * H * dk), MemoryCategory::Activations);
  DeviceBuffer<float> states = floats((kda_chunks(T) + 1) * H * dk * dv),
                      forward_workspace = floats(kda_forward_workspace_floats(T, H)),
                      backward_workspace = floats(kda_backward_workspace_floats(T, H, dk, dv)),
                      dg = floats(T * H * dk), dbeta = floats(T * H),
                      matrices = floats(kda_kept_matrices_floats(T, H)),
                      kept_workspace = floats(kda_backward_workspace_floats(T, H, dk, dv, true));
  SPINDLE_CUDA(cudaDeviceSynchronize());
  const double forward = median_ms(
      [&] {
        kda_chunked_forward(q.data(), k.data(), v.data(), g.data(), beta.data(), out.data(), states.data(),
                            forward_workspace.data(), T, H, dk, dv, nullptr);
      },
      5);
  const double backward = median_ms(
      [&] {
        kda_chunked_backward(q.data(), k.data(), v.data(), g.data(), beta.data(), dout.data(), states.data(),
                             dq.data(), dkk.data(), dvv.data(), dg.data(), dbeta.data(),
                             backward_workspace.data(), T, H, dk, dv, nullptr);
      },
      5);
  const double forward_keeping = median_ms(
      [&] {
        kda_chunked_forward(q.data(), k.data(), v.data(), g.data(), beta.data(), out.data(), states.data(),
                            forward_workspace.data(), T, H, dk, dv, nullptr, nullptr, matrices.data());
      },
      5);
  const double backward_kept = median_ms(
      [&] {
        kda_chunked_backward(q.data(), k.data(), v.data(), g.data(), beta.data(), dout.data(), states.data(),
                             dq.data(), dkk.data(), dvv.data(), dg.data(), dbeta.data(),
                             kept_workspace.data(), T, H, dk, dv, nullptr, nullptr, nullptr, matrices.data());
      },
      5);
  // The last launches' outputs (the forward keeping its matrices, the backward taking them).
  uint64_t forward_digest = bits_digest(out.data(), T * H * dv);
  forward_digest = bits_digest(states.data(), (kda_chunks(T) + 1) * H * dk * dv, forward_digest);
  forward_digest = bits_digest(matrices.data(), kda_kept_matrices_floats(T, H), forward_digest);
  uint64_t backward_digest = bits_digest(dq.data(), T * H * dk);
  backward_digest = bits_digest(dkk.data(), T * H * dk, backward_digest);
  backward_digest = bits_digest(dvv.data(), T * H * dv, backward_digest);
  for (const DeviceBuffer<float>* d : {&dg, &dbeta})
    backward_digest = bits_digest(d->data(), static_cast<int64_t>(d->size()), backward_digest);
  const double flops = 6.0 * static_cast<double>(dk * dv) * static_cast<double>(T * H);
  std::printf("KDA recurrence at %lld tokens, %lld heads, dk = dv = %lld (model FLOPs %.1f G):\n",
              static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(dk), flops / 1e9);
  std::printf("  forward  %8.3f ms (%.1f model TFLOP/s)\n", forward, flops / forward / 1e9);
  std::printf("  backward %8.3f ms (%.2fx the forward)\n", backward, backward / forward);
  std::printf("  with kept matrices: forward %.3f ms, backward %.3f ms\n", forward_keeping, backward_kept);
  std::printf("  output digests: forward %016llx, backward %016llx\n",
              static_cast<unsigned long long>(forward_digest),
              static_cast<unsigned long long>(backward_digest));
  return 0;
}
