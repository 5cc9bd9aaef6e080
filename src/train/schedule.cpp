#include "train/schedule.h"

#include <cmath>
#include <numbers>

#include "core/error.h"

namespace spindle {

LrSchedule::LrSchedule(const ScheduleOptions& o) : options_(o) {
  check(std::isfinite(o.peak_lr) && o.peak_lr >= 0, "lr schedule: peak lr must be finite and >= 0, got ",
        o.peak_lr);
  check(std::isfinite(o.min_lr) && o.min_lr >= 0 && o.min_lr <= o.peak_lr,
        "lr schedule: min lr must be in [0, peak lr = ", o.peak_lr, "], got ", o.min_lr);
  check(o.total_steps >= 1, "lr schedule: total steps must be >= 1, got ", o.total_steps);
  check(o.warmup_steps >= 0 && o.warmup_steps <= o.total_steps, "lr schedule: warmup steps must be in [0, ",
        o.total_steps, "] (the total steps), got ", o.warmup_steps);
}

double LrSchedule::lr(int64_t step) const {
  check(step >= 0, "lr schedule: step must be >= 0, got ", step);
  const ScheduleOptions& o = options_;
  if (step < o.warmup_steps)
    return o.peak_lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  if (step >= o.total_steps) return o.min_lr;
  const double progress =
      static_cast<double>(step - o.warmup_steps + 1) / static_cast<double>(o.total_steps - o.warmup_steps);
  return o.min_lr + (o.peak_lr - o.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace spindle
