// Tensor::copy_from between the floating dtypes that whole weight sets go through (initialising,
// the AdamW masters, uploads, checkpoints): seconds for 200 M elements, median of 5, on every core
// of this machine. No GPU.
//     build/bench_tensor_convert
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "core/parallel.h"
#include "core/tensor.h"

int main() {
  using namespace spindle;
  const int64_t n = 200000000;
  Tensor f64 = Tensor::empty({n}, DType::F64), f32 = Tensor::empty({n}, DType::F32),
         bf16 = Tensor::empty({n}, DType::BF16);
  for (int64_t i = 0; i < n; ++i) f64.data<double>()[i] = 1e-3 * static_cast<double>(i % 1000) - 0.5;
  const auto time = [](const char* what, Tensor& to, const Tensor& from) {
    to.copy_from(from);  // first touch
    std::vector<double> seconds;
    for (int r = 0; r < 5; ++r) {
      const auto start = std::chrono::steady_clock::now();
      to.copy_from(from);
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(seconds.begin(), seconds.end());
    std::printf("%-12s %.3f s\n", what, seconds[2]);
  };
  std::printf("200 M elements, %d threads, median of 5:\n", worker_count());
  time("f64 -> f32", f32, f64);
  time("f32 -> bf16", bf16, f32);
  time("bf16 -> f32", f32, bf16);
  time("f32 -> f64", f64, f32);
}
