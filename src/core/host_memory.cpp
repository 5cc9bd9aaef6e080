#include "core/host_memory.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"

namespace spindle {

namespace {

// Limits at or past this many bytes are cgroup v1's "none" (2^63 rounded down to a page).
constexpr int64_t kNoLimit = int64_t{1} << 62;

// The files that may hold this process's memory limit: its own cgroup v2 group's (the path of the
// "0::" line of /proc/self/cgroup), and the root files a container sees as its own group's (v2,
// then v1).
std::vector<std::string> limit_files() {
  std::vector<std::string> files;
  std::ifstream groups("/proc/self/cgroup");
  std::string line;
  while (std::getline(groups, line))
    if (line.rfind("0::", 0) == 0 && line != "0::/")  // the root group's is the root file below
      files.push_back("/sys/fs/cgroup" + line.substr(3) + "/memory.max");
  files.push_back("/sys/fs/cgroup/memory.max");
  files.push_back("/sys/fs/cgroup/memory/memory.limit_in_bytes");
  return files;
}

}  // namespace

std::optional<int64_t> cgroup_memory_limit(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  if (!std::getline(file, line)) return std::nullopt;
  std::istringstream fields(line);
  int64_t bytes = 0;
  std::string rest;
  if (!(fields >> bytes) || fields >> rest || bytes <= 0 || bytes >= kNoLimit)
    return std::nullopt;  // "max" too
  return bytes;
}

int64_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  check(pages > 0 && page > 0, "cannot read the machine's physical memory (sysconf)");
  int64_t bytes = static_cast<int64_t>(pages) * page;
  for (const std::string& path : limit_files())
    if (const std::optional<int64_t> limit = cgroup_memory_limit(path)) bytes = std::min(bytes, *limit);
  return bytes;
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
