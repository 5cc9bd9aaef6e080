// The median of timed runs: the middle value, or the mean of the middle two for an even count (two
// steps report their mean, not the slower one).
#pragma once

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace spindle {

inline double median(std::vector<double> values) {
  check(!values.empty(), "median of no values");
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

}  // namespace spindle
