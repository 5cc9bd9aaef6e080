// The host memory this process may use, for the planner's host budget, and this process's peak
// use of it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace spindle {

// The machine's physical memory, or the memory limit of the process's control group where that is
// lower (a container's or a batch job's: past it the kernel kills the process, as no error would).
int64_t host_memory_bytes();

// A control group's memory limit as its file states it (cgroup v2 memory.max: "max" or bytes;
// v1 memory.limit_in_bytes: bytes, a value near 2^63 meaning none); nothing where there is none, or
// the file cannot be read or holds no plain number.
std::optional<int64_t> cgroup_memory_limit(const std::string& path);

// The most resident memory this process has held so far (VmHWM of /proc/self/status).
int64_t host_peak_resident_bytes();

}  // namespace spindle
