// A view of token sequences restricted to the same fraction of each: e.g. the first 80% for
// training and the last 20% held out, when one file serves both.
#pragma once

#include <memory>
#include <string>

#include "data/sequence_source.h"

namespace spindle {

// Sequence i of the view is tokens [floor(begin * n_i), floor(end * n_i)) of sequence i of
// `base`, with 0 <= begin < end <= 1. `base` must outlive the view.
std::unique_ptr<TokenSequences> sequence_range(const TokenSequences& base, double begin, double end);

}  // namespace spindle
