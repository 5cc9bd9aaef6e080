#include "core/parallel.h"

#include <cstdlib>
#include <string>

namespace spindle {

int worker_count() {
  // SPINDLE_THREADS overrides the core count (tests pin it to check thread independence).
  static const int count = [] {
    if (const char* env = std::getenv("SPINDLE_THREADS")) {
      const int n = std::atoi(env);
      if (n > 0) return n;
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(hw);
  }();
  return count;
}

}  // namespace spindle
