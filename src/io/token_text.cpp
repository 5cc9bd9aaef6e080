#include "io/token_text.h"

#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace spindle {

std::vector<int32_t> read_token_text(const std::string& path) {
  std::ifstream in(path);
  check(in.good(), "cannot read token file '", path, "'");
  std::vector<int32_t> tokens;
  std::string line, word;
  int64_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    std::istringstream words(line);
    while (words >> word) {
      bool digits = !word.empty() && word.size() <= 10;
      for (char ch : word) digits = digits && ch >= '0' && ch <= '9';
      const long long value = digits ? std::stoll(word) : -1;
      check(digits && value <= std::numeric_limits<int32_t>::max(), "token file '", path, "' line ",
            line_number, ": '", word, "' is not a token id (a non-negative integer)");
      tokens.push_back(static_cast<int32_t>(value));
    }
  }
  check(!tokens.empty(), "token file '", path, "' holds no token ids");
  return tokens;
}

}  // namespace spindle
