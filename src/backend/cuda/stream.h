// A CUDA stream and events, owned (RAII); timings come from events, never from host clocks.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/check.h"

namespace spindle::cuda {

class Stream {
 public:
  Stream() { SPINDLE_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }
  void synchronize() const { SPINDLE_CUDA(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  // cudaEventDisableTiming for events that only order streams.
  explicit Event(unsigned flags = cudaEventDefault) {
    SPINDLE_CUDA(cudaEventCreateWithFlags(&event_, flags));
  }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(const Stream& stream) { record(stream.get()); }
  void record(cudaStream_t stream) { SPINDLE_CUDA(cudaEventRecord(event_, stream)); }
  // The host waits for the work this event recorded.
  void synchronize() const { SPINDLE_CUDA(cudaEventSynchronize(event_)); }
  // Work queued on `stream` from now on waits for the work this event recorded.
  void make_wait(cudaStream_t stream) const { SPINDLE_CUDA(cudaStreamWaitEvent(stream, event_, 0)); }
  // Milliseconds from `start` to this event (both recorded, this one complete).
  float since(const Event& start) const {
    SPINDLE_CUDA(cudaEventSynchronize(event_));
    float ms = 0;
    SPINDLE_CUDA(cudaEventElapsedTime(&ms, start.event_, event_));
    return ms;
  }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace spindle::cuda
