#include "data/token_runs.h"

#include <algorithm>

#include "core/error.h"

namespace spindle {

TokenRuns::TokenRuns(const TokenSequences& data, int32_t token) : token_(token) {
  constexpr int64_t kChunk = int64_t{1} << 22;
  std::vector<int32_t> buffer;
  sequences_.resize(static_cast<size_t>(data.size()));
  for (int64_t i = 0; i < data.size(); ++i) {
    Sequence& s = sequences_[static_cast<size_t>(i)];
    s.length = data.length(i);
    int64_t run_begin = -1;  // the open run, if any; runs continue across chunks
    for (int64_t at = 0; at < s.length; at += kChunk) {
      const int64_t n = std::min(kChunk, s.length - at);
      buffer.resize(static_cast<size_t>(n));
      data.read(i, at, n, buffer.data());
      for (int64_t k = 0; k < n; ++k) {
        const bool hit = buffer[static_cast<size_t>(k)] == token;
        if (hit && run_begin < 0) {
          run_begin = at + k;
        } else if (!hit && run_begin >= 0) {
          s.begin.push_back(run_begin);
          s.end.push_back(at + k);
          run_begin = -1;
        }
      }
    }
    if (run_begin >= 0) {
      s.begin.push_back(run_begin);
      s.end.push_back(s.length);
    }
    s.before.assign(1, 0);
    for (size_t k = 0; k < s.begin.size(); ++k) s.before.push_back(s.before.back() + s.end[k] - s.begin[k]);
  }
}

const TokenRuns::Sequence& TokenRuns::at(int64_t sequence) const {
  check(sequence >= 0 && sequence < static_cast<int64_t>(sequences_.size()), "sequence index ", sequence,
        " is out of range (", sequences_.size(), " sequences)");
  return sequences_[static_cast<size_t>(sequence)];
}

int64_t TokenRuns::count(int64_t sequence, int64_t start, int64_t length) const {
  const Sequence& s = at(sequence);
  const int64_t stop = start + length;
  // Runs first..last-1 overlap [start, stop): those ending after start and beginning before stop.
  const auto first = static_cast<size_t>(std::upper_bound(s.end.begin(), s.end.end(), start) - s.end.begin());
  const auto last =
      static_cast<size_t>(std::lower_bound(s.begin.begin(), s.begin.end(), stop) - s.begin.begin());
  if (first >= last) return 0;
  int64_t n = s.before[last] - s.before[first];
  n -= std::max<int64_t>(0, start - s.begin[first]);  // the part of the first run before the window
  n -= std::max<int64_t>(0, s.end[last - 1] - stop);  // the part of the last run after it
  return n;
}

int64_t TokenRuns::total(int64_t sequence) const { return at(sequence).before.back(); }

int64_t TokenRuns::runs(int64_t sequence) const { return static_cast<int64_t>(at(sequence).begin.size()); }

int64_t TokenRuns::longest_gap(int64_t sequence) const {
  const Sequence& s = at(sequence);
  int64_t longest = 0, previous_end = 0;
  for (size_t k = 0; k < s.begin.size(); ++k) {
    longest = std::max(longest, s.begin[k] - previous_end);
    previous_end = s.end[k];
  }
  return std::max(longest, s.length - previous_end);
}

std::pair<int64_t, int64_t> TokenRuns::fewest(int64_t sequence, int64_t length) const {
  const Sequence& s = at(sequence);
  check(length > 0 && length <= s.length, "window of ", length, " tokens does not fit sequence ", sequence,
        " of length ", s.length);
  // The count is piecewise linear in the start, so its minimum lies where a window edge meets a
  // run edge, or at either end of the sequence.
  const int64_t last_start = s.length - length;
  std::vector<int64_t> candidates = {0, last_start};
  for (size_t k = 0; k < s.begin.size(); ++k) {
    if (s.end[k] <= last_start) candidates.push_back(s.end[k]);
    if (s.begin[k] - length >= 0) candidates.push_back(s.begin[k] - length);
  }
  std::pair<int64_t, int64_t> best{0, count(sequence, 0, length)};
  for (int64_t start : candidates) {
    const int64_t n = count(sequence, start, length);
    if (n < best.second || (n == best.second && start < best.first)) best = {start, n};
  }
  return best;
}

}  // namespace spindle
