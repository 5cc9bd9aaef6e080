// Which implementation ran for each op of each layer kind, so a run can show (and
// --strict-kernels can enforce) that no op fell back to a slow or dense path.
#pragma once

#include <map>
#include <string>
#include <utility>

#include "core/error.h"

namespace spindle::cuda {

class KernelRecord {
 public:
  struct Entry {
    std::string implementation;
    bool fallback = false;  // a slow or dense stand-in for the intended kernel
    int64_t calls = 0;
  };

  explicit KernelRecord(bool strict = false) : strict_(strict) {}

  // `site` names the layer kind and op, e.g. "kda/recurrence". Under strict, a fallback fails at once.
  void note(const std::string& site, const std::string& implementation, bool fallback = false) {
    check(!(strict_ && fallback), "--strict-kernels: ", site, " fell back to ", implementation);
    Entry& e = entries_[site];
    e.implementation = implementation;
    e.fallback = e.fallback || fallback;
    ++e.calls;
  }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  bool any_fallback() const {
    for (const auto& [site, e] : entries_)
      if (e.fallback) return true;
    return false;
  }

 private:
  bool strict_;
  std::map<std::string, Entry> entries_;
};

}  // namespace spindle::cuda
