// The MoE routing after the router's product, at one streamed chunk of the 4B config (16
// experts, top-4, hidden 2048, 16,384 tokens), as model/cuda/moe.cpp's route() queues it: the
// router's choice (route_tokens), the expert-sorted permutation with its inverse and the offsets
// on the host (ExpertPermutation::build), the gather of the rows. Timed by CUDA events (median of a
// few runs): each part alone, then the whole with the host's wait for the offsets (which the gather
// runs under), and the digests of the permutation and the rows (equal digests: the same routing).
//     build/bench_moe_route [tokens] [experts] [topk]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/device_memory.h"
#include "cuda_timing.cuh"
#include "kernels/cuda/moe_dispatch.h"
#include "kernels/cuda/moe_ops.h"

using namespace spindle;
using namespace spindle::cuda;

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 16384;
  const int64_t E = argc > 2 ? std::atoll(argv[2]) : 16;
  const int64_t K = argc > 3 ? std::atoll(argv[3]) : 4;
  constexpr int64_t D = 2048;
  constexpr int kRepeats = 21;
  const int64_t n = tokens * K;
  const cpu::RouterShape shape{tokens, E, 1, 1, K, true, 2.5};
  auto x = random_bf16(tokens * D, 1);
  auto logits = random_f32(tokens * E, 2, -4.0f, 4.0f), bias = random_f32(E, 3, -0.1f, 0.1f);
  const auto ints = [](int64_t count) {
    return DeviceBuffer<int32_t>(static_cast<size_t>(count), MemoryCategory::Activations);
  };
  DeviceBuffer<int32_t> expert = ints(n), permutation = ints(n), inverse = ints(n);
  DeviceBuffer<float> weight(static_cast<size_t>(n), MemoryCategory::Activations);
  DeviceBuffer<__nv_bfloat16> rows(static_cast<size_t>(n * D), MemoryCategory::Activations);
  ExpertPermutation sorter;
  SPINDLE_CUDA(cudaDeviceSynchronize());

  const cudaStream_t s = nullptr;  // the legacy stream, which median_ms' events time
  const auto route = [&] {
    route_tokens(shape, logits.data(), bias.data(), expert.data(), weight.data(), s);
  };
  const auto sort = [&] { sorter.build(expert.data(), n, E, permutation.data(), inverse.data(), s); };
  const auto gather = [&] { gather_expert_rows(x.data(), inverse.data(), tokens, K, D, rows.data(), s); };
  std::printf("%lld tokens, %lld experts, top-%lld, hidden %lld:\n", static_cast<long long>(tokens),
              static_cast<long long>(E), static_cast<long long>(K), static_cast<long long>(D));
  std::printf("  route_tokens                  %7.1f us\n", 1e3 * median_ms(route, kRepeats));
  std::printf("  permutation (build)           %7.1f us\n", 1e3 * median_ms(sort, kRepeats));
  std::printf("  gather                        %7.1f us\n", 1e3 * median_ms(gather, kRepeats));
  const double whole = median_ms(
      [&] {
        route();
        sort();
        gather();
        const std::vector<int32_t> offsets = sorter.host_offsets();
        check(offsets.back() == n, "bench_moe_route: offsets end at ", offsets.back(), ", not ", n);
      },
      kRepeats);
  std::printf("  route, build, gather + wait   %7.1f us\n", 1e3 * whole);
  std::printf("  digests: permutation %016llx, rows %016llx\n",
              static_cast<unsigned long long>(bits_digest(permutation.data(), n)),
              static_cast<unsigned long long>(bits_digest(rows.data(), n * D)));
  return 0;
}
