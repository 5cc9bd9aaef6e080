// Command-line options of the form `--name value` and `--flag`; anything unexpected is an error.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace spindle {

class Args {
 public:
  // `options` take a value, `flags` do not.
  Args(const std::string& command, const std::vector<std::string>& argv, const std::set<std::string>& options,
       const std::set<std::string>& flags = {});

  std::string required(const std::string& name) const;
  std::optional<std::string> optional(const std::string& name) const;
  std::string value_or(const std::string& name, const std::string& fallback) const;
  int64_t int_or(const std::string& name, int64_t fallback) const;
  // A finite number > 0 (`expected` says what, for the error), or the fallback's.
  double positive_or(const std::string& name, const std::string& fallback, const char* expected) const;
  // A size given in GiB, in bytes; none when the option is absent.
  std::optional<int64_t> gib_bytes(const std::string& name) const;
  bool flag(const std::string& name) const { return flags_.count(name) != 0; }

 private:
  std::string command_;
  std::map<std::string, std::string> values_;
  std::set<std::string> flags_;
};

}  // namespace spindle
