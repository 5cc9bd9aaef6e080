// Dense products through cuBLASLt. Row-major y = x w^T is column-major y^T = w x^T, so the
// call multiplies w (op T) by x (op N) in cuBLAS's column-major view.
#include "backend/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace spindle::cuda {

Gemm::Gemm() {
  SPINDLE_CUBLAS(cublasLtCreate(&handle_));
  SPINDLE_CUDA(cudaMalloc(&workspace_, workspace_bytes_));
}

Gemm::~Gemm() {
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

void Gemm::linear(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y_bf16, float* y_f32,
                  int64_t M, int64_t K, int64_t N, cudaStream_t stream) {
  check((y_bf16 == nullptr) != (y_f32 == nullptr), "Gemm::linear needs exactly one output");
  cublasLtMatmulDesc_t op = nullptr;
  SPINDLE_CUBLAS(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, plain = CUBLAS_OP_N;
  SPINDLE_CUBLAS(
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose));
  SPINDLE_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &plain, sizeof plain));
  // Column-major: A = w as [K, N] (ld K) transposed, B = x as [K, M] (ld K), C = y^T as [N, M].
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  const cudaDataType_t out_type = y_bf16 ? CUDA_R_16BF : CUDA_R_32F;
  SPINDLE_CUBLAS(
      cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, static_cast<uint64_t>(K), static_cast<uint64_t>(N), K));
  SPINDLE_CUBLAS(
      cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, static_cast<uint64_t>(K), static_cast<uint64_t>(M), K));
  SPINDLE_CUBLAS(
      cublasLtMatrixLayoutCreate(&c, out_type, static_cast<uint64_t>(N), static_cast<uint64_t>(M), N));
  cublasLtMatmulPreference_t preference = nullptr;
  SPINDLE_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  SPINDLE_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes_, sizeof workspace_bytes_));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  SPINDLE_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle_, op, a, b, c, c, preference, 1, &heuristic, &found));
  check(found > 0, "cuBLASLt has no algorithm for a ", M, "x", K, "x", N, " bf16 product");
  const float alpha = 1.0f, beta = 0.0f;
  void* y = y_bf16 ? static_cast<void*>(y_bf16) : static_cast<void*>(y_f32);
  SPINDLE_CUBLAS(cublasLtMatmul(handle_, op, &alpha, w, a, x, b, &beta, y, c, y, c, &heuristic.algo,
                                workspace_, workspace_bytes_, stream));
  cublasLtMatmulPreferenceDestroy(preference);
  cublasLtMatrixLayoutDestroy(c);
  cublasLtMatrixLayoutDestroy(b);
  cublasLtMatrixLayoutDestroy(a);
  cublasLtMatmulDescDestroy(op);
}

}  // namespace spindle::cuda
