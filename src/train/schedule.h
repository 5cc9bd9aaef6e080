// Learning-rate schedule: linear warmup, then cosine decay to a floor.
//
// Steps count from 0 (step s is the (s+1)-th optimizer update). With peak P, floor M, W warmup
// steps and T total steps:
//   s <  W:      lr = P * (s + 1) / W                                  (rises from 0 to P at s = W-1)
//   W <= s < T:  lr = M + (P - M) * (1 + cos(pi * (s - W + 1) / (T - W))) / 2   (reaches M at s = T-1)
//   s >= T:      lr = M
// So no step is spent at lr 0, the peak is used at the last warmup step and the floor at the
// last step. The schedule is a pure function of the step: resuming needs only the step.
#pragma once

#include <cstdint>

namespace spindle {

struct ScheduleOptions {
  double peak_lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup_steps = 10;
  int64_t total_steps = 1000;
};

class LrSchedule {
 public:
  // Checks 0 <= min_lr <= peak_lr (finite), total_steps >= 1 and 0 <= warmup_steps <= total_steps.
  explicit LrSchedule(const ScheduleOptions& options);

  double lr(int64_t step) const;
  const ScheduleOptions& options() const { return options_; }

 private:
  ScheduleOptions options_;
};

}  // namespace spindle
