// Which implementation ran for each layer and op. Every op reports itself here; an op that had
// to use a slow or dense path says so loudly, and under --strict-kernels that is an error.
// (A sparse-attention layer silently falling back to dense attention doubled another trainer's
// memory; DESIGN.md, lesson 1.)
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace spindle {

enum class KernelPath { Fast, Fallback };

class KernelRecord {
 public:
  static KernelRecord& instance();

  // Fail on any fallback from now on.
  void set_strict(bool strict) { strict_ = strict; }
  bool strict() const { return strict_; }

  // Notes that `op` of `layer` (-1: not a layer op) ran `implementation`. A fallback is logged
  // once per (layer, op) with `why`; under strict mode it throws.
  void record(int64_t layer, const std::string& op, const std::string& implementation, KernelPath path,
              const std::string& why = "");

  // One line per (layer, op): implementation and call count.
  std::string report() const;
  int64_t fallbacks() const { return fallbacks_; }
  void clear();

 private:
  struct Entry {
    std::string implementation;
    KernelPath path = KernelPath::Fast;
    int64_t calls = 0;
  };
  bool strict_ = false;
  int64_t fallbacks_ = 0;
  std::map<std::pair<int64_t, std::string>, Entry> entries_;
};

}  // namespace spindle
