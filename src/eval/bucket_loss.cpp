#include "eval/bucket_loss.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace spindle {

BucketLoss::BucketLoss(int64_t bucket_size) : bucket_size_(bucket_size) {
  check(bucket_size >= 1, "bucket size must be at least 1 token, got ", bucket_size);
}

template <class T>
void BucketLoss::add(std::span<const T> log_probs) {
  const int64_t length = static_cast<int64_t>(log_probs.size()) + 1;
  // Checked before adding anything, so a rejected window leaves the sums as they were. A NaN
  // would silently poison a bucket's mean; -inf (p = 0) is a real, if extreme, result.
  for (int64_t j = 0; j < length - 1; ++j) {
    const double lp = static_cast<double>(log_probs[j]);
    check(!std::isnan(lp) && lp <= 0.0, "log-prob at position ", j + 1, " of window ", windows_ + 1, " is ",
          lp, ", expected a value <= 0");
  }
  const int64_t buckets = (length + bucket_size_ - 1) / bucket_size_;
  if (buckets > num_buckets()) {
    sums_.resize(buckets, 0.0);
    counts_.resize(buckets, 0);
  }
  for (int64_t j = 0; j < length - 1; ++j) {
    const int64_t b = (j + 1) / bucket_size_;
    sums_[b] -= static_cast<double>(log_probs[j]);
    counts_[b] += 1;
  }
  max_window_length_ = std::max(max_window_length_, length);
  ++windows_;
}

void BucketLoss::add_window(std::span<const double> log_probs) { add(log_probs); }
void BucketLoss::add_window(std::span<const float> log_probs) { add(log_probs); }

void BucketLoss::merge(const BucketLoss& other) {
  check(other.bucket_size_ == bucket_size_, "cannot merge bucket losses of bucket size ", other.bucket_size_,
        " into bucket size ", bucket_size_);
  if (other.num_buckets() > num_buckets()) {
    sums_.resize(other.sums_.size(), 0.0);
    counts_.resize(other.counts_.size(), 0);
  }
  for (size_t b = 0; b < other.sums_.size(); ++b) {
    sums_[b] += other.sums_[b];
    counts_[b] += other.counts_[b];
  }
  windows_ += other.windows_;
  max_window_length_ = std::max(max_window_length_, other.max_window_length_);
}

int64_t BucketLoss::bucket_start(int64_t b) const {
  check(b >= 0 && b < num_buckets(), "bucket ", b, " out of range [0, ", num_buckets(), ")");
  return b * bucket_size_;
}

int64_t BucketLoss::bucket_end(int64_t b) const {
  return std::min(bucket_start(b) + bucket_size_, max_window_length_);
}

double BucketLoss::sum(int64_t b) const {
  bucket_start(b);  // range check
  return sums_[b];
}

int64_t BucketLoss::count(int64_t b) const {
  bucket_start(b);
  return counts_[b];
}

double BucketLoss::mean(int64_t b) const {
  check(count(b) > 0, "bucket ", b, " [", bucket_start(b), ", ", bucket_end(b), ") has no tokens");
  return sums_[b] / static_cast<double>(counts_[b]);
}

int64_t BucketLoss::total_count() const {
  int64_t n = 0;
  for (int64_t c : counts_) n += c;
  return n;
}

double BucketLoss::total_sum() const {
  double s = 0.0;
  for (double v : sums_) s += v;
  return s;
}

double BucketLoss::overall_mean() const {
  const int64_t n = total_count();
  check(n > 0, "no tokens were evaluated (every window shorter than 2 tokens?)");
  return total_sum() / static_cast<double>(n);
}

}  // namespace spindle
