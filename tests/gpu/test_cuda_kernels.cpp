// Every CUDA kernel against the CPU reference on fresh random inputs: relative error within
// bf16 bounds, no NaN, every output element written (outputs are poisoned with NaN first).
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "gpu_test_util.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/norms.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/norms.h"
#include "kernels/cuda/ops.h"

namespace spindle::cuda {
namespace {

TEST(CudaKernels, RmsNormForwardAndBackward) {
  for (int64_t D : {64, 1000, 4096}) {
    const int64_t rows = 333;
    const auto x = rounded(random_floats(rows * D)), w = rounded(random_floats(D, 0.5f));
    const auto dy = rounded(random_floats(rows * D));
    const auto dx_gpu = [&] {
      Stream stream;
      auto dxb = device(to_bf16(x)), dwb = device(to_bf16(w)), dyb = device(to_bf16(dy));
      auto y = poisoned<bf16>(rows * D), dx = poisoned<bf16>(rows * D);
      DeviceBuffer<float> dweight(D, MemoryCategory::Gradients);
      SPINDLE_CUDA(cudaMemset(dweight.data(), 0, D * sizeof(float)));
      rms_norm_forward(dxb.data(), dwb.data(), y.data(), rows, D, 1e-5f, stream.get());
      rms_norm_backward(dxb.data(), dwb.data(), dyb.data(), dx.data(), dweight.data(), rows, D, 1e-5f,
                        stream.get());
      stream.synchronize();
      return std::make_tuple(y.download(), dx.download(), dweight.download());
    }();
    // Reference in double on the same bf16-rounded inputs.
    std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end()), dyd(dy.begin(), dy.end());
    std::vector<double> y_ref(rows * D), dx_ref(rows * D), dw_ref(D, 0.0);
    cpu::rms_norm(xd.data(), wd.data(), y_ref.data(), rows, D, 1e-5);
    cpu::rms_norm_backward(xd.data(), wd.data(), dyd.data(), dx_ref.data(), dw_ref.data(), rows, D, 1e-5);
    EXPECT_LT(relative_error(std::get<0>(dx_gpu), y_ref), 8e-3) << "forward, D=" << D;
    EXPECT_LT(relative_error(std::get<1>(dx_gpu), dx_ref), 8e-3) << "backward dx, D=" << D;
    EXPECT_LT(relative_error(std::get<2>(dx_gpu), dw_ref), 1e-4) << "backward dweight, D=" << D;
  }
}

TEST(CudaKernels, AdamWMatchesTheFormula) {
  const int64_t n = 100003;
  auto master = random_floats(n), m = random_floats(n, 0.1f), v = random_floats(n, 0.1f),
       g = random_floats(n);
  for (float& x : v) x = x * x;
  const AdamWStep s{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 7};
  Stream stream;
  auto dmaster = device(master, MemoryCategory::Optimizer), dm = device(m, MemoryCategory::Optimizer);
  auto dv = device(v, MemoryCategory::Optimizer), dg = device(g, MemoryCategory::Gradients);
  auto weight = poisoned<bf16>(n);
  adamw_update(dmaster.data(), dm.data(), dv.data(), dg.data(), weight.data(), n, s, stream.get());
  stream.synchronize();
  const auto got_master = dmaster.download();
  const auto got_weight = weight.download();
  std::vector<double> want(n);
  for (int64_t i = 0; i < n; ++i) {
    double p = master[i];
    p -= 1e-3 * 0.1 * p;
    const double mi = 0.9 * m[i] + 0.1 * g[i], vi = 0.95 * v[i] + 0.05 * double(g[i]) * g[i];
    p -= 1e-3 / (1 - std::pow(0.9, 7)) * mi / (std::sqrt(vi) / std::sqrt(1 - std::pow(0.95, 7)) + 1e-8);
    want[i] = p;
  }
  EXPECT_LT(relative_error(got_master, want), 1e-6);
  EXPECT_LT(relative_error(got_weight, want), 4e-3);
}

TEST(CudaKernels, GemmMatchesTheCpuProduct) {
  Gemm gemm;
  // 1100 and 1123 rows share a bucket (Gemm::plan): the second and the third resize the first's
  // plan, each to its own shape.
  for (auto [M, K, N] : {std::tuple<int64_t, int64_t, int64_t>{1, 64, 8},
                         {257, 320, 96},
                         {2048, 1024, 1536},
                         {1100, 320, 96},
                         {1123, 320, 96},
                         {1100, 320, 96}}) {
    const auto x = rounded(random_floats(M * K)), w = rounded(random_floats(N * K, 0.05f));
    Stream stream;
    auto dx = device(to_bf16(x)), dw = device(to_bf16(w), MemoryCategory::Weights);
    auto y16 = poisoned<bf16>(M * N);
    auto y32 = poisoned<float>(M * N);
    gemm.linear(dx.data(), dw.data(), y16.data(), M, K, N, stream.get());
    gemm.linear(dx.data(), dw.data(), y32.data(), M, K, N, stream.get());
    stream.synchronize();
    std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end()), ref(M * N);
    cpu::linear(xd.data(), wd.data(), ref.data(), M, K, N);
    EXPECT_LT(relative_error(y16.download(), ref), 6e-3) << M << "x" << K << "x" << N;
    EXPECT_LT(relative_error(y32.download(), ref), 1e-4) << M << "x" << K << "x" << N;

    // The backward products: dx = dy w (bf16, and fp32 accumulated onto a prior value) and
    // dw += dy^T x, with dy starting one row in (an operand that is not 256-byte aligned).
    const auto dy = rounded(random_floats((M + 1) * N));
    auto ddy = device(to_bf16(dy));
    const bf16* dy_rows = ddy.data() + N;
    const auto prior_dx = random_floats(M * K), prior_dw = random_floats(N * K);
    auto dx16 = poisoned<bf16>(M * K);
    auto dx32 = device(prior_dx);
    auto dw32 = device(prior_dw, MemoryCategory::Gradients);
    gemm.linear_backward_input(dy_rows, dw.data(), dx16.data(), M, K, N, stream.get());
    gemm.linear_backward_input(dy_rows, dw.data(), dx32.data(), M, K, N, 1.0f, stream.get());
    gemm.linear_backward_weight(dy_rows, dx.data(), dw32.data(), M, K, N, stream.get());
    stream.synchronize();
    std::vector<double> dyd(dy.begin() + N, dy.end()), ref_dx(M * K, 0.0), ref_dw(N * K, 0.0);
    cpu::linear_backward(xd.data(), wd.data(), dyd.data(), ref_dx.data(), ref_dw.data(), M, K, N);
    EXPECT_LT(relative_error(dx16.download(), ref_dx), 6e-3) << M << "x" << K << "x" << N;
    for (int64_t i = 0; i < M * K; ++i) ref_dx[i] += prior_dx[i];
    for (int64_t i = 0; i < N * K; ++i) ref_dw[i] += prior_dw[i];
    EXPECT_LT(relative_error(dx32.download(), ref_dx), 1e-4) << M << "x" << K << "x" << N;
    EXPECT_LT(relative_error(dw32.download(), ref_dw), 1e-4) << M << "x" << K << "x" << N;
  }
  EXPECT_GT(gemm.plan_stats().bucket_reuses, 0);
  // The 2048 x 1024 x 1536 products were large enough to be timed: the fp32 ones, accumulated onto
  // prior values, checked above, ran their timing into a scratch output.
  EXPECT_GT(gemm.plan_stats().timed, 0);
}

