// median(): the middle of an odd count, the mean of the middle two of an even one, in any order.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "core/median.h"

namespace spindle {
namespace {

TEST(Median, MiddleValueOrMeanOfTheMiddleTwo) {
  std::mt19937 engine(std::random_device{}());
  std::uniform_real_distribution<double> value(0.0, 100.0);
  for (size_t n = 1; n <= 9; ++n) {
    std::vector<double> values(n);
    for (double& v : values) v = value(engine);
    std::vector<double> sorted = values;
    std::sort(sorted.begin(), sorted.end());
    const double expected = n % 2 == 1 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
    std::shuffle(values.begin(), values.end(), engine);
    EXPECT_DOUBLE_EQ(median(values), expected) << n << " values";
  }
  EXPECT_DOUBLE_EQ(median({36.5, 35.7}), 36.1);  // two steps: their mean, not the slower
}

TEST(Median, OfNoValuesFails) { EXPECT_ANY_THROW(median({})); }

}  // namespace
}  // namespace spindle
