// Fixed-length training windows drawn reproducibly from token sequences, and fixed held-out
// evaluation windows.
//
// Draw: a sequence with probability proportional to its number of window starts, then a uniform
// start (together: uniform over all window positions). Windows with more than max_n_fraction of
// their tokens equal to the N token are drawn again (N-run policy). The seed and the number of
// windows drawn so far determine every later window, so a run resumes with seek(position()).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/random.h"
#include "data/nucleotide_tokenizer.h"
#include "data/sequence_source.h"
#include "data/token_runs.h"

namespace spindle {

struct Window {
  int64_t sequence = 0;
  int64_t start = 0;
  bool operator==(const Window&) const = default;
};

struct WindowPolicy {
  int64_t length = 0;           // tokens per window
  double max_n_fraction = 1.0;  // in [0, 1]; 1 accepts every window and skips the scan for N
  int32_t n_token = kTokenN;    // the id counted as N
  int64_t max_tries = 10000;    // draws per window before giving up
};

class WindowSampler {
 public:
  // `data` must outlive the sampler. With an N policy the data is scanned once for N runs.
  WindowSampler(const TokenSequences& data, const WindowPolicy& policy, uint64_t seed);
  WindowSampler(const TokenSequences& data, int64_t length, uint64_t seed, double max_n_fraction = 1.0);

  Window next();
  // The next window, with its policy.length tokens written to `out`.
  Window next(int32_t* out);

  // Windows drawn so far.
  int64_t position() const { return position_; }
  // Makes the next window the one a fresh sampler would draw after `position` windows
  // (replays the draws: microseconds each, no data is read).
  void seek(int64_t position);

  const WindowPolicy& policy() const { return policy_; }
  // The generator's state: with the seed and position() it pins down the data stream, so a
  // resumed run can check that it reads the same data.
  std::array<uint64_t, 4> random_state() const { return random_.state(); }
  uint64_t seed() const { return seed_; }

 private:
  bool acceptable(const Window& window) const;

  const TokenSequences& data_;
  WindowPolicy policy_;
  uint64_t seed_;
  int64_t max_n_ = 0;                    // N tokens allowed per window
  std::unique_ptr<TokenRuns> n_runs_;    // null when every window is acceptable
  std::vector<int64_t> sequence_index_;  // sequences that can yield a window
  std::vector<int64_t> first_start_;     // cumulative window starts, one more entry
  Random random_;
  int64_t position_ = 0;
};

// `count` non-overlapping windows of `length` tokens spread evenly over the data: the sequences are
// cut into consecutive windows from their starts, those with more than max_n_fraction N tokens
// are dropped, and `count` of the rest are taken at even spacing. Depends only on the data and
// the arguments. Fewer acceptable windows than `count` gives them all, with a warning.
std::vector<Window> evaluation_windows(const TokenSequences& data, int64_t length, int64_t count,
                                       double max_n_fraction, int32_t n_token = kTokenN);

// Reads the tokens of `window` (length tokens) to `out`.
void read_window(const TokenSequences& data, const Window& window, int64_t length, int32_t* out);

}  // namespace spindle
