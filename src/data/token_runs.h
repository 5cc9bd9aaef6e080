// Where one token id (N, for DNA) occurs in each sequence, kept as sorted runs, so that the
// number of such tokens in any window is a binary search rather than a read of the window.
// Built by one pass over the data; human chromosomes have a handful of long N runs.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "data/sequence_source.h"

namespace spindle {

class TokenRuns {
 public:
  TokenRuns(const TokenSequences& data, int32_t token);

  int32_t token() const { return token_; }
  // Occurrences of the token in tokens [start, start + length) of `sequence`.
  int64_t count(int64_t sequence, int64_t start, int64_t length) const;
  // Occurrences in the whole sequence, and the number of runs.
  int64_t total(int64_t sequence) const;
  int64_t runs(int64_t sequence) const;
  // The longest stretch of `sequence` without the token.
  int64_t longest_gap(int64_t sequence) const;
  // The window of `length` tokens (<= the sequence length) with the fewest occurrences:
  // {start, count}, the earliest start on ties.
  std::pair<int64_t, int64_t> fewest(int64_t sequence, int64_t length) const;

 private:
  struct Sequence {
    int64_t length = 0;
    std::vector<int64_t> begin, end;  // runs [begin[k], end[k]), sorted, disjoint, not adjacent
    std::vector<int64_t> before;      // before[k]: tokens in runs 0..k-1 (one more entry than runs)
  };
  const Sequence& at(int64_t sequence) const;

  int32_t token_;
  std::vector<Sequence> sequences_;
};

}  // namespace spindle
