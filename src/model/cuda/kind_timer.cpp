#include "model/cuda/kind_timer.h"

#include "backend/cuda/check.h"

namespace spindle::cuda {

void KindTimer::begin(const std::string& kind, cudaStream_t stream) {
  Span span{kind, nullptr, nullptr};
  SPINDLE_CUDA(cudaEventCreate(&span.start));
  SPINDLE_CUDA(cudaEventCreate(&span.stop));
  SPINDLE_CUDA(cudaEventRecord(span.start, stream));
  open_.push_back(spans_.size());
  spans_.push_back(span);
}

void KindTimer::end(cudaStream_t stream) {
  SPINDLE_CUDA(cudaEventRecord(spans_[open_.back()].stop, stream));
  open_.pop_back();
}

void KindTimer::collect(std::map<std::string, double>& ms) {
  for (Span& span : spans_) {
    SPINDLE_CUDA(cudaEventSynchronize(span.stop));
    float elapsed = 0;
    SPINDLE_CUDA(cudaEventElapsedTime(&elapsed, span.start, span.stop));
    ms[span.kind] += elapsed;
    cudaEventDestroy(span.start);
    cudaEventDestroy(span.stop);
  }
  spans_.clear();
}

}  // namespace spindle::cuda
