// What a checkpoint holds besides the model weights, so that a run resumes bit-exactly:
//   optimizer.safetensors  fp32 "<param>.master", "<param>.exp_avg", "<param>.exp_avg_sq" for
//                          every trained parameter (metadata: step, optimizer_steps)
//   trainer_state.json     step, optimizer and schedule positions, data position, RNG words
//                          (hex strings: JSON tools often read numbers as doubles), loss
//                          history tail, config hash
// The caller writes the model (save_model) into the same directory; save_checkpoint() makes
// the whole directory one atomic unit through CheckpointWriter.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "train/adamw.h"
#include "train/checkpoint_dir.h"

namespace spindle {

struct TrainState {
  int64_t step = 0;                  // optimizer steps completed: the next step to run
  int64_t schedule_step = 0;         // the lr schedule's position (LrSchedule::lr's argument)
  uint64_t data_position = 0;        // the data sampler's position
  std::array<uint64_t, 4> rng{};     // Random::state()
  std::vector<double> loss_history;  // the most recent losses, oldest first
  std::string config_hash;           // config_hash() of the run config that wrote it
};

constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kTrainerStateFile = "trainer_state.json";

// Writes optimizer.safetensors (unless `with_optimizer` is false) and trainer_state.json into
// `dir` (which must exist).
void save_train_state(const std::string& dir, const TrainState& state, const AdamW& optimizer,
                      bool with_optimizer = true);

// Reads them from `dir` into `optimizer` (masters, moments, update count; every trained
// parameter must be present with its shape, and nothing else) and writes the model weights from
// the masters. Errors name the file and the tensor or field at fault, and a checkpoint written
// without its optimizer state.
TrainState load_train_state(const std::string& dir, AdamW& optimizer);

// One atomic checkpoint of `state.step`: `write_model(dir)` saves the model into the temporary
// directory (e.g. with save_model), then the train state is added and the directory committed.
std::string save_checkpoint(CheckpointWriter& writer, const TrainState& state, const AdamW& optimizer,
                            const std::function<void(const std::string& dir)>& write_model,
                            bool with_optimizer = true);

struct LoadedCheckpoint {
  std::string dir;  // load the model from here
  TrainState state;
};

// The newest complete checkpoint under `root` (see latest_checkpoint) loaded into `optimizer`;
// nullopt when there is none.
std::optional<LoadedCheckpoint> load_latest(const std::string& root, AdamW& optimizer);

}  // namespace spindle