// A timed plan's algorithm is the process's: a second Gemm takes the first's choice untimed, and
// so computes the same bits (an expert's weight gradient, the shape whose heuristic choice was
// slowest, at a row count of its own).
TEST(CudaKernels, GemmTimedChoicesAreEveryGemmsChoices) {
  const int64_t M = 3001, K = 576, N = 2048;
  const auto dy = rounded(random_floats(M * N)), h = rounded(random_floats(M * K));
  const auto prior = random_floats(N * K);
  Stream stream;
  auto ddy = device(to_bf16(dy)), dh = device(to_bf16(h));
  std::vector<std::vector<float>> results;
  std::vector<int64_t> timed;
  for (int instance = 0; instance < 2; ++instance) {
    Gemm gemm;
    auto dw = device(prior, MemoryCategory::Gradients);
    gemm.linear_backward_weight(ddy.data(), dh.data(), dw.data(), M, K, N, stream.get());
    stream.synchronize();
    results.push_back(dw.download());
    timed.push_back(gemm.plan_stats().timed);
  }
  EXPECT_EQ(timed[0], 1);
  EXPECT_EQ(timed[1], 0);
  EXPECT_EQ(results[0], results[1]);
  std::vector<double> hd(h.begin(), h.end()), dyd(dy.begin(), dy.end()), ref_dx(M * K, 0.0),
      ref_dw(N * K, 0.0), wd(N * K, 0.0);
  cpu::linear_backward(hd.data(), wd.data(), dyd.data(), ref_dx.data(), ref_dw.data(), M, K, N);
  for (int64_t i = 0; i < N * K; ++i) ref_dw[i] += prior[i];
  EXPECT_LT(relative_error(results[0], ref_dw), 1e-4);
}

