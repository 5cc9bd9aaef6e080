// Running an external program (no shell): its exit status, stderr, and stdout to a file or a string.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace spindle {

struct ProcessResult {
  int exit_code = 0;   // 128 + signal when killed by one
  std::string output;  // stdout, unless it went to a file
  std::string errors;  // stderr
};

// Runs argv[0] (searched on PATH) in `cwd` (the current directory when empty), stdout to
// `stdout_path` when given. A program that cannot be started is an error naming it.
ProcessResult run_process(const std::vector<std::string>& argv, const std::string& cwd = {},
                          const std::string& stdout_path = {});

// The full path of `program` on PATH, if any.
std::optional<std::string> find_program(const std::string& program);

}  // namespace spindle
