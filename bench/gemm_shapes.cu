// The step's dense product shapes (from SPINDLE_GEMM_PROFILE, kernels/cuda/gemm.h) through cuBLASLt:
// the heuristic's first algorithm (Gemm's with SPINDLE_GEMM_TUNE=0) against the fastest of its first
// 16 (Gemm times the first 8), each the median of a few timed runs. Which shapes the heuristic serves
// badly, and by how much.
//     build/bench_gemm_shapes
#include <cublasLt.h>

#include <cstdio>
#include <vector>

#include "cuda_timing.cuh"

using namespace spindle;
using namespace spindle::cuda;

namespace {

// Gemm::matmul_batched's column-major view: c[m, n] = op(a) op(b), a and b bf16.
struct Shape {
  const char* what;
  bool ta, tb;
  int64_t m, n, k, batch;
  cudaDataType_t c_type;
  float beta;
};

constexpr size_t kWorkspaceBytes = 32u << 20;

void run_shape(cublasLtHandle_t handle, const Shape& s, void* workspace) {
  const int64_t a_rows = s.ta ? s.k : s.m, a_cols = s.ta ? s.m : s.k;
  const int64_t b_rows = s.tb ? s.n : s.k, b_cols = s.tb ? s.k : s.n;
  const auto a = random_bf16(a_rows * a_cols * s.batch, 1), b = random_bf16(b_rows * b_cols * s.batch, 2);
  const size_t c_bytes = s.c_type == CUDA_R_32F ? 4 : 2;
  DeviceBuffer<char> c(static_cast<size_t>(s.m * s.n * s.batch) * c_bytes, MemoryCategory::Activations);
  SPINDLE_CUDA(cudaMemset(c.data(), 0, c.size()));

  cublasLtMatmulDesc_t op = nullptr;
  SPINDLE_CUBLAS(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  SPINDLE_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
  SPINDLE_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  SPINDLE_CUBLAS(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, u(a_rows), u(a_cols), a_rows));
  SPINDLE_CUBLAS(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, u(b_rows), u(b_cols), b_rows));
  SPINDLE_CUBLAS(cublasLtMatrixLayoutCreate(&lc, s.c_type, u(s.m), u(s.n), s.m));
  if (s.batch > 1) {
    const auto strided = [&](cublasLtMatrixLayout_t layout, int64_t stride) {
      const auto count = static_cast<int32_t>(s.batch);
      SPINDLE_CUBLAS(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
      SPINDLE_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                      &stride, sizeof stride));
    };
    strided(la, a_rows * a_cols);
    strided(lb, b_rows * b_cols);
    strided(lc, s.m * s.n);
  }
  cublasLtMatmulPreference_t preference = nullptr;
  SPINDLE_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  SPINDLE_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &kWorkspaceBytes, sizeof kWorkspaceBytes));
  constexpr int kAlgos = 16;
  cublasLtMatmulHeuristicResult_t results[kAlgos] = {};
  int found = 0;
  SPINDLE_CUBLAS(
      cublasLtMatmulAlgoGetHeuristic(handle, op, la, lb, lc, lc, preference, kAlgos, results, &found));
  const float alpha = 1.0f;
  const double flops = 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k) *
                       static_cast<double>(s.batch);
  // Small products run several times per timed sample, so that launch gaps do not count.
  const int inner = flops < 2e10 ? 20 : 3;
  double first = 0, best = 1e30;
  int best_index = 0;
  for (int i = 0; i < found; ++i) {
    const double ms = median_ms(
                          [&] {
                            for (int r = 0; r < inner; ++r)
                              SPINDLE_CUBLAS(cublasLtMatmul(
                                  handle, op, &alpha, a.data(), la, b.data(), lb, &s.beta, c.data(), lc,
                                  c.data(), lc, &results[i].algo, workspace, kWorkspaceBytes, nullptr));
                          },
                          5) /
                      inner;
    if (i == 0) first = ms;
    if (ms < best) best = ms, best_index = i;
  }
  std::printf(
      "%-34s %c%c %6lld %6lld %6lld x%-3lld %-4s b%g  heuristic %8.4f ms %5.0f TFLOP/s   best (#%d of %d) "
      "%8.4f ms %5.0f TFLOP/s\n",
      s.what, s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', static_cast<long long>(s.m), static_cast<long long>(s.n),
      static_cast<long long>(s.k), static_cast<long long>(s.batch), s.c_type == CUDA_R_32F ? "f32" : "bf16",
      s.beta, first, flops / first * 1e-9, best_index, found, best, flops / best * 1e-9);
  cublasLtMatmulPreferenceDestroy(preference);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatmulDescDestroy(op);
}

}  // namespace

