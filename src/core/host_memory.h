// The machine's physical memory, for the planner's host budget.
#pragma once

#include <cstdint>

namespace spindle {

int64_t host_memory_bytes();

}  // namespace spindle
