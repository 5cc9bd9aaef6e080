// A run's checkpoint directory, written so that a crash at any instant (SIGKILL, power loss)
// leaves the previous complete checkpoint loadable:
//   ROOT/step-000123.tmp-<pid>/   everything is written and fsynced here first,
//   ROOT/step-000123/             then renamed into place (a step-N directory is always complete),
//   ROOT/latest                   then this pointer is replaced atomically (temp file + rename),
// and only then are older checkpoints beyond `keep` removed (renamed to a temporary name first,
// so a half-deleted directory never looks complete). Anything named *.tmp-* is a leftover.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace spindle {

// "step-000123" (at least six digits).
std::string checkpoint_name(int64_t step);

class CheckpointWriter {
 public:
  // `keep` >= 1: how many of the newest checkpoints to keep.
  CheckpointWriter(std::string root, int64_t keep);

  // Writes checkpoint `step`: `fill(dir)` writes every file (model, optimizer, trainer state)
  // into the temporary directory `dir`; then the directory is committed as described above.
  // Returns the final directory. If `fill` throws, the temporary directory is removed and the
  // previous checkpoints are untouched. An existing checkpoint of the same step is replaced.
  std::string write(int64_t step, const std::function<void(const std::string& dir)>& fill);

  const std::string& root() const { return root_; }

 private:
  std::string root_;
  int64_t keep_;
};

// The newest complete checkpoint directory under `root`: the one `latest` names, or, if that is
// missing or dangling (a crash between the rename and the pointer update), the highest step-N.
// nullopt when there is none. Removes *.tmp-* leftovers of processes that no longer run.
std::optional<std::string> latest_checkpoint(const std::string& root);

// The step of a checkpoint directory named by checkpoint_name(); an error for other names.
int64_t checkpoint_step(const std::string& dir);

}  // namespace spindle
