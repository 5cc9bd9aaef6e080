// The chunked KDA kernels against the CPU token-by-token reference (double, on the same
// bf16-rounded inputs), on fresh random inputs; every output is NaN-poisoned first.
// Bounds: the bf16 output 1e-2 (one bf16 rounding is ~3e-3 relative; fp32 math adds far less);
// the fp32 chunk states and gradients 1e-3: both sides see the same rounded inputs, so only fp32
// arithmetic differs (expected ~1e-6 .. 1e-5: the log decays in [-0.5, 0] make the recurrence
// contract, so rounding does not build up over the 4096-token case).
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "gpu_test_util.h"
#include "kernels/cpu/kda.h"
#include "kernels/cuda/kda.h"

namespace spindle::cuda {
namespace {

constexpr double kBf16Bound = 1e-2;
constexpr double kFp32Bound = 1e-3;

std::vector<float> uniform_floats(size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> uniform(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = uniform(rng());
  return v;
}

// Rows of `width` scaled to norm `scale`.
void normalise_rows(std::vector<float>& x, int64_t width, float scale) {
  for (size_t r = 0; r < x.size() / static_cast<size_t>(width); ++r) {
    double norm = 0;
    for (int64_t i = 0; i < width; ++i) norm += double(x[r * width + i]) * x[r * width + i];
    const float f = scale / static_cast<float>(std::sqrt(norm) + 1e-6);
    for (int64_t i = 0; i < width; ++i) x[r * width + i] *= f;
  }
}

TEST(CudaKda, ChunkedForwardAndBackwardMatchRecurrence) {
  // (tokens, heads, dk, dv): a partial last chunk, non-multiples of 64, the largest head dims, a
  // single token, and a long sequence.
  for (auto [T, H, dk, dv] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{200, 2, 16, 16},
                              {257, 3, 64, 64},
                              {64, 1, 128, 128},
                              {1, 2, 32, 32},
                              {4096, 2, 64, 64}}) {
    auto qf = random_floats(T * H * dk), kf = random_floats(T * H * dk);
    normalise_rows(qf, dk, 1.0f / std::sqrt(static_cast<float>(dk)));
    normalise_rows(kf, dk, 1.0f);
    const auto q = rounded(qf), k = rounded(kf), v = rounded(random_floats(T * H * dv));
    const auto dout = rounded(random_floats(T * H * dv));
    const auto g = uniform_floats(T * H * dk, -0.5f, 0.0f);
    const auto beta = uniform_floats(T * H, 1e-3f, 1.0f - 1e-3f);
    const int64_t chunks = kda_chunks(T), SS = dk * dv;

    Stream stream;
    auto qb = device(to_bf16(q)), kb = device(to_bf16(k)), vb = device(to_bf16(v)),
         dob = device(to_bf16(dout));
    auto gb = device(g), bb = device(beta);
    auto out = poisoned<bf16>(T * H * dv);
    auto states = poisoned<float>((chunks + 1) * H * SS);
    auto dq = poisoned<float>(T * H * dk), dk_ = poisoned<float>(T * H * dk),
         dv_ = poisoned<float>(T * H * dv);
    auto dg = poisoned<float>(T * H * dk), dbeta = poisoned<float>(T * H);
    DeviceBuffer<float> workspace(kda_backward_workspace_floats(H, dk, dv), MemoryCategory::Activations);
    SPINDLE_CUDA(cudaDeviceSynchronize());  // the poisoning memsets ran on the legacy stream
    kda_chunked_forward(qb.data(), kb.data(), vb.data(), gb.data(), bb.data(), out.data(), states.data(), T,
                        H, dk, dv, stream.get());
    kda_chunked_backward(qb.data(), kb.data(), vb.data(), gb.data(), bb.data(), dob.data(), states.data(),
                         dq.data(), dk_.data(), dv_.data(), dg.data(), dbeta.data(), workspace.data(), T, H,
                         dk, dv, stream.get());
    stream.synchronize();

    const auto qd = to_double(q), kd = to_double(k), vd = to_double(v), gd = to_double(g),
               bd = to_double(beta), dod = to_double(dout);
    // The reference chunk by chunk (tokens are the outer dimension), keeping each entry state.
    std::vector<double> out_ref(T * H * dv), state(H * SS, 0.0), states_ref;
    for (int64_t c = 0; c < chunks; ++c) {
      states_ref.insert(states_ref.end(), state.begin(), state.end());
      const int64_t t0 = c * kKdaChunk, n = std::min(kKdaChunk, T - t0);
      cpu::kda_recurrence<double>({n, H, dk, dv}, qd.data() + t0 * H * dk, kd.data() + t0 * H * dk,
                                  vd.data() + t0 * H * dv, gd.data() + t0 * H * dk, bd.data() + t0 * H,
                                  out_ref.data() + t0 * H * dv, state.data());
    }
    states_ref.insert(states_ref.end(), state.begin(), state.end());
    std::vector<double> dq_ref(T * H * dk), dk_ref(T * H * dk), dv_ref(T * H * dv), dg_ref(T * H * dk),
        dbeta_ref(T * H);
    cpu::kda_recurrence_backward<double>({T, H, dk, dv}, qd.data(), kd.data(), vd.data(), gd.data(),
                                         bd.data(), dod.data(), dq_ref.data(), dk_ref.data(), dv_ref.data(),
                                         dg_ref.data(), dbeta_ref.data());

    const auto where = [&] {
      return testing::Message() << " T=" << T << " H=" << H << " dk=" << dk << " dv=" << dv;
    };
    EXPECT_LT(relative_error(out.download(), out_ref), kBf16Bound) << "out" << where();
    EXPECT_LT(relative_error(states.download(), states_ref), kFp32Bound) << "chunk states" << where();
    EXPECT_LT(relative_error(dq.download(), dq_ref), kFp32Bound) << "dq" << where();
    EXPECT_LT(relative_error(dk_.download(), dk_ref), kFp32Bound) << "dk" << where();
    EXPECT_LT(relative_error(dv_.download(), dv_ref), kFp32Bound) << "dv" << where();
    EXPECT_LT(relative_error(dg.download(), dg_ref), kFp32Bound) << "dg" << where();
    EXPECT_LT(relative_error(dbeta.download(), dbeta_ref), kFp32Bound) << "dbeta" << where();
  }
}

}  // namespace
}  // namespace spindle::cuda
