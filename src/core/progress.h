// Progress of long work for a person watching: a line at most every `interval` seconds (none at
// all for work that finishes sooner), saying how far it is and how long it has run.
#pragma once

#include <chrono>
#include <string>
#include <utility>

#include "core/log.h"

namespace spindle {

class Progress {
 public:
  explicit Progress(std::string what, double interval_seconds = 10.0)
      : what_(std::move(what)), interval_(interval_seconds), start_(Clock::now()), last_(start_) {}

  // `done` of `total` steps of `stage` are done.
  void update(const char* stage, size_t done, size_t total) {
    const auto now = Clock::now();
    if (std::chrono::duration<double>(now - last_).count() < interval_) return;
    last_ = now;
    log_info(what_, ": ", stage, " ", done, "/", total, ", ",
             static_cast<int64_t>(std::chrono::duration<double>(now - start_).count()), " s");
  }

 private:
  using Clock = std::chrono::steady_clock;
  std::string what_;
  double interval_;
  Clock::time_point start_, last_;
};

}  // namespace spindle
