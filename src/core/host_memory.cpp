#include "core/host_memory.h"

#include <unistd.h>

#include "core/error.h"

namespace spindle {

int64_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  check(pages > 0 && page > 0, "cannot read the machine's physical memory (sysconf)");
  return static_cast<int64_t>(pages) * page;
}

}  // namespace spindle
