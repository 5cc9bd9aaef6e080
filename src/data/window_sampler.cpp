#include "data/window_sampler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/log.h"

namespace spindle {
namespace {

void check_policy(const TokenSequences& data, int64_t length, double max_n_fraction) {
  check(length > 0, "window length must be positive, got ", length, " (data ", data.source(), ")");
  check(max_n_fraction >= 0.0 && max_n_fraction <= 1.0, "max_n_fraction must be in [0, 1], got ",
        max_n_fraction);
  int64_t longest = 0, longest_index = 0;
  for (int64_t i = 0; i < data.size(); ++i) {
    if (data.length(i) > longest) longest = data.length(i), longest_index = i;
  }
  check(length <= longest, "window of ", length, " tokens is longer than every sequence of ", data.source(),
        ": the longest is '", data.name(longest_index), "' with ", longest, " tokens");
}

// N tokens a window of `length` may hold; the epsilon keeps 0.29 * 100 at 29.
int64_t allowed_n(double max_n_fraction, int64_t length) {
  return static_cast<int64_t>(std::floor(max_n_fraction * static_cast<double>(length) + 1e-9));
}

// Uniform in [0, n) without modulo bias.
uint64_t below(Random& random, uint64_t n) {
  const uint64_t threshold = (0 - n) % n;  // 2^64 mod n: values under it would favour small results
  for (;;) {
    const uint64_t r = random.next();
    if (r >= threshold) return r % n;
  }
}

}  // namespace

WindowSampler::WindowSampler(const TokenSequences& data, int64_t length, uint64_t seed, double max_n_fraction)
    : WindowSampler(data, WindowPolicy{length, max_n_fraction, kTokenN, 10000}, seed) {}

WindowSampler::WindowSampler(const TokenSequences& data, const WindowPolicy& policy, uint64_t seed)
    : data_(data), policy_(policy), seed_(seed), random_(seed) {
  const int64_t length = policy.length;
  check_policy(data, length, policy.max_n_fraction);
  check(policy.max_tries > 0, "max_tries must be positive, got ", policy.max_tries);
  max_n_ = allowed_n(policy.max_n_fraction, length);
  if (max_n_ < length) n_runs_ = std::make_unique<TokenRuns>(data, policy.n_token);

  // Sequences without a single acceptable window get no weight, so tries are not wasted on them.
  first_start_.push_back(0);
  int64_t too_short = 0, too_many_n = 0;
  std::pair<int64_t, int64_t> fewest{-1, -1};  // {sequence, N count} of the best window anywhere
  for (int64_t i = 0; i < data.size(); ++i) {
    const int64_t n = data.length(i);
    if (n < length) {
      ++too_short;
      continue;
    }
    if (n_runs_) {
      const int64_t best = n_runs_->fewest(i, length).second;
      if (fewest.first < 0 || best < fewest.second) fewest = {i, best};
      if (best > max_n_) {
        ++too_many_n;
        continue;
      }
    }
    sequence_index_.push_back(i);
    first_start_.push_back(first_start_.back() + (n - length + 1));
  }
  if (sequence_index_.empty()) {
    const auto [start, n] = n_runs_->fewest(fewest.first, length);
    fail("no window of ", length, " tokens in ", data.source(), " has at most ", max_n_,
         " N tokens (max_n_fraction ", policy.max_n_fraction, "): the fewest is ", n, " in sequence '",
         data.name(fewest.first), "' at ", start, "; its longest N-free stretch is ",
         n_runs_->longest_gap(fewest.first), " tokens");
  }
  if (too_short > 0)
    log_info(too_short, " sequence(s) of ", data.source(), " are shorter than the window of ", length,
             " tokens and are never sampled");
  if (too_many_n > 0)
    log_info(too_many_n, " sequence(s) of ", data.source(), " have no window of ", length,
             " tokens with at most ", max_n_, " N tokens and are never sampled");
}

bool WindowSampler::acceptable(const Window& window) const {
  return !n_runs_ || n_runs_->count(window.sequence, window.start, policy_.length) <= max_n_;
}

Window WindowSampler::next() {
  const auto total = static_cast<uint64_t>(first_start_.back());
  for (int64_t attempt = 0; attempt < policy_.max_tries; ++attempt) {
    const auto u = static_cast<int64_t>(below(random_, total));
    const auto k = static_cast<size_t>(std::upper_bound(first_start_.begin(), first_start_.end(), u) -
                                       first_start_.begin() - 1);
    const Window window{sequence_index_[k], u - first_start_[k]};
    if (acceptable(window)) {
      ++position_;
      return window;
    }
  }
  fail("drew ", policy_.max_tries, " windows of ", policy_.length, " tokens from ", data_.source(),
       " (window ", position_, ") and every one had more than ", max_n_,
       " N tokens: acceptable windows are too rare; shorten the window or raise max_n_fraction");
}

Window WindowSampler::next(int32_t* out) {
  const Window window = next();
  read_window(data_, window, policy_.length, out);
  return window;
}

void WindowSampler::seek(int64_t position) {
  check(position >= 0, "cannot seek the window sampler to negative position ", position);
  if (position < position_) {
    random_ = Random(seed_);
    position_ = 0;
  }
  while (position_ < position) next();
}

std::vector<Window> evaluation_windows(const TokenSequences& data, int64_t length, int64_t count,
                                       double max_n_fraction, int32_t n_token) {
  check_policy(data, length, max_n_fraction);
  check(count > 0, "number of evaluation windows must be positive, got ", count);
  const int64_t max_n = allowed_n(max_n_fraction, length);
  std::unique_ptr<TokenRuns> n_runs;
  if (max_n < length) n_runs = std::make_unique<TokenRuns>(data, n_token);

  std::vector<Window> candidates;
  int64_t rejected = 0;
  for (int64_t i = 0; i < data.size(); ++i) {
    for (int64_t start = 0; start + length <= data.length(i); start += length) {
      if (n_runs && n_runs->count(i, start, length) > max_n) {
        ++rejected;
      } else {
        candidates.push_back({i, start});
      }
    }
  }
  check(!candidates.empty(), "none of the ", rejected, " consecutive windows of ", length, " tokens in ",
        data.source(), " has at most ", max_n, " N tokens (max_n_fraction ", max_n_fraction,
        "): no evaluation window");
  const auto m = static_cast<int64_t>(candidates.size());
  if (m <= count) {
    if (m < count) {
      log_warn("only ", m, " evaluation windows of ", length, " tokens fit ", data.source(), " (", rejected,
               " more have too many N), fewer than the ", count, " asked for");
    }
    return candidates;
  }
  std::vector<Window> chosen;
  for (int64_t j = 0; j < count; ++j)
    chosen.push_back(candidates[static_cast<size_t>((2 * j + 1) * m / (2 * count))]);
  return chosen;
}

void read_window(const TokenSequences& data, const Window& window, int64_t length, int32_t* out) {
  data.read(window.sequence, window.start, length, out);
}

}  // namespace spindle
