#include "data/sequence_range.h"

#include <cmath>

#include "core/error.h"

namespace spindle {

namespace {

class RangeSequences : public TokenSequences {
 public:
  RangeSequences(const TokenSequences& base, double begin, double end)
      : base_(base), begin_(begin), end_(end), source_(base.source()) {
    char text[64];
    std::snprintf(text, sizeof text, " [%.4g, %.4g) of each sequence", begin, end);
    source_ += text;
  }
  int64_t size() const override { return base_.size(); }
  std::string name(int64_t i) const override { return base_.name(i); }
  int64_t length(int64_t i) const override { return last(i) - first(i); }
  void read(int64_t i, int64_t start, int64_t count, int32_t* out) const override {
    check_range(i, start, count);
    base_.read(i, first(i) + start, count, out);
  }
  const std::string& source() const override { return source_; }

 private:
  int64_t first(int64_t i) const {
    return static_cast<int64_t>(std::floor(begin_ * static_cast<double>(base_.length(i))));
  }
  int64_t last(int64_t i) const {
    return static_cast<int64_t>(std::floor(end_ * static_cast<double>(base_.length(i))));
  }

  const TokenSequences& base_;
  double begin_, end_;
  std::string source_;
};

}  // namespace

std::unique_ptr<TokenSequences> sequence_range(const TokenSequences& base, double begin, double end) {
  check(begin >= 0 && begin < end && end <= 1, "sequence range [", begin, ", ", end,
        ") must satisfy 0 <= begin < end <= 1");
  return std::make_unique<RangeSequences>(base, begin, end);
}

}  // namespace spindle
