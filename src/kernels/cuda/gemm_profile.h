// Time by product shape, for Gemm under SPINDLE_GEMM_PROFILE (gemm.h): each product between two
// CUDA events on its stream, summed by shape and printed, largest first, with its rate.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

namespace spindle::cuda {

class GemmProfile {
 public:
  // transposes, m, n, k, batch, c's type, beta != 0.
  using Shape = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int, bool>;

  GemmProfile() = default;
  ~GemmProfile();  // prints the table
  GemmProfile(const GemmProfile&) = delete;
  GemmProfile& operator=(const GemmProfile&) = delete;

  // Around one product of `flops` on `stream`.
  void begin(cudaStream_t stream);
  void end(const Shape& shape, double flops, cudaStream_t stream);

 private:
  struct Pending {
    Shape shape;
    double flops;
    cudaEvent_t start, stop;
  };
  struct Total {
    int64_t calls = 0;
    double ms = 0, flops = 0;
  };
  void collect();

  cudaEvent_t started_ = nullptr;
  std::vector<Pending> pending_;
  std::map<Shape, Total> totals_;
};

}  // namespace spindle::cuda
