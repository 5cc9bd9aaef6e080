#include "kernels/cuda/gemm.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string_view>

#include "backend/cuda/check.h"
#include "kernels/cuda/gemm_profile.h"

namespace spindle::cuda {

namespace {

// The largest power of two (at most 256) dividing the address: cuBLASLt assumes 256-byte
// aligned operands unless told otherwise, and row offsets into a matrix are not.
// Batched, every operand of the batch is aligned to what both its first address and the stride give.
uint32_t alignment_of(const void* pointer, int64_t stride_bytes = 0) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t align = 256;
  while (align > 1 && (address % align != 0 || stride_bytes % align != 0)) align /= 2;
  return align;
}

size_t element_bytes(cudaDataType_t type) { return type == CUDA_R_32F ? 4 : 2; }

// A product's floating-point operations, a multiply-add counting 2.
double product_flops(int64_t m, int64_t n, int64_t k, int64_t batch) {
  return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) *
         static_cast<double>(batch);
}

// Products of fewer FLOPs take the heuristic's first algorithm untimed: the timing's device
// synchronisation and runs would cost more than the choice could save.
constexpr double kTunedFlops = 1e9;
// The heuristic's first algorithms timed, and the runs each is timed over (after one untimed).
constexpr int kTimedAlgos = 8, kTimedRuns = 3;
// Accumulating products (beta != 0) are timed into a scratch output of at most this many bytes
// (larger ones take the heuristic's first), allocated outside the allocator for the timing only.
constexpr size_t kScratchBytes = size_t{256} << 20;

bool tuning_on() {
  static const bool on = [] {
    const char* value = std::getenv("SPINDLE_GEMM_TUNE");
    return value == nullptr || std::string_view(value) != "0";
  }();
  return on;
}

}  // namespace

Gemm::Gemm() {
  SPINDLE_CUBLAS(cublasLtCreate(&handle_));
  if (std::getenv("SPINDLE_GEMM_PROFILE") != nullptr) profile_ = std::make_unique<GemmProfile>();
}

Gemm::~Gemm() {
  profile_.reset();  // prints
  for (auto* plans : {&plans_, &exact_plans_})
    for (auto& [key, p] : *plans) {
      cublasLtMatrixLayoutDestroy(p.c);
      cublasLtMatrixLayoutDestroy(p.b);
      cublasLtMatrixLayoutDestroy(p.a);
      cublasLtMatmulDescDestroy(p.op);
    }
  for (auto& [stream, workspace] : workspaces_) cudaFree(workspace);
  cublasLtDestroy(handle_);
}

void* Gemm::workspace(cudaStream_t stream) {
  for (const auto& [s, workspace] : workspaces_)
    if (s == stream) return workspace;
  void* workspace = nullptr;
  SPINDLE_CUDA(cudaMalloc(&workspace, workspace_bytes_));
  workspaces_.emplace_back(stream, workspace);
  return workspace;
}

namespace {

// The heuristic takes far longer than a product of the MoE's sizes, whose row counts change with
// every routing: a dimension of at least 1024 that is not a multiple of 64 (a row count, not a
// model size) counts by its bucket of 128 (a negative id).
int64_t bucket(int64_t v) { return v >= 1024 && v % 64 != 0 ? -((v + 127) / 128) : v; }

// A timed choice serves the row counts of its class of 1024 (a dimension the caller says counts rows,
// or one that looks like it: see bucket): with every routing the MoE meets new row counts, and
// timing each (a device synchronisation and 32 runs) cost more than it saved, in every step.
int64_t timing_class(int64_t v, bool rows) {
  return rows || (v >= 1024 && v % 64 != 0) ? -((v + 1023) / 1024) : v;
}

}  // namespace

struct Gemm::TimedChoices {
  std::mutex mutex;
  std::map<PlanKey, cublasLtMatmulAlgo_t> algos;
};

Gemm::TimedChoices& Gemm::timed_choices() {
  static TimedChoices choices;
  return choices;
}

