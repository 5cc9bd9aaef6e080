// One AdamW update's constants for a slot, shared by the host's update (train/adamw.cpp) and the
// device's exact copy of it (kernels/cuda/optim.cu), which must give the same bits.
#pragma once

namespace spindle {

// In the fp64 of the CPU reference: m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g g,
// p = decay p - step_size m / (sqrt(v) / bc2_sqrt + eps), each operation rounded in that order (no
// fused multiply-adds), so that another implementation following it gets the same bits.
struct AdamWConstants {
  double beta1, beta2, step_size, bc2_sqrt, eps, decay;
};

}  // namespace spindle
