#include "backend/kernel_record.h"

#include <sstream>

#include "core/error.h"
#include "core/log.h"

namespace spindle {

KernelRecord& KernelRecord::instance() {
  static KernelRecord record;
  return record;
}

void KernelRecord::record(int64_t layer, const std::string& op, const std::string& implementation,
                          KernelPath path, const std::string& why) {
  const std::string where = layer >= 0 ? "layer " + std::to_string(layer) + " " + op : op;
  if (path == KernelPath::Fallback) {
    check(!strict_, "--strict-kernels: ", where, " would run the fallback ", implementation, ": ", why);
  }
  Entry& entry = entries_[{layer, op}];
  if (entry.calls == 0 && path == KernelPath::Fallback) {
    ++fallbacks_;
    log_warn(where, " runs the FALLBACK ", implementation, " (", why,
             "); --strict-kernels makes this an error");
  }
  entry.implementation = implementation;
  entry.path = path;
  ++entry.calls;
}

std::string KernelRecord::report() const {
  std::ostringstream out;
  for (const auto& [key, entry] : entries_) {
    out << (key.first >= 0 ? "layer " + std::to_string(key.first) : std::string("model")) << "  "
        << key.second << "  " << entry.implementation
        << (entry.path == KernelPath::Fallback ? "  FALLBACK" : "") << "  x" << entry.calls << "\n";
  }
  return out.str();
}

void KernelRecord::clear() {
  entries_.clear();
  fallbacks_ = 0;
}

}  // namespace spindle
