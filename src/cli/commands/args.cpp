#include "cli/args.h"

#include <cmath>

#include "core/error.h"

namespace spindle {

Args::Args(const std::string& command, const std::vector<std::string>& argv,
           const std::set<std::string>& options, const std::set<std::string>& flags)
    : command_(command) {
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    check(a.rfind("--", 0) == 0, "spindle ", command, ": unexpected argument '", a, "'");
    const std::string name = a.substr(2);
    if (flags.count(name)) {
      flags_.insert(name);
    } else if (options.count(name)) {
      check(i + 1 < argv.size(), "spindle ", command, ": option --", name, " needs a value");
      values_[name] = argv[++i];
    } else {
      fail("spindle ", command, ": unknown option '", a, "' (see spindle help)");
    }
  }
}

std::string Args::required(const std::string& name) const {
  auto it = values_.find(name);
  check(it != values_.end(), "spindle ", command_, ": missing required option --", name);
  return it->second;
}

std::optional<std::string> Args::optional(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::string Args::value_or(const std::string& name, const std::string& fallback) const {
  return optional(name).value_or(fallback);
}

int64_t Args::int_or(const std::string& name, int64_t fallback) const {
  auto v = optional(name);
  if (!v) return fallback;
  size_t used = 0;
  int64_t parsed = 0;
  try {
    parsed = std::stoll(*v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  check(used == v->size() && !v->empty(), "spindle ", command_, ": --", name, " expects an integer, got '",
        *v, "'");
  return parsed;
}

double Args::positive_or(const std::string& name, const std::string& fallback, const char* expected) const {
  const std::string text = value_or(name, fallback);
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  check(used == text.size() && std::isfinite(value) && value > 0, "spindle ", command_, ": --", name,
        " takes ", expected, ", got '", text, "'");
  return value;
}

std::optional<int64_t> Args::gib_bytes(const std::string& name) const {
  if (!optional(name)) return std::nullopt;
  return static_cast<int64_t>(positive_or(name, "", "a size in GiB") * static_cast<double>(int64_t{1} << 30));
}

}  // namespace spindle
