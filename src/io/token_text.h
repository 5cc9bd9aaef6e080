// Token ids as text: whitespace-separated non-negative integers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace spindle {

// Reads `path`; a non-integer or out-of-int32 entry is an error naming the file, line and text.
std::vector<int32_t> read_token_text(const std::string& path);

}  // namespace spindle
