#include "cli/commands/cpu_analysis.h"

#include <fstream>
#include <set>

#include "core/error.h"
#include "core/random.h"
#include "data/token_source.h"

namespace spindle {

Args cpu_analysis_args(const std::string& command, const std::vector<std::string>& argv,
                       const std::vector<std::string>& extra_options) {
  std::set<std::string> options = {"model", "tokens", "length", "seed", "chunk", "dtype", "out"};
  options.insert(extra_options.begin(), extra_options.end());
  return Args(command, argv, options, {"random-tokens"});
}

CpuAnalysis load_cpu_analysis(const Args& args, const std::string& command) {
  const bool random_tokens = args.flag("random-tokens");
  check(random_tokens != args.optional("tokens").has_value(), "spindle ", command,
        ": give exactly one of --tokens FILE and --random-tokens");
  check(!random_tokens || args.optional("length"), "--random-tokens needs --length N");
  check(random_tokens || !args.optional("seed"), "--seed applies to --random-tokens");
  const DType dtype = parse_dtype(args.value_or("dtype", "f32"), "--dtype");
  check(dtype == DType::F32 || dtype == DType::F64, "--dtype must be f32 or f64, got ", dtype_name(dtype));
  const int64_t chunk = args.int_or("chunk", 4096);
  check(chunk >= 0, "--chunk must be a number of tokens >= 1 (or 0: the whole sequence), got ", chunk);

  CpuAnalysis a{args.required("model"), dtype, chunk, {}, {}, {}};
  if (!random_tokens) {  // read before the model loads: bad data fails first
    const std::string path = *args.optional("tokens");
    const TokenSource source(path);
    if (source.is_text()) {
      const int64_t length = args.int_or("length", source.text_size());
      check(length >= 2 && length <= source.text_size(), "--length must be in [2, ", source.text_size(),
            "] (the tokens in '", path, "'), got ", length);
      a.tokens = source.window(length, "--length");
      a.source = path;
    } else {
      check(args.optional("length").has_value(), "--tokens ", path,
            " is a sequence file: give --length N (an N-free window of N tokens is read)");
      const int64_t length = args.int_or("length", 0);
      check(length >= 2, "--length must be >= 2 tokens, got ", length);
      a.tokens = source.window(length, "--length");
      a.source = path + " (an N-free window)";
    }
  }
  a.model = load_model(a.dir, dtype);
  const int64_t vocab = a.model.config.vocab_size;
  if (random_tokens) {
    const int64_t length = args.int_or("length", 0);
    check(length >= 2, "--length must be >= 2 tokens, got ", length);
    const int64_t seed = args.int_or("seed", 1);
    Random random(static_cast<uint64_t>(seed));
    for (int64_t i = 0; i < length; ++i)
      a.tokens.push_back(static_cast<int32_t>(random.uniform() * static_cast<double>(vocab)));
    a.source = "random ids uniform over [0, " + std::to_string(vocab) + "), seed " + std::to_string(seed);
  }
  return a;
}

void write_analysis_json(const Args& args, const nlohmann::json& result) {
  const auto path = args.optional("out");
  if (!path) return;
  std::ofstream file(*path);
  check(file.good(), "cannot write --out file '", *path, "'");
  file << result.dump(1) << '\n';
  check(file.good(), "failed writing '", *path, "'");
}

}  // namespace spindle
