// The machine's physical memory, for the planner's host budget, and this process's peak use of it.
#pragma once

#include <cstdint>

namespace spindle {

int64_t host_memory_bytes();

// The most resident memory this process has held so far (VmHWM of /proc/self/status).
int64_t host_peak_resident_bytes();

}  // namespace spindle
