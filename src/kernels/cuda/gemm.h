// Dense products through cuBLASLt: bf16 operands, fp32 accumulation, bf16 or fp32 results.
//
// Row-major names for the three products of a linear layer y = x w^T (x [M, K], w [N, K]):
//   linear:                 y[M, N]  = alpha x w^T + beta y
//   linear_backward_input:  dx[M, K] = dy w + beta dx        (beta 1 accumulates several branches)
//   linear_backward_weight: dw[N, K] += alpha dy^T x         (fp32 gradients)
// matmul is the general column-major product they reduce to (cuBLAS's view of row-major data is
// the transpose). Plans (descriptors and an algorithm) are cached per shape, leading dimensions,
// output type and operand alignment; row counts within 128 of each other (the MoE's change with
// every routing) share one plan, its layouts resized for each product. A plan's algorithm is the
// fastest of the heuristic's first eight, timed on the plan's first product where it is large
// enough (kTunedFlops): the heuristic's first was up to 31% slower on the step's shapes (an
// expert's down-projection weight gradient; docs/PERF.md, "cuBLASLt's algorithms timed"). Timed
// choices are kept for the process by shape, row counts by classes of 1024, so that every Gemm
// takes the same algorithm for a shape and the MoE's new row counts are rarely timed.
// SPINDLE_GEMM_TUNE=0 in the environment takes the heuristic's first, untimed.
// matmul_batched runs many products of one shape at fixed element strides in one launch (the
// attention's per-head products: 32 launches of a few microseconds each become one). One Gemm
// serves any number of streams: each stream has its own cuBLASLt workspace (32 MiB), so that
// products queued on different streams may run together. It is not thread-safe: plans are cached
// and a bucket's layouts resized as products are queued, from one host thread.
//
// With SPINDLE_GEMM_PROFILE set in the environment, every product is timed by CUDA events and the
// Gemm prints, when destroyed, the time by shape (row counts that are not multiples of 64, the
// MoE's, as "var") to stderr: where the dense products' time goes and at what rate.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

namespace spindle::cuda {

class GemmProfile;

class Gemm {
 public:
  Gemm();
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  void linear(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int64_t M, int64_t K,
              int64_t N, cudaStream_t stream, float alpha = 1.0f);
  void linear(const __nv_bfloat16* x, const __nv_bfloat16* w, float* y, int64_t M, int64_t K, int64_t N,
              cudaStream_t stream, float alpha = 1.0f, float beta = 0.0f);
  void linear_backward_input(const __nv_bfloat16* dy, const __nv_bfloat16* w, __nv_bfloat16* dx, int64_t M,
                             int64_t K, int64_t N, cudaStream_t stream);
  void linear_backward_input(const __nv_bfloat16* dy, const __nv_bfloat16* w, float* dx, int64_t M, int64_t K,
                             int64_t N, float beta, cudaStream_t stream);
  void linear_backward_weight(const __nv_bfloat16* dy, const __nv_bfloat16* x, float* dw, int64_t M,
                              int64_t K, int64_t N, cudaStream_t stream, float alpha = 1.0f);

  // Which of a product's dimensions counts rows (tokens, an expert's share of them), where known:
  // a timed choice then serves every row count of its class (make_plan).
  enum class Rows { Unknown, N, K };

  // Column-major c[m, n] (ldc) = alpha op(a) op(b) + beta c; a is m x k (stored k x m when
  // transposed, ld lda), b is k x n (stored n x k when transposed, ld ldb); a and b bf16.
  void matmul(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
              const void* b, int64_t ldb, void* c, cudaDataType_t c_type, int64_t ldc, float alpha,
              float beta, cudaStream_t stream, Rows rows = Rows::Unknown);
  // `batch` products c_i = alpha op(a_i) op(b_i) + beta c_i with a_i = a + i stride_a, b_i = b + i
  // stride_b, c_i = c + i stride_c (strides in elements; the c_i must not overlap).
  void matmul_batched(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const void* a,
                      int64_t lda, int64_t stride_a, const void* b, int64_t ldb, int64_t stride_b, void* c,
                      cudaDataType_t c_type, int64_t ldc, int64_t stride_c, int64_t batch, float alpha,
                      float beta, cudaStream_t stream, Rows rows = Rows::Unknown);

  // Plans made (each asks the heuristic, and times its algorithms where large enough) and the host
  // time they took, during which a GPU waiting on the host idles; plans timed, and of them those
  // switched from the heuristic's first to a faster one; products run on a bucket's plan resized to
  // their shape; shapes whose bucket's algorithm cuBLASLt refused, which got their own plan.
  struct PlanStats {
    int64_t plans = 0, timed = 0, switched = 0, bucket_reuses = 0, exact_fallbacks = 0;
    double seconds = 0;
  };
  const PlanStats& plan_stats() const { return plan_stats_; }

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // transposes, m, n, k, leading dimensions, c's type, alignments, then batch and strides.
  using PlanKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, uint32_t,
                             uint32_t, uint32_t, int64_t, int64_t, int64_t, int64_t>;
  // What a product computes, for timing a new plan's algorithms on it.
  struct Product {
    const void *a, *b;
    void* c;
    float alpha, beta;
    cudaStream_t stream;
  };
  // The plan of key's bucket (row counts by bucket of 128), its layouts set to key's shape.
  const Plan& plan(const PlanKey& key, const Product& product, Rows rows);
  // Descriptors and an algorithm for key's exact shape: the process's earlier choice remembered as
  // *remembered_as (key with row counts by class), else the fastest of the heuristic's first few
  // on `product` (or the heuristic's first), remembered so where given.
  Plan make_plan(const PlanKey& key, const Product& product, const PlanKey* remembered_as);
  struct TimedChoices;  // the algorithms timed so far in this process, by class key
  static TimedChoices& timed_choices();
  // The index of the fastest of `algos` for plan p on `product` (0 where none beats the first by
  // 2%, or an algorithm cannot run).
  size_t fastest(const Plan& p, const std::vector<cublasLtMatmulAlgo_t>& algos, const PlanKey& key,
                 const Product& product);

  // The workspace of `stream`, allocated on its first product.
  void* workspace(cudaStream_t stream);

  std::unique_ptr<GemmProfile> profile_;  // null unless SPINDLE_GEMM_PROFILE is set

  cublasLtHandle_t handle_ = nullptr;
  std::vector<std::pair<cudaStream_t, void*>> workspaces_;
  size_t workspace_bytes_ = 32u << 20;
  std::map<PlanKey, Plan> plans_;        // by bucket
  std::map<PlanKey, Plan> exact_plans_;  // by shape, where a bucket's algorithm was refused
  PlanStats plan_stats_;
};

}  // namespace spindle::cuda
