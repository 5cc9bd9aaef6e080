#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "backend/device_model.h"
#include "core/log.h"
#include "data/nucleotide_tokenizer.h"
#include "data/sequence_range.h"
#include "data/window_sampler.h"
#include "eval/evaluate.h"
#include "eval/report.h"
#include "eval/svg_plot.h"
#include "model/backward.h"
#include "model/checkpoint.h"
#include "model/init.h"
#include "plan/execution.h"
#include "train/adamw.h"
#include "train/checkpoint_dir.h"
#include "train/grad_accum.h"
#include "train/grad_clip.h"
#include "train/schedule.h"
#include "train/train_state.h"

namespace spindle {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string clock_text(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  char text[32];
  if (s >= 3600)
    std::snprintf(text, sizeof text, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  else
    std::snprintf(text, sizeof text, "%02lld:%02lld", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  return text;
}

// The time since the previous lap, as text ("12.3 s"): the setup's phases, logged (a large model
// takes minutes before its first step).
class Laps {
 public:
  std::string lap() {
    const auto now = Clock::now();
    char text[32];
    std::snprintf(text, sizeof text, "%.1f s", std::chrono::duration<double>(now - last_).count());
    last_ = now;
    return text;
  }

 private:
  Clock::time_point last_ = Clock::now();
};

Model initial_model(const RunConfig& run, DType dtype) {
  if (!run.model.dir.empty()) return load_model(run.model.dir, dtype);
  Model model{load_model_config(run.model.config), {}};
  check_supported(model.config);
  model.weights = allocate_weights(model.config, dtype);
  init_weights(model.config, model.weights, run.model.seed);
  return model;
}

// The training data and the held-out data, opened once for the run.
struct RunData {
  std::unique_ptr<TokenSequences> train_file, eval_file;
  std::unique_ptr<TokenSequences> train_view, eval_view;  // holdout views, when used
  const TokenSequences* train = nullptr;
  const TokenSequences* eval = nullptr;
};

RunData open_data(const RunConfig& run, const ModelConfig& config) {
  RunData d;
  SequenceOptions options;
  options.format = run.data.format;
  options.names = run.data.chromosomes;
  options.vocab_size = config.vocab_size;
  d.train_file = open_sequences(run.data.train, options);
  d.train = d.train_file.get();
  if (run.data.format == "fasta") {
    check(config.vocab_size >= kNucleotideVocab, run.source, ": the model's vocab_size (", config.vocab_size,
          ") is smaller than the nucleotide vocabulary (", kNucleotideVocab,
          " tokens) that FASTA data needs");
  }
  if (run.data.holdout > 0) {
    d.train_view = sequence_range(*d.train_file, 0.0, 1.0 - run.data.holdout);
    d.eval_view = sequence_range(*d.train_file, 1.0 - run.data.holdout, 1.0);
    d.train = d.train_view.get();
    d.eval = d.eval_view.get();
  } else if (!run.data.eval.empty()) {
    SequenceOptions eval_options = options;
    eval_options.format = run.data.eval_format;
    eval_options.names = run.data.eval_chromosomes;
    d.eval_file = open_sequences(run.data.eval, eval_options);
    d.eval = d.eval_file.get();
  }
  int64_t longest = 0;
  for (int64_t i = 0; i < d.train->size(); ++i) longest = std::max(longest, d.train->length(i));
  check(run.train.seq_len <= longest, run.source, ": train.seq_len = ", run.train.seq_len,
        " is longer than every training sequence in ", d.train->source(), " (longest: ", longest, " tokens)");
  return d;
}

// DeepSeek-V3's auxiliary-loss-free balance: nudge each expert's selection bias towards the mean load.
template <class T>
void update_router_bias(ModelWeights& weights, const std::vector<std::vector<int64_t>>& load, double rate) {
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    if (weights.layers[l].mlp != MlpKind::Sparse || load[l].empty()) continue;
    T* bias = weights.layers[l].moe.correction_bias.template data<T>();
    double mean = 0;
    for (int64_t n : load[l]) mean += static_cast<double>(n);
    mean /= static_cast<double>(load[l].size());
    for (size_t e = 0; e < load[l].size(); ++e) {
      const double gap = mean - static_cast<double>(load[l][e]);
      bias[e] += static_cast<T>(rate * static_cast<double>((gap > 0) - (gap < 0)));
    }
  }
}

template <class T>
void evaluate_and_report(const RunConfig& run, const Model& model, const TokenSequences& eval, int64_t step,
                         const std::string& out_dir, DeviceModel* device) {
  const auto windows = evaluation_windows(eval, run.train.seq_len, run.eval.windows, run.data.max_n_fraction);
  check(!windows.empty(), run.source, ": no held-out window of ", run.train.seq_len, " tokens in ",
        eval.source());
  BucketEvalOptions options;
  options.bucket_size = run.eval.bucket;
  options.device = device;
  const BucketLoss loss = evaluate_bucket_loss<T>(
      model, static_cast<int64_t>(windows.size()),
      [&](int64_t i) {
        std::vector<int32_t> tokens(static_cast<size_t>(run.train.seq_len));
        read_window(eval, windows[static_cast<size_t>(i)], run.train.seq_len, tokens.data());
        return tokens;
      },
      options);
  const std::string name = "step " + std::to_string(step);
  const LossReport report = make_report(loss, name);
  std::cout << "held-out loss by position (" << windows.size() << " windows of " << run.train.seq_len
            << " tokens, " << eval.source() << "), " << name << ":\n"
            << format_table(report) << std::flush;
  const std::string prefix = out_dir + "/eval-" + checkpoint_name(step);
  write_text_file(prefix + ".csv", format_csv(report));
  write_text_file(prefix + ".svg", render_svg(loss_plot(report, "Held-out loss by position", name)));
  log_info("evaluation written to ", prefix, ".csv and ", prefix, ".svg");
}

template <class T>
std::string run_training(const RunConfig& run, const TrainOptions& options) {
  const DType dtype = dtype_of<T>();
  Laps setup;
  Model model = initial_model(run, dtype);
  const ModelConfig& config = model.config;
  log_info("model ",
           run.model.dir.empty() ? "initialised (seed " + std::to_string(run.model.seed) + ")"
                                 : "loaded from " + run.model.dir,
           " in ", setup.lap());
  RunData data = open_data(run, config);
  log_info("data opened in ", setup.lap());

  AdamWOptions adam;
  adam.lr = run.optim.lr;
  adam.beta1 = run.optim.beta1;
  adam.beta2 = run.optim.beta2;
  adam.eps = run.optim.eps;
  adam.weight_decay = run.optim.weight_decay;
  AdamW optimizer(config, model.weights, adam);
  // Frozen indexers get no KL and no update: throughout ([indexer] freeze) or for the first
  // freeze_steps steps, after which their moments start from zero.
  const auto freeze_indexers = [&optimizer](bool frozen) {
    for (auto& slot : optimizer.slots())
      if (slot.name.find(".indexer.") != std::string::npos) slot.frozen = frozen;
  };
  const LrSchedule schedule({run.optim.lr, run.optim.min_lr, run.optim.warmup, run.train.steps});
  log_info("AdamW state on the host in ", setup.lap());

  WindowPolicy policy;
  policy.length = run.train.seq_len;
  policy.max_n_fraction = run.data.max_n_fraction;
  WindowSampler sampler(*data.train, policy, run.train.seed);

  // Resume, or refuse to overwrite an earlier run.
  fs::create_directories(run.checkpoint.dir);
  CheckpointWriter writer(run.checkpoint.dir, run.checkpoint.keep);
  TrainState state;
  state.config_hash = config_hash(run);
  const auto existing = latest_checkpoint(run.checkpoint.dir);
  if (options.resume) {
    check(existing.has_value(), "--resume: no checkpoint in ", run.checkpoint.dir);
    load_weights(*existing, config, model.weights);  // the router bias buffers come from here
    state = load_train_state(*existing, optimizer);
    if (state.config_hash != config_hash(run))
      log_warn("resuming ", *existing, " with changed run settings (config hash ", state.config_hash, " -> ",
               config_hash(run), ")");
    state.config_hash = config_hash(run);
    sampler.seek(static_cast<int64_t>(state.data_position));
    check(sampler.random_state() == state.rng, *existing,
          ": the training data or its settings changed since this "
          "checkpoint (the window sampler does not reach the saved state at position ",
          state.data_position, ")");
    log_info("resumed from ", *existing, " at step ", state.step, " in ", setup.lap());
  } else {
    check(!existing.has_value(), run.checkpoint.dir, " already holds checkpoint ", existing.value_or(""),
          ": pass --resume to continue it, or choose another checkpoint.dir (nothing was overwritten)");
  }

  bool indexers_frozen = run.indexer.frozen_at(state.step);
  freeze_indexers(indexers_frozen);

  // On a GPU the weights, gradients and optimizer state live there; the host copies are
  // refreshed for checkpoints.
  std::unique_ptr<DeviceModel> device;
  int64_t device_predicted_peak = 0;  // the planner's device peak, to set beside the measured one
  LossOptions loss_options;           // on a GPU, with the planner's chunk and what its passes keep
  loss_options.aux_loss_coef = run.moe.aux_loss_coef;
  if (options.device != Device::CPU) {
    device = open_device_model(options.device, config, model.weights, {options.strict_kernels});
    plan::StepOptions plan_options;
    plan_options.absorbed = true;  // the device model's default form
    plan_options.indexer_kl = !run.indexer.freeze && run.indexer.kl_coef > 0;
    const plan::Machine machine = plan::this_machine(device->memory_capacity(), options.gpu_bytes);
    const plan::Execution execution =
        plan::plan_execution(config, run.train.seq_len, machine, plan_options, options.chunk_tokens,
                             options.optimizer_on_host, options.site_policy);
    log_info("memory ", execution.summary);
    device_predicted_peak = execution.predicted_peak_bytes;
    plan::set_memory_options(execution, loss_options);
    device->set_optimizer_on_host(execution.policy.optimizer_on_host);
    device->load_optimizer(optimizer);
    log_info("training on ", device->device_name(),
             " (bf16 weights, fp32 gradients and optimizer state), set up in ", setup.lap());
  }

  const std::string metrics_path = run.checkpoint.dir + "/metrics.jsonl";
  std::ofstream metrics(metrics_path, std::ios::app);
  check(metrics.good(), "cannot write ", metrics_path);
  std::cout << describe(run) << std::flush;

  auto checkpoint = [&] {
    Laps writing;
    if (device) device->save_optimizer(optimizer);  // the host's masters, and its weights from them
    state.data_position = static_cast<uint64_t>(sampler.position());
    state.rng = sampler.random_state();
    const std::string dir = save_checkpoint(
        writer, state, optimizer,
        [&](const std::string& tmp) { save_model(tmp, config, model.weights, dtype); },
        run.checkpoint.optimizer);
    log_info("checkpoint ", dir, " written in ", writing.lap());
    return dir;
  };

  const int64_t micro_batches = run.train.batch * run.train.accumulate;
  const int64_t last_step =
      options.stop_after >= 0 ? std::min(run.train.steps, state.step + options.stop_after) : run.train.steps;
  ModelWeights grads = device ? ModelWeights{} : zero_gradients(config, dtype);
  ModelWeights micro = device ? ModelWeights{} : zero_gradients(config, dtype);
  std::vector<int32_t> tokens(static_cast<size_t>(run.train.seq_len));
  const auto started = Clock::now();
  const int64_t first_step = state.step;
  bool warned_closed = false;  // dead indexers are reported once; metrics.jsonl has every step
  for (int64_t step = state.step; step < last_step; ++step) {
    const auto step_start = Clock::now();
    if (run.indexer.frozen_at(step) != indexers_frozen) {
      indexers_frozen = !indexers_frozen;
      freeze_indexers(indexers_frozen);
      if (device) device->set_frozen(optimizer);
      log_info("step ", step + 1,
               ": the indexers train from here on ([indexer] freeze_steps = ", run.indexer.freeze_steps, ")");
    }
    loss_options.indexer_kl_coef = indexers_frozen ? 0.0 : run.indexer.kl_coef;
    if (device)
      device->zero_gradients();
    else
      zero_grads(config, grads);
    double loss = 0, kl = 0, closed = 0, aux = 0;
    std::vector<std::vector<int64_t>> load(config.layer_types.size());
    for (int64_t m = 0; m < micro_batches; ++m) {
      sampler.next(tokens.data());
      LossResult r;
      if (device) {
        LossOptions scaled = loss_options;
        scaled.scale = 1.0 / static_cast<double>(micro_batches);
        r = device->loss_and_gradients(tokens, scaled);
      } else {
        zero_grads(config, micro);
        r = loss_and_gradients<T>(config, model.weights, tokens, micro, loss_options);
        add_grads(config, grads, micro, 1.0 / static_cast<double>(micro_batches));
      }
      loss += r.loss / static_cast<double>(micro_batches);
      kl += r.indexer_kl / static_cast<double>(micro_batches);
      closed += r.indexer_closed / static_cast<double>(micro_batches);
      aux += r.aux_loss / static_cast<double>(micro_batches);
      for (size_t l = 0; l < load.size(); ++l) {
        if (load[l].empty())
          load[l] = r.expert_load[l];
        else
          for (size_t e = 0; e < load[l].size(); ++e) load[l][e] += r.expert_load[l][e];
      }
    }
    const double norm =
        device ? device->clip_gradients(run.optim.clip) : clip_grad_norm(config, grads, run.optim.clip);
    check(std::isfinite(loss) && std::isfinite(norm), "step ", step + 1, ": loss ", loss, ", gradient norm ",
          norm, " is not finite; stopping (the last checkpoint is intact)");
    const double lr = schedule.lr(step);
    if (device) {
      optimizer.set_steps(optimizer.steps() + 1);
      device->optimizer_step(optimizer.options(), lr, optimizer.steps());
    } else {
      optimizer.step(grads, lr);
    }
    update_router_bias<T>(model.weights, load, run.moe.bias_update_rate);
    if (device) device->set_router_biases(model.weights);
    state.step = state.schedule_step = step + 1;
    state.loss_history.push_back(loss);
    if (state.loss_history.size() > 100) state.loss_history.erase(state.loss_history.begin());

    const double step_seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
    const double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
    const int64_t done = state.step - first_step;
    const double tokens_per_second =
        static_cast<double>(micro_batches * run.train.seq_len) / std::max(step_seconds, 1e-9);
    const double left = elapsed / static_cast<double>(done) * static_cast<double>(last_step - state.step);
    nlohmann::json line = {{"step", state.step},
                           {"loss", loss},
                           {"lr", lr},
                           {"grad_norm", norm},
                           {"tokens_per_second", tokens_per_second},
                           {"seconds", elapsed}};
    if (loss_options.indexer_kl_coef > 0) {
      line["indexer_kl"] = kl;
      line["indexer_closed"] = closed;
    }
    const int64_t device_peak = device ? device->memory().peak_total : 0;
    if (device) line["device_peak_bytes"] = device_peak;
    if (loss_options.aux_loss_coef > 0) line["aux_loss"] = aux;
    metrics << line.dump() << '\n' << std::flush;
    char progress[200];
    std::snprintf(progress, sizeof progress,
                  "step %lld/%lld  loss %.4f  lr %.2e  grad %.3f  %.0f tok/s  %s elapsed, %s left",
                  static_cast<long long>(state.step), static_cast<long long>(run.train.steps), loss, lr, norm,
                  tokens_per_second, clock_text(elapsed).c_str(), clock_text(left).c_str());
    std::cerr << progress << '\n';
    // A healthy indexer has some relu open for nearly every query (32 heads x 128 pools in the
    // 4B config), so a share past 1% means whole layers whose scores all tie.
    if (loss_options.indexer_kl_coef > 0 && closed > 0.01 && !warned_closed) {
      log_warn(
          "step ", state.step, ": ", std::round(1000 * closed) / 10,
          "% of the indexers' queries had every relu closed on their chosen pools: their scores tie at 0, "
          "the KL cannot train them, and their sparse attention takes the lowest pools (dead indexers; "
          "`spindle select --model CHECKPOINT` names the layers; metrics.jsonl has indexer_closed per step). "
          "From random weights, freeze them for the first steps ([indexer] freeze_steps), as docs/PERF.md "
          "\"Frozen first, then trained\" measured with two runs");
      warned_closed = true;
    }
    // The first step has touched every buffer a step needs; with freeze_steps, the first with the
    // indexers' KL.
    if (device && (done == 1 || (run.indexer.freeze_steps > 0 && step == run.indexer.freeze_steps))) {
      char peak[160];
      std::snprintf(peak, sizeof peak, "device memory peak %.2f GiB (the planner predicted %.2f GiB)",
                    static_cast<double>(device_peak) / (1 << 30),
                    static_cast<double>(device_predicted_peak) / (1 << 30));
      log_info(peak);
    }

    const int64_t completed = state.step;
    if (run.checkpoint.every > 0 && completed % run.checkpoint.every == 0 && completed < last_step)
      checkpoint();
    if (data.eval != nullptr && run.eval.every > 0 && completed % run.eval.every == 0 &&
        completed < last_step)
      evaluate_and_report<T>(run, model, *data.eval, completed, run.checkpoint.dir, device.get());
  }
  const std::string final_dir = checkpoint();
  if (data.eval != nullptr && state.step == run.train.steps)
    evaluate_and_report<T>(run, model, *data.eval, state.step, run.checkpoint.dir, device.get());
  return final_dir;
}

}  // namespace

std::string train(const RunConfig& run, const TrainOptions& options) {
  if (options.device != Device::CPU) {
    check(run.train.dtype == DType::F32, run.source, ": --device ", device_name(options.device),
          " trains from f32 masters (bf16 weights on the device); set train.dtype = \"f32\"");
    return run_training<float>(run, options);
  }
  if (run.train.dtype == DType::F64) return run_training<double>(run, options);
  check(run.train.dtype == DType::F32, run.source, ": train.dtype must be f32 or f64 on the CPU");
  return run_training<float>(run, options);
}

}  // namespace spindle