size_t Gemm::fastest(const Plan& p, const std::vector<cublasLtMatmulAlgo_t>& algos, const PlanKey& key,
                     const Product& product) {
  const auto [transpose_a, transpose_b, m, n, k, lda, ldb, ldc, c_type, align_a, align_b, align_c, batch,
              stride_a, stride_b, stride_c] = key;
  // An accumulating product runs into a scratch output, so that the timing adds nothing to c; the
  // others write c as the product itself will.
  void* c = product.c;
  void* scratch = nullptr;
  if (product.beta != 0.0f) {
    const size_t bytes = element_bytes(static_cast<cudaDataType_t>(c_type)) *
                         static_cast<size_t>(stride_c * (batch - 1) + ldc * n);
    if (bytes > kScratchBytes || cudaMalloc(&scratch, bytes) != cudaSuccess) {
      (void)cudaGetLastError();  // a failed allocation: the heuristic's first, untimed
      return 0;
    }
    c = scratch;
  }
  // Timed on a quiet GPU: products on other streams would slow some algorithms' runs and not others'.
  SPINDLE_CUDA(cudaDeviceSynchronize());
  void* const space = workspace(product.stream);
  cudaEvent_t start = nullptr, stop = nullptr;
  SPINDLE_CUDA(cudaEventCreate(&start));
  SPINDLE_CUDA(cudaEventCreate(&stop));
  const auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(handle_, p.op, &product.alpha, product.a, p.a, product.b, p.b, &product.beta, c,
                          p.c, c, p.c, &algo, space, workspace_bytes_, product.stream);
  };
  size_t pick = 0;
  float first_ms = INFINITY, best_ms = INFINITY;
  for (size_t i = 0; i < algos.size(); ++i) {
    if (run(algos[i]) != CUBLAS_STATUS_SUCCESS) continue;  // refused before it ran: not a candidate
    SPINDLE_CUDA(cudaEventRecord(start, product.stream));
    for (int r = 0; r < kTimedRuns; ++r) SPINDLE_CUBLAS(run(algos[i]));
    SPINDLE_CUDA(cudaEventRecord(stop, product.stream));
    SPINDLE_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    SPINDLE_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (i == 0) first_ms = best_ms = ms;
    if (i > 0 && ms < best_ms && ms < 0.98f * first_ms) pick = i, best_ms = ms;
  }
  SPINDLE_CUDA(cudaEventDestroy(start));
  SPINDLE_CUDA(cudaEventDestroy(stop));
  if (scratch != nullptr) SPINDLE_CUDA(cudaFree(scratch));
  ++plan_stats_.timed;
  if (pick != 0) ++plan_stats_.switched;
  return pick;
}

Gemm::Plan Gemm::make_plan(const PlanKey& key, const Product& product, const PlanKey* remembered_as) {
  const auto started = std::chrono::steady_clock::now();
  const auto [transpose_a, transpose_b, m, n, k, lda, ldb, ldc, c_type, align_a, align_b, align_c, batch,
              stride_a, stride_b, stride_c] = key;
  Plan p;
  SPINDLE_CUBLAS(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                          op_b = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  SPINDLE_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
  SPINDLE_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  SPINDLE_CUBLAS(
      cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, u(transpose_a ? k : m), u(transpose_a ? m : k), lda));
  SPINDLE_CUBLAS(
      cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, u(transpose_b ? n : k), u(transpose_b ? k : n), ldb));
  SPINDLE_CUBLAS(cublasLtMatrixLayoutCreate(&p.c, static_cast<cudaDataType_t>(c_type), u(m), u(n), ldc));
  if (batch > 1) {
    const auto strided = [&](cublasLtMatrixLayout_t layout, int64_t stride) {
      const auto count = static_cast<int32_t>(batch);
      SPINDLE_CUBLAS(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
      SPINDLE_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                      &stride, sizeof stride));
    };
    strided(p.a, stride_a);
    strided(p.b, stride_b);
    strided(p.c, stride_c);
  }
  cublasLtMatmulPreference_t preference = nullptr;
  SPINDLE_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  SPINDLE_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes_, sizeof workspace_bytes_));
  const cublasLtMatmulPreferenceAttributes_t alignments[] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  const uint32_t values[] = {align_a, align_b, align_c, align_c};
  for (int i = 0; i < 4; ++i)
    SPINDLE_CUBLAS(
        cublasLtMatmulPreferenceSetAttribute(preference, alignments[i], &values[i], sizeof values[i]));
  TimedChoices& choices = timed_choices();
  const std::lock_guard<std::mutex> lock(choices.mutex);
  const auto earlier = remembered_as != nullptr ? choices.algos.find(*remembered_as) : choices.algos.end();
  if (earlier != choices.algos.end()) {
    p.algo = earlier->second;
  } else {
    const bool timed = tuning_on() && product_flops(m, n, k, batch) >= kTunedFlops;
    cublasLtMatmulHeuristicResult_t results[kTimedAlgos] = {};
    int found_count = 0;
    SPINDLE_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, preference,
                                                  timed ? kTimedAlgos : 1, results, &found_count));
    check(found_count > 0, "cuBLASLt has no algorithm for a ", m, "x", k, "x", n, " bf16 product");
    std::vector<cublasLtMatmulAlgo_t> algos;
    for (int i = 0; i < found_count; ++i) algos.push_back(results[i].algo);
    p.algo = algos[algos.size() > 1 ? fastest(p, algos, key, product) : 0];
    if (timed && remembered_as != nullptr) choices.algos.emplace(*remembered_as, p.algo);
  }
  cublasLtMatmulPreferenceDestroy(preference);
  ++plan_stats_.plans;
  plan_stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return p;
}

