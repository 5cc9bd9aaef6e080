// RUN.toml: everything a training run needs besides the model itself, parsed strictly.
//
//   [model]       dir = "hf/model"  (start from a Hugging Face model directory), or
//                 config = "configs/x.json" and seed = 0 (initialise from a config)
//   [data]        train = "path" (required); format = "fasta" | "u32" | "megatron" (default:
//                 inferred from the file name); chromosomes = [..] (fasta only); max_n_fraction
//                 = 0.01; holdout = 0.0 (the last fraction of each training sequence is held out
//                 for evaluation instead of a separate file); eval = "path" (optional held-out set; defaults
//                 to the train file when eval_chromosomes is set); eval_format (default: inferred, else
//                 format); eval_chromosomes = [..] (fasta only)
//   [train]       seq_len (required), batch = 1 (sequences per step), accumulate = 1
//                 (micro-batches per step), steps (required), seed = 0, dtype = "f32" | "f64"
//   [optim]       lr = 3e-4, min_lr = 3e-5, warmup = 10 (at most train.steps), beta1 = 0.9,
//                 beta2 = 0.95, eps = 1e-8, weight_decay = 0.1, clip = 1.0 (0 = off)
//   [indexer]     kl_coef = 1.0, freeze = false (true: the indexers never train), freeze_steps = 0
//                 (the indexers train only after this many steps: from random weights their KL
//                 training can close every relu in the first steps, docs/PERF.md "Dead indexers")
//   [moe]         bias_update_rate = 1e-3, aux_loss_coef = 0.0
//   [checkpoint]  dir = "runs/NAME" (required), every = 100 (steps; 0 = only at the end), keep = 2,
//                 optimizer = true (false: without the AdamW state, three times the model's size:
//                 a model to load, not a run to resume)
//   [eval]        every = 0 (0 = only at the end), windows = 8, bucket = 1024
//
// Unknown sections or keys, wrong types and out-of-range values are errors naming the file, the
// line, the key and the value: a typo is never silently ignored. Relative paths are resolved
// against the directory of the TOML file.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace spindle {

struct RunConfig {
  std::string source;  // the TOML file, for messages

  struct Model {
    std::string dir;     // an HF model directory to start from, or
    std::string config;  // a config.json to initialise from with `seed`
    uint64_t seed = 0;
  } model;

  struct Data {
    std::string train;
    std::string format;  // "fasta", "u32" or "megatron" (resolved)
    std::vector<std::string> chromosomes;
    double max_n_fraction = 0.01;
    double holdout = 0.0;     // the last fraction of each training sequence, held out for evaluation
    std::string eval;         // empty: no held-out evaluation
    std::string eval_format;  // resolved when eval is set
    std::vector<std::string> eval_chromosomes;
  } data;

  struct Train {
    int64_t seq_len = 0;
    int64_t batch = 1;
    int64_t accumulate = 1;
    int64_t steps = 0;
    uint64_t seed = 0;
    DType dtype = DType::F32;
  } train;

  struct Optim {
    double lr = 3e-4;
    double min_lr = 3e-5;
    int64_t warmup = 10;
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double weight_decay = 0.1;
    double clip = 1.0;
  } optim;

  struct Indexer {
    double kl_coef = 1.0;
    bool freeze = false;
    int64_t freeze_steps = 0;
    // Whether the indexers are frozen (no KL, no update) in step `step` (0-based).
    bool frozen_at(int64_t step) const { return freeze || step < freeze_steps; }
  } indexer;

  struct Moe {
    double bias_update_rate = 1e-3;
    double aux_loss_coef = 0.0;
  } moe;

  struct Checkpoint {
    std::string dir;
    int64_t every = 100;
    int64_t keep = 2;
    bool optimizer = true;
  } checkpoint;

  struct Eval {
    int64_t every = 0;
    int64_t windows = 8;
    int64_t bucket = 1024;
  } eval;
};

// Parses TOML `text` as if read from `path` (used for messages and to resolve relative paths).
RunConfig parse_run_config(std::string_view text, const std::string& path);

// Reads and parses the file at `path`.
RunConfig load_run_config(const std::string& path);

// The resolved configuration as TOML (every key, defaults included, paths absolute), for the run
// log; parse_run_config() of it gives the same configuration back.
std::string describe(const RunConfig& config);

// A short stable fingerprint of describe() (16 hex digits), stored in checkpoints so a resume
// can tell whether the run settings changed.
std::string config_hash(const RunConfig& config);

}  // namespace spindle
