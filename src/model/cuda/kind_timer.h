// GPU time per kind of work ("kda", "dsa", ... and nested parts such as "dsa.indexer"), from CUDA
// events around each span: what `spindle bench` reports as seconds_by_layer_kind.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <string>
#include <vector>

namespace spindle::cuda {

class KindTimer {
 public:
  // Spans nest: end() closes the innermost open one.
  void begin(const std::string& kind, cudaStream_t stream);
  void end(cudaStream_t stream);
  // Waits for the recorded work and adds its times (ms) to `ms`; clears the events.
  void collect(std::map<std::string, double>& ms);

 private:
  struct Span {
    std::string kind;
    cudaEvent_t start, stop;
  };
  std::vector<Span> spans_;
  std::vector<size_t> open_;
};

// A span for the life of a scope; nothing when there is no timer.
class TimedScope {
 public:
  TimedScope(KindTimer* timer, const char* kind, cudaStream_t stream) : timer_(timer), stream_(stream) {
    if (timer_) timer_->begin(kind, stream_);
  }
  ~TimedScope() {
    if (timer_) timer_->end(stream_);
  }
  TimedScope(const TimedScope&) = delete;
  TimedScope& operator=(const TimedScope&) = delete;

 private:
  KindTimer* timer_;
  cudaStream_t stream_;
};

}  // namespace spindle::cuda
