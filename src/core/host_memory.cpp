#include "core/host_memory.h"

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"

namespace spindle {

int64_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  check(pages > 0 && page > 0, "cannot read the machine's physical memory (sysconf)");
  return static_cast<int64_t>(pages) * page;
}

int64_t host_peak_resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) != 0) continue;
    std::istringstream fields(line.substr(6));
    int64_t kib = 0;
    std::string unit;
    fields >> kib >> unit;
    check(fields && unit == "kB", "cannot parse '", line, "' of /proc/self/status");
    return kib * 1024;
  }
  fail("/proc/self/status has no VmHWM line");
}

}  // namespace spindle