// The attention's per-head products in one launch: heads interleaved in the activations' rows
// (strides of a head's width) and spaced in the weight (W_k,h then W_v,h per head), as dsa.cpp
// lays them out; both output types, the fp32 one accumulated onto a prior value.
TEST(CudaKernels, BatchedGemmMatchesTheCpuProductPerHead) {
  Gemm gemm;
  const int64_t H = 5, L = 203, dk = 48, dv = 32, kr = 64, rows = dk + dv;
  const auto w = rounded(random_floats(H * rows * kr, 0.1f)), q = rounded(random_floats(L * H * dk)),
             o = rounded(random_floats(L * H * kr)), dout = rounded(random_floats(L * H * dv));
  const auto prior = random_floats(H * rows * kr);
  Stream stream;
  auto dw = device(to_bf16(w), MemoryCategory::Weights);
  auto dq = device(to_bf16(q)), d_o = device(to_bf16(o)), d_dout = device(to_bf16(dout));
  auto q_lat = poisoned<bf16>(L * H * kr);
  auto grad = device(prior, MemoryCategory::Gradients);
  // q_lat_h [L, kr] = q_h [L, dk] W_k,h [dk, kr]; dW_v,h [dv, kr] += dout_h^T o_h.
  gemm.matmul_batched(false, false, kr, L, dk, dw.data(), kr, rows * kr, dq.data(), H * dk, dk, q_lat.data(),
                      CUDA_R_16BF, H * kr, kr, H, 1.0f, 0.0f, stream.get());
  gemm.matmul_batched(false, true, kr, dv, L, d_o.data(), H * kr, kr, d_dout.data(), H * dv, dv,
                      grad.data() + dk * kr, CUDA_R_32F, kr, rows * kr, H, 1.0f, 1.0f, stream.get());
  stream.synchronize();
  std::vector<double> want_q(L * H * kr, 0.0), want_grad(prior.begin(), prior.end());
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < L; ++t)
      for (int64_t j = 0; j < kr; ++j) {
        double sum = 0.0;
        for (int64_t i = 0; i < dk; ++i) sum += double(q[(t * H + h) * dk + i]) * w[(h * rows + i) * kr + j];
        want_q[(t * H + h) * kr + j] = sum;
        for (int64_t i = 0; i < dv; ++i)
          want_grad[(h * rows + dk + i) * kr + j] +=
              double(dout[(t * H + h) * dv + i]) * o[(t * H + h) * kr + j];
      }
  EXPECT_LT(relative_error(q_lat.download(), want_q), 6e-3);
  EXPECT_LT(relative_error(grad.download(), want_grad), 1e-4);
}

// Every kernel launches as a programmatic dependent of the stream's previous kernel
// (kernels/cuda/launch.cuh) and waits for it first: a chain of 64 launches on a stream of their
// own, each doubling in place what the last wrote (16M values: many waves of CTAs, so that a
// launch that did not wait would read values its predecessor had not yet written), ends exactly
// at 2^64 times the input.
TEST(CudaKernels, DependentLaunchesSeeTheirPredecessorsWrites) {
  const int64_t n = int64_t{1} << 24;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> value(1.0f, 2.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = value(rng);
  DeviceBuffer<float> d(static_cast<size_t>(n), MemoryCategory::Workspace);
  d.upload(x);
  Stream stream;
  for (int i = 0; i < 64; ++i) scale_values(d.data(), n, 2.0f, stream.get());
  stream.synchronize();
  const std::vector<float> got = d.download();
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += got[i] != std::ldexp(x[i], 64);
  EXPECT_EQ(wrong, 0);
}

TEST(CudaKernels, AllocatorCachesAndCounts) {
  auto& allocator = DeviceAllocator::instance();
  const int64_t before = allocator.stats().current_total;
  {
    DeviceBuffer<float> a(1000, MemoryCategory::Workspace);
    EXPECT_GE(allocator.stats().current_total - before, 4000);
  }
  EXPECT_EQ(allocator.stats().current_total, before);
  EXPECT_GE(allocator.cached_bytes(), 4000);
  DeviceBuffer<float> again(1000, MemoryCategory::Workspace);  // served from the cache
  EXPECT_GE(allocator.stats().peak[static_cast<int>(MemoryCategory::Workspace)], 4000);
}

}  // namespace
}  // namespace spindle::cuda
