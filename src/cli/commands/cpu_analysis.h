// What the CPU analysis commands (route, select) share: their options, the model, and the one
// sequence a forward pass runs on.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/args.h"
#include "core/dtype.h"
#include "model/checkpoint.h"

namespace spindle {

struct CpuAnalysis {
  std::string dir;  // --model
  DType dtype;      // --dtype f32 (default) or f64
  int64_t chunk;    // --chunk: tokens per chunk of the forward (default 4096; 0: the whole sequence)
  Model model;
  std::vector<int32_t> tokens;
  std::string source;  // the token file, or how the random ids were drawn
};

// The command line both take: --model, --tokens | --random-tokens, --length, --seed, --chunk,
// --dtype and --out, and the command's own `extra_options`.
Args cpu_analysis_args(const std::string& command, const std::vector<std::string>& argv,
                       const std::vector<std::string>& extra_options = {});

// Parses --model, --dtype, --chunk and the sequence: --tokens FILE (a token text's first --length,
// or an N-free window of --length tokens of a sequence file such as a FASTA), or
// --random-tokens --length N [--seed S] (ids uniform over the vocabulary, special ids included, as
// `spindle bench --random-tokens`). Every option error is reported before the model loads.
CpuAnalysis load_cpu_analysis(const Args& args, const std::string& command);

// `result` into the --out file, if one was given.
void write_analysis_json(const Args& args, const nlohmann::json& result);

}  // namespace spindle
