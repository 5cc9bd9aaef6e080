#include "kernels/cuda/gemm_profile.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "backend/cuda/check.h"

namespace spindle::cuda {

namespace {

// Pending products whose events are read at once: a few thousand keep the host a step ahead.
constexpr size_t kCollectEvery = 4096;

}  // namespace

void GemmProfile::begin(cudaStream_t stream) {
  SPINDLE_CUDA(cudaEventCreate(&started_));
  SPINDLE_CUDA(cudaEventRecord(started_, stream));
}

void GemmProfile::end(const Shape& shape, double flops, cudaStream_t stream) {
  cudaEvent_t stop = nullptr;
  SPINDLE_CUDA(cudaEventCreate(&stop));
  SPINDLE_CUDA(cudaEventRecord(stop, stream));
  pending_.push_back({shape, flops, started_, stop});
  started_ = nullptr;
  if (pending_.size() >= kCollectEvery) collect();
}

void GemmProfile::collect() {
  for (Pending& p : pending_) {
    SPINDLE_CUDA(cudaEventSynchronize(p.stop));
    float ms = 0;
    SPINDLE_CUDA(cudaEventElapsedTime(&ms, p.start, p.stop));
    Total& total = totals_[p.shape];
    total.calls += 1;
    total.ms += ms;
    total.flops += p.flops;
    cudaEventDestroy(p.start);
    cudaEventDestroy(p.stop);
  }
  pending_.clear();
}

GemmProfile::~GemmProfile() {
  if (cudaDeviceSynchronize() != cudaSuccess) return;  // the run failed: its error says more
  collect();
  std::vector<std::pair<Shape, Total>> rows(totals_.begin(), totals_.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double all_ms = 0, all_flops = 0;
  for (const auto& [shape, total] : rows) {
    all_ms += total.ms;
    all_flops += total.flops;
  }
  std::fprintf(stderr, "gemm profile: %.1f ms in %zu shapes, %.0f TFLOP/s\n", all_ms, rows.size(),
               all_flops / all_ms * 1e-9);
  std::fprintf(stderr, "%10s %6s %7s  %-4s %7s %7s %7s %5s %4s %4s\n", "ms", "%", "TFLOP/s", "op", "m", "n",
               "k", "batch", "c", "beta");
  const auto dim = [](int64_t v) { return v < 0 ? std::string("var") : std::to_string(v); };
  for (const auto& [shape, total] : rows) {
    const auto& [ta, tb, m, n, k, batch, c_type, beta] = shape;
    std::fprintf(stderr, "%10.2f %5.1f%% %7.0f  %c%c   %7s %7s %7s %5lld %4s %4s  x%lld\n", total.ms,
                 100 * total.ms / all_ms, total.flops / total.ms * 1e-9, ta ? 'T' : 'N', tb ? 'T' : 'N',
                 dim(m).c_str(), dim(n).c_str(), dim(k).c_str(), static_cast<long long>(batch),
                 c_type == CUDA_R_32F ? "f32" : "bf16", beta ? "1" : "0",
                 static_cast<long long>(total.calls));
  }
}

}  // namespace spindle::cuda
