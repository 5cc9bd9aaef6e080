// Held-out next-token loss accumulated per position bucket: bucket b covers positions
// [b*B, (b+1)*B) of each evaluation window, so the loss can be read against how much context
// a token had (DESIGN.md lesson 7).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace spindle {

class BucketLoss {
 public:
  explicit BucketLoss(int64_t bucket_size);

  // Adds one window. `log_probs[j]` is log p(token_{j+1} | tokens_<=j), as sequence_log_probs
  // returns it: position 0 has no prediction, so the window is log_probs.size() + 1 tokens long.
  void add_window(std::span<const double> log_probs);
  void add_window(std::span<const float> log_probs);

  // Adds the sums and counts of `other` (same bucket size), e.g. from another process.
  void merge(const BucketLoss& other);

  int64_t bucket_size() const { return bucket_size_; }
  int64_t num_buckets() const { return static_cast<int64_t>(sums_.size()); }
  int64_t windows() const { return windows_; }
  // Longest window added, in tokens; the last bucket ends there.
  int64_t max_window_length() const { return max_window_length_; }
  int64_t bucket_start(int64_t b) const;
  int64_t bucket_end(int64_t b) const;  // exclusive, clipped to the longest window

  double sum(int64_t b) const;
  int64_t count(int64_t b) const;
  // Mean loss in nats of bucket b; fails on an empty bucket.
  double mean(int64_t b) const;

  int64_t total_count() const;
  double total_sum() const;
  // Token-weighted mean over all positions (not the mean of bucket means).
  double overall_mean() const;

 private:
  template <class T>
  void add(std::span<const T> log_probs);

  int64_t bucket_size_;
  int64_t windows_ = 0;
  int64_t max_window_length_ = 0;
  std::vector<double> sums_;
  std::vector<int64_t> counts_;
};

}  // namespace spindle
