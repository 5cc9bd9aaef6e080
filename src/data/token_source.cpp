#include "data/token_source.h"

#include "core/error.h"
#include "data/window_sampler.h"
#include "io/token_text.h"

namespace spindle {

TokenSource::TokenSource(const std::string& path) : path_(path) {
  if (sequence_format_of(path))
    sequences_ = open_sequences(path);
  else
    text_ = read_token_text(path);
}

std::vector<int32_t> TokenSource::window(int64_t length, const std::string& option) const {
  if (is_text()) {
    check(text_size() >= length, path_, " has ", text_.size(), " tokens, ", option, " ", length,
          " needs more (give a longer --tokens file, e.g. a FASTA, or --random-tokens)");
    return {text_.begin(), text_.begin() + length};
  }
  std::vector<int32_t> tokens(static_cast<size_t>(length));
  WindowSampler(*sequences_, length, 1, 0.0).next(tokens.data());
  return tokens;
}

}  // namespace spindle