int main() {
  const int64_t L = 16384, R = 4096;
  const cudaDataType_t f32 = CUDA_R_32F, bf16 = CUDA_R_16BF;
  const std::vector<Shape> shapes = {
      {"KDA f_b (K 128, f32 out)", true, false, 2048, L, 128, 1, f32, 0},
      {"KDA g_b (K 128, bf16 out)", true, false, 2048, L, 128, 1, bf16, 0},
      {"KDA f_a / g_a (N 128)", true, false, 128, L, 2048, 1, bf16, 0},
      {"KDA b_proj (N 16, f32 out)", true, false, 16, L, 2048, 1, f32, 0},
      {"KDA [g_a; b; f_a] stacked (N 272)", true, false, 272, L, 2048, 1, bf16, 0},
      {"KDA dW f_b / g_b", false, true, 128, 2048, L, 1, f32, 1},
      {"KDA dW f_a / g_a", false, true, 2048, 128, L, 1, f32, 1},
      {"KDA dW b_proj", false, true, 2048, 16, L, 1, f32, 1},
      {"KDA dW stacked (272)", false, true, 2048, 272, L, 1, f32, 0},
      {"KDA small dx (K 272)", false, false, 2048, L, 272, 1, f32, 1},
      {"2048^2 forward, bf16", true, false, 2048, L, 2048, 1, bf16, 0},
      {"2048^2 dx accumulate", false, false, 2048, L, 2048, 1, f32, 1},
      {"2048^2 dW", false, true, 2048, 2048, L, 1, f32, 1},
      {"KDA q, k, v stacked (N 6144)", true, false, 6144, L, 2048, 1, bf16, 0},
      {"DSA o_proj dx (4096 from 2048)", false, false, 4096, L, 2048, 1, bf16, 0},
      {"DSA dW 2048 x 1024", false, true, 2048, 1024, L, 1, f32, 1},
      // DSA's products of x (hidden 2048; q_lora 1024, kv_lora 512, the indexer's dim 128), each
      // alone and as DsaWeights::x_proj stacks them (with the indexer's two in the forward).
      {"DSA q_a (N 1024)", true, false, 1024, L, 2048, 1, bf16, 0},
      {"DSA kv_a (N 512)", true, false, 512, L, 2048, 1, bf16, 0},
      {"DSA wk / compress gate (N 128)", true, false, 128, L, 2048, 1, bf16, 0},
      {"DSA x_proj with the indexer (N 1792)", true, false, 1792, L, 2048, 1, bf16, 0},
      {"DSA x_proj (N 1536)", true, false, 1536, L, 2048, 1, bf16, 0},
      {"DSA kv_a dx (K 512, writes)", false, false, 2048, L, 512, 1, f32, 0},
      {"DSA q_a dx (K 1024, adds)", false, false, 2048, L, 1024, 1, f32, 1},
      {"DSA x_proj dx (K 1536, writes)", false, false, 2048, L, 1536, 1, f32, 0},
      {"DSA dW kv_a (512)", false, true, 2048, 512, L, 1, f32, 1},
      {"DSA dW q_a (1024)", false, true, 2048, 1024, L, 1, f32, 1},
      {"DSA dW x_proj (1536)", false, true, 2048, 1536, L, 1, f32, 1},
      {"MLA absorb (per head)", false, false, 512, L, 128, 32, bf16, 0},
      {"MLA absorb dW (per head)", false, true, 512, 128, L, 32, f32, 1},
      // The MoE's products (hidden 2048, intermediate 576): a routed expert's rows at 16k tokens,
      // top-4 of 16 (about 4,096), and the shared expert's 16k rows.
      {"expert [gate | up] (R 4096)", true, false, 1152, R, 2048, 1, bf16, 0},
      {"expert down (R 4096)", true, false, 2048, R, 576, 1, bf16, 0},
      {"expert dhidden (R 4096)", false, false, 576, R, 2048, 1, bf16, 0},
      {"expert dW down (R 4096)", false, true, 576, 2048, R, 1, f32, 1},
      {"expert dW [gate | up] (R 4096)", false, true, 2048, 1152, R, 1, f32, 1},
      {"expert drows (R 4096)", false, false, 2048, R, 1152, 1, bf16, 0},
      {"shared [gate | up]", true, false, 1152, L, 2048, 1, bf16, 0},
      {"shared down", true, false, 2048, L, 576, 1, bf16, 0},
      {"shared dhidden", false, false, 576, L, 2048, 1, bf16, 0},
      {"shared dW down", false, true, 576, 2048, L, 1, f32, 1},
      {"shared dW [gate | up]", false, true, 2048, 1152, L, 1, f32, 1},
      {"shared dx (f32)", false, false, 2048, L, 1152, 1, f32, 0},
      {"dense MLP [gate | up] (I 6144)", true, false, 12288, L, 2048, 1, bf16, 0},
      {"dense MLP down", true, false, 2048, L, 6144, 1, bf16, 0},
      {"dense MLP dW [gate | up]", false, true, 2048, 12288, L, 1, f32, 1},
  };
  cublasLtHandle_t handle = nullptr;
  SPINDLE_CUBLAS(cublasLtCreate(&handle));
  DeviceBuffer<char> workspace(kWorkspaceBytes, MemoryCategory::Workspace);
  for (const Shape& s : shapes) run_shape(handle, s, workspace.data());
  cublasLtDestroy(handle);
  return 0;
}
