// The host budget the planner gives train and bench: the machine's memory, or a control group's
// limit where that is lower.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "core/host_memory.h"
#include "scratch_dir.h"

namespace spindle {
namespace {

class HostMemory : public ScratchDirTest {
 protected:
  std::string file_with(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }
};

TEST_F(HostMemory, ControlGroupLimitsAreReadAsTheirFilesStateThem) {
  EXPECT_EQ(cgroup_memory_limit(file_with("v2", "68719476736\n")), int64_t{68719476736});
  EXPECT_EQ(cgroup_memory_limit(file_with("v1", "1073741824")), int64_t{1} << 30);
  EXPECT_FALSE(cgroup_memory_limit(file_with("unlimited_v2", "max\n")));
  EXPECT_FALSE(cgroup_memory_limit(file_with("unlimited_v1", "9223372036854771712\n")));
  EXPECT_FALSE(cgroup_memory_limit(file_with("garbled", "12 GiB\n")));
  EXPECT_FALSE(cgroup_memory_limit(file_with("empty", "")));
  EXPECT_FALSE(cgroup_memory_limit((dir_ / "absent").string()));
}

TEST_F(HostMemory, TheBudgetIsAtMostThePhysicalMemory) {
  const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  const int64_t budget = host_memory_bytes();
  EXPECT_GT(budget, 0);
  EXPECT_LE(budget, physical);
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    if (const auto limit = cgroup_memory_limit(path)) {
      EXPECT_LE(budget, *limit) << path;
    }
  }
}

}  // namespace
}  // namespace spindle
