#include "train/checkpoint_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/log.h"

namespace spindle {

namespace {

namespace fs = std::filesystem;

constexpr const char* kLatest = "latest";
constexpr const char* kTmpMarker = ".tmp-";

std::string errno_text() { return std::strerror(errno); }

// The step of a name "step-<digits>", or -1 for any other name (temporaries included).
int64_t parse_step(const std::string& name) {
  if (!name.starts_with("step-") || name.size() == 5 || name.size() > 5 + 18) return -1;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

std::string temp_suffix(const char* what = "") {
  return std::string(kTmpMarker) + std::to_string(::getpid()) + what;
}

// fsync of one file or directory; directories are best effort (some file systems refuse).
void sync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) fail("cannot open ", path.string(), " to fsync it: ", errno_text());
  const int rc = ::fsync(fd);
  const std::string reason = errno_text();
  ::close(fd);
  if (rc != 0 && !directory) fail("cannot fsync ", path.string(), ": ", reason);
}

// Makes every file under `dir` and the directory entries themselves durable.
void sync_tree(const fs::path& dir) {
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_directory())
      sync_path(entry.path(), true);
    else if (entry.is_regular_file())
      sync_path(entry.path(), false);
  }
  sync_path(dir, true);
}

void rename_or_fail(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    fail("cannot rename ", from.string(), " to ", to.string(), ": ", errno_text());
}

// Writes `text` to `path` atomically and durably.
void write_pointer(const fs::path& path, const std::string& text) {
  const fs::path temp = path.string() + temp_suffix();
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create ", temp.string(), ": ", errno_text());
  const ssize_t n = ::write(fd, text.data(), text.size());
  const bool ok = n == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
  const std::string reason = errno_text();
  ::close(fd);
  if (!ok) {
    ::unlink(temp.c_str());
    fail("cannot write ", temp.string(), ": ", reason);
  }
  rename_or_fail(temp, path);
  sync_path(path.parent_path(), true);
}

// Removes a directory without ever leaving a partial one under a complete-looking name.
void remove_checkpoint(const fs::path& dir) {
  const fs::path doomed = dir.string() + temp_suffix("-old");
  rename_or_fail(dir, doomed);
  std::error_code ec;
  fs::remove_all(doomed, ec);
  if (ec) log_warn("could not remove old checkpoint ", doomed.string(), ": ", ec.message());
}

// Whether the writer of a temporary named "...tmp-<pid>..." may still be running.
bool writer_alive(const std::string& name) {
  const size_t at = name.find(kTmpMarker);
  const char* digits = name.c_str() + at + std::strlen(kTmpMarker);
  char* end = nullptr;
  const long pid = std::strtol(digits, &end, 10);
  if (end == digits || pid <= 0) return false;
  if (pid == ::getpid()) return false;  // this process is reading, not writing
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

// step-N directories under `root` with their steps, newest first.
std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  for (const fs::directory_entry& entry : fs::directory_iterator(root)) {
    const int64_t step = parse_step(entry.path().filename().string());
    if (step >= 0 && entry.is_directory()) out.emplace_back(step, entry.path());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

}  // namespace

std::string checkpoint_name(int64_t step) {
  check(step >= 0, "checkpoint step must be >= 0, got ", step);
  char name[32];
  std::snprintf(name, sizeof(name), "step-%06lld", static_cast<long long>(step));
  return name;
}

int64_t checkpoint_step(const std::string& dir) {
  const std::string name = fs::path(dir).lexically_normal().filename().string();
  const int64_t step = parse_step(name.empty() ? fs::path(dir).parent_path().filename().string() : name);
  check(step >= 0, "checkpoint directory ", dir, " is not named step-<N>");
  return step;
}

CheckpointWriter::CheckpointWriter(std::string root, int64_t keep) : root_(std::move(root)), keep_(keep) {
  check(!root_.empty(), "checkpoint directory must not be empty");
  check(keep_ >= 1, "checkpoint keep must be >= 1, got ", keep_);
}

std::string CheckpointWriter::write(int64_t step, const std::function<void(const std::string& dir)>& fill) {
  const fs::path root(root_);
  const std::string name = checkpoint_name(step);
  const fs::path temp = root / (name + temp_suffix());
  const fs::path final_dir = root / name;
  std::error_code ec;
  fs::create_directories(root, ec);
  check(!ec, "cannot create checkpoint directory ", root.string(), ": ", ec.message());
  fs::remove_all(temp, ec);  // a leftover of this very process
  check(!ec && fs::create_directory(temp, ec) && !ec, "cannot create ", temp.string(), ": ", ec.message());
  try {
    fill(temp.string());
    sync_tree(temp);
  } catch (...) {
    fs::remove_all(temp, ec);
    throw;
  }

  if (fs::exists(final_dir)) remove_checkpoint(final_dir);  // a rerun of a step written before
  rename_or_fail(temp, final_dir);
  sync_path(root, true);
  write_pointer(root / kLatest, name + "\n");

  // Prune older checkpoints; later ones (an abandoned future, when a run was resumed from an
  // older checkpoint) are never removed silently.
  int64_t kept = 0;
  for (const auto& [other, path] : list_checkpoints(root)) {
    if (other > step) {
      log_warn("checkpoint ", path.string(), " is newer than the one just written (step ", step,
               "); leaving it in place");
      continue;
    }
    if (++kept > keep_) remove_checkpoint(path);
  }
  return final_dir.string();
}

std::optional<std::string> latest_checkpoint(const std::string& root_text) {
  const fs::path root(root_text);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return std::nullopt;

  for (const fs::directory_entry& entry : fs::directory_iterator(root)) {
    const std::string name = entry.path().filename().string();
    if (name.find(kTmpMarker) == std::string::npos || writer_alive(name)) continue;
    fs::remove_all(entry.path(), ec);
    if (ec) log_warn("could not remove leftover ", entry.path().string(), ": ", ec.message());
  }

  const fs::path pointer = root / kLatest;
  if (fs::exists(pointer)) {
    std::ifstream in(pointer);
    std::string name;
    in >> name;
    check(parse_step(name) >= 0, pointer.string(),
          " should name a checkpoint directory step-<N>, but holds '", name, "'");
    if (fs::is_directory(root / name)) return (root / name).string();
    log_warn(pointer.string(), " names ", name,
             ", which does not exist; using the newest step-<N> directory");
  }
  const auto checkpoints = list_checkpoints(root);
  if (checkpoints.empty()) return std::nullopt;
  if (!fs::exists(pointer))
    log_warn(pointer.string(), " is missing; using ", checkpoints.front().second.string());
  return checkpoints.front().second.string();
}

}  // namespace spindle