// A product whose row count shares a bucket with an earlier one takes that one's plan, its layouts
// resized (cheap host-side attributes) instead of new descriptors and a check: about 9 us a product
// fewer, where the MoE's expert products come in bursts after the host waits for the routing.
const Gemm::Plan& Gemm::plan(const PlanKey& key, const Product& product, Rows rows) {
  auto bucket_key = key;
  std::get<2>(bucket_key) = bucket(std::get<2>(key));
  std::get<3>(bucket_key) = bucket(std::get<3>(key));
  std::get<4>(bucket_key) = bucket(std::get<4>(key));
  auto found = plans_.find(bucket_key);
  if (found == plans_.end()) {
    auto class_key = key;
    std::get<2>(class_key) = timing_class(std::get<2>(key), false);
    std::get<3>(class_key) = timing_class(std::get<3>(key), rows == Rows::N);
    std::get<4>(class_key) = timing_class(std::get<4>(key), rows == Rows::K);
    return plans_.emplace(bucket_key, make_plan(key, product, &class_key)).first->second;
  }
  if (bucket_key != key) {
    const bool transpose_a = std::get<0>(key), transpose_b = std::get<1>(key);
    const int64_t m = std::get<2>(key), n = std::get<3>(key), k = std::get<4>(key);
    const Plan& p = found->second;
    const auto resize = [](cublasLtMatrixLayout_t layout, int64_t rows, int64_t cols) {
      const auto r = static_cast<uint64_t>(rows), c = static_cast<uint64_t>(cols);
      SPINDLE_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_ROWS, &r, sizeof r));
      SPINDLE_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_COLS, &c, sizeof c));
    };
    resize(p.a, transpose_a ? k : m, transpose_a ? m : k);
    resize(p.b, transpose_b ? n : k, transpose_b ? k : n);
    resize(p.c, m, n);
    ++plan_stats_.bucket_reuses;
  }
  return found->second;
}

void Gemm::matmul(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const void* a,
                  int64_t lda, const void* b, int64_t ldb, void* c, cudaDataType_t c_type, int64_t ldc,
                  float alpha, float beta, cudaStream_t stream, Rows rows) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum: cuBLASLt refuses k = 0, the answer is beta * c
    check(beta == 1.0f || beta == 0.0f, "Gemm: k = 0 with beta ", beta);
    if (beta == 0.0f) {
      const size_t element = element_bytes(c_type);
      SPINDLE_CUDA(cudaMemset2DAsync(c, static_cast<size_t>(ldc) * element, 0,
                                     static_cast<size_t>(m) * element, static_cast<size_t>(n), stream));
    }
    return;
  }
  matmul_batched(transpose_a, transpose_b, m, n, k, a, lda, 0, b, ldb, 0, c, c_type, ldc, 0, 1, alpha, beta,
                 stream, rows);
}

