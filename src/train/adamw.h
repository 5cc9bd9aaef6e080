// AdamW with fp32 master weights and fp32 moments for every trained parameter, whatever dtype
// the model stores its weights in (f32 or f64 on the CPU path, bf16 later on the GPU): the
// update reads the masters, never the rounded model weights, and writes the model from them.
//
// Semantics are PyTorch's torch.optim.AdamW (decoupled weight decay, bias correction, eps added
// to sqrt(v_hat)). For update number t (1-based), learning rate lr and gradient g:
//   p <- p - lr * wd * p                    (only roles that decay: Matrix, Embedding)
//   m <- beta1 * m + (1 - beta1) * g
//   v <- beta2 * v + (1 - beta2) * g^2
//   p <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// Each element is computed in double and its state stored in fp32.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/adamw_constants.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/weights.h"

namespace spindle {

struct AdamWOptions {
  double lr = 3e-4;  // used by step(grads); a schedule passes its own lr to step(grads, lr)
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

// Checks ranges (lr >= 0, betas in [0, 1), eps > 0, weight_decay >= 0), naming the option.
void validate_adamw_options(const AdamWOptions& options);

// Only matrices and the embedding decay; norms, biases, gates, KDA decay parameters and the
// mHC projection/bias/scales do not.
bool role_decays(ParamRole role);
// Everything but RouterBias (e_score_correction_bias), which a separate rule updates.
bool role_trained(ParamRole role);

// How AdamW::step() may be overlapped with copies (the host AdamW's): the slots are updated in batches
// of consecutive slots of at least `elements` values (0: one batch), each by all the cores;
// before(first, last) is called before slots [first, last) are updated (their gradients must
// then be in place), after(first, last) once their masters and weights are written.
struct AdamWBatches {
  int64_t elements = 0;
  std::function<void(size_t first, size_t last)> before, after;
  // Only slots [0, slots) are updated (the rest elsewhere: the host AdamW's device share, with
  // constants() for the same step).
  size_t slots = SIZE_MAX;
};

// Batches of the host AdamW's pipelined update (backend/cuda/host_optimizer.cpp, and the planner's
// cost of it): the first waits for a 32nd of the gradients' copy, and the update starts its threads
// 32 times a step.
constexpr int kHostAdamWBatches = 32;
// The host AdamW's share of the values (its first slots); the device updates the rest, their state
// streamed through it over PCIe: 12 bytes a value each way, both ways at once, where the host's update
// moves 28. Measured at 256k on an H100 (docs/PERF.md, 2026-12-07): the optimizer took 1.41, 1.24
// and 1.33 s at shares of 0.2, 0.4 and 0.7 (the copies and the host's update share host memory).
constexpr double kHostAdamWHostShare = 0.4;
// The share a run takes: kHostAdamWHostShare, or SPINDLE_HOST_ADAMW_SHARE from the environment (a
// number in (0, 1]; 1: the host updates every value), to measure others. The planner prices the
// default.
double host_adamw_host_share();

// Where AdamW keeps a slot's state: at(slot, values) gives room for its master, m and v (3 x values
// floats, in that order), which `owner` keeps alive, or null for memory of AdamW's own. The host
// AdamW keeps its device share's in pinned memory so (backend/cuda/host_optimizer.h).
struct AdamWStateStorage {
  std::shared_ptr<void> owner;
  std::function<float*(size_t slot, int64_t values)> at;
};

class AdamW {
 public:
  // One trained parameter: a view of the model's weight and its fp32 optimizer state.
  struct Slot {
    std::string name;  // on-disk name, as parameter_table() gives it
    ParamRole role;
    bool decays;
    bool frozen = false;  // a frozen slot is skipped by step() (state kept as is)
    Tensor weight;        // view into the model's weights (any floating dtype)
    Tensor master;        // f32 copy of the weight, the value the update works on
    Tensor exp_avg;       // f32 first moment m
    Tensor exp_avg_sq;    // f32 second moment v
  };

  // Takes the trained parameters of `weights` (which must outlive the optimizer: the slots view
  // its storage), copies them to fp32 masters and zeroes the moments.
  AdamW(const ModelConfig& config, ModelWeights& weights, const AdamWOptions& options = {},
        const AdamWStateStorage& storage = {});

  // One update with `grads` (allocated for the same config; any floating dtype) at options().lr
  // or at `lr`. Then writes the model weights from the masters.
  void step(ModelWeights& grads);
  void step(ModelWeights& grads, double lr, const AdamWBatches& batches = {});

  // The constants of update number `step` (1-based) at `lr` for a slot that decays or not.
  AdamWConstants constants(bool decays, double lr, int64_t step) const;

  // Writes every slot's master into its model weight, converted to the weight's dtype.
  void write_weights();

  // Updates taken so far (t of the bias correction); restored from a checkpoint.
  int64_t steps() const { return steps_; }
  void set_steps(int64_t steps);

  const AdamWOptions& options() const { return options_; }
  void set_options(const AdamWOptions& options);

  std::vector<Slot>& slots() { return slots_; }
  const std::vector<Slot>& slots() const { return slots_; }
  const ModelConfig& config() const { return config_; }

 private:
  ModelConfig config_;
  AdamWOptions options_;
  std::vector<Slot> slots_;
  int64_t steps_ = 0;
};

}  // namespace spindle