void Gemm::matmul_batched(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const void* a,
                          int64_t lda, int64_t stride_a, const void* b, int64_t ldb, int64_t stride_b,
                          void* c, cudaDataType_t c_type, int64_t ldc, int64_t stride_c, int64_t batch,
                          float alpha, float beta, cudaStream_t stream, Rows rows) {
  if (m == 0 || n == 0 || batch == 0) return;
  check(k > 0, "Gemm: a batched product with k = 0");
  if (batch == 1) stride_a = stride_b = stride_c = 0;
  const int64_t c_bytes = static_cast<int64_t>(element_bytes(c_type));
  const PlanKey key(transpose_a, transpose_b, m, n, k, lda, ldb, ldc, static_cast<int>(c_type),
                    alignment_of(a, 2 * stride_a), alignment_of(b, 2 * stride_b),
                    alignment_of(c, c_bytes * stride_c), batch, stride_a, stride_b, stride_c);
  auto exact = exact_plans_.find(key);
  const Product product{a, b, c, alpha, beta, stream};
  const Plan& p = exact != exact_plans_.end() ? exact->second : plan(key, product, rows);
  if (profile_) profile_->begin(stream);
  void* const space = workspace(stream);
  cublasStatus_t status = cublasLtMatmul(handle_, p.op, &alpha, a, p.a, b, p.b, &beta, c, p.c, c, p.c,
                                         &p.algo, space, workspace_bytes_, stream);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE) {
    // Refused before anything ran: the bucket's algorithm does not fit this exact shape (or needs
    // more workspace here); the heuristic's own choice for it from now on.
    check(exact == exact_plans_.end(), "cuBLASLt refused a ", m, "x", k, "x", n, " product's own plan");
    exact = exact_plans_.emplace(key, make_plan(key, product, nullptr)).first;
    ++plan_stats_.exact_fallbacks;
    const Plan& e = exact->second;
    status = cublasLtMatmul(handle_, e.op, &alpha, a, e.a, b, e.b, &beta, c, e.c, c, e.c, &e.algo, space,
                            workspace_bytes_, stream);
  }
  SPINDLE_CUBLAS(status);
  if (profile_) {
    const auto shown = [](int64_t v) { return v % 64 == 0 ? v : -1; };  // the MoE's row counts as one
    profile_->end({transpose_a, transpose_b, shown(m), shown(n), shown(k), batch, static_cast<int>(c_type),
                   beta != 0.0f},
                  product_flops(m, n, k, batch), stream);
  }
}

// y^T[N, M] = w^T (w stored [K, N] column-major, op T) x^T ([K, M], op N).
void Gemm::linear(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int64_t M, int64_t K,
                  int64_t N, cudaStream_t stream, float alpha) {
  matmul(true, false, N, M, K, w, K, x, K, y, CUDA_R_16BF, N, alpha, 0.0f, stream, Rows::N);
}

void Gemm::linear(const __nv_bfloat16* x, const __nv_bfloat16* w, float* y, int64_t M, int64_t K, int64_t N,
                  cudaStream_t stream, float alpha, float beta) {
  matmul(true, false, N, M, K, w, K, x, K, y, CUDA_R_32F, N, alpha, beta, stream, Rows::N);
}

// dx^T[K, M] = w ([K, N] column-major, op N) dy^T ([N, M], op N).
void Gemm::linear_backward_input(const __nv_bfloat16* dy, const __nv_bfloat16* w, __nv_bfloat16* dx,
                                 int64_t M, int64_t K, int64_t N, cudaStream_t stream) {
  matmul(false, false, K, M, N, w, K, dy, N, dx, CUDA_R_16BF, K, 1.0f, 0.0f, stream, Rows::N);
}

void Gemm::linear_backward_input(const __nv_bfloat16* dy, const __nv_bfloat16* w, float* dx, int64_t M,
                                 int64_t K, int64_t N, float beta, cudaStream_t stream) {
  matmul(false, false, K, M, N, w, K, dy, N, dx, CUDA_R_32F, K, 1.0f, beta, stream, Rows::N);
}

// dw^T[K, N] += x^T ([K, M], op N) dy ([N, M] stored, op T).
void Gemm::linear_backward_weight(const __nv_bfloat16* dy, const __nv_bfloat16* x, float* dw, int64_t M,
                                  int64_t K, int64_t N, cudaStream_t stream, float alpha) {
  matmul(false, true, K, N, M, x, K, dy, N, dw, CUDA_R_32F, K, alpha, 1.0f, stream, Rows::K);
}

}  // namespace spindle::cuda
