// `spindle data get`: fetch the reference DNA; `spindle data info`: what a data file holds.
#include <filesystem>
#include <iostream>
#include <sstream>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "data/fetch.h"
#include "data/nucleotide_tokenizer.h"
#include "data/sequence_source.h"
#include "data/token_runs.h"

namespace spindle {
namespace {

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream parts(text);
  for (std::string item; std::getline(parts, item, ',');) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

int data_get(const std::vector<std::string>& argv) {
  const Args args("data get", argv, {"dir", "only"});
  FetchOptions options;
  options.dir = args.value_or("dir", "data");
  if (auto only = args.optional("only")) {
    options.only = split_list(*only);
    check(!options.only.empty(), "spindle data get: --only needs one or more of chr22, chrX, chr20");
  }
  const auto paths = fetch_data(options, std::cout);
  std::cout << "ready in " << options.dir << ":";
  for (const auto& path : paths) std::cout << ' ' << std::filesystem::path(path).filename().string();
  std::cout << '\n';
  return 0;
}

int data_info(const std::vector<std::string>& argv) {
  const Args args("data info", argv, {"input", "format", "names", "vocab"}, {"lenient"});
  SequenceOptions options;
  options.format = args.value_or("format", "auto");
  options.names = split_list(args.value_or("names", ""));
  options.lenient = args.flag("lenient");
  options.vocab_size = args.int_or("vocab", 0);
  const auto data = open_sequences(args.required("input"), options);
  const TokenRuns n_runs(*data, kTokenN);
  std::cout << data->source() << ": " << data->size() << " sequence(s), " << data->total_length()
            << " tokens\n";
  std::cout << "name\tlength\tN\tN_runs\tlongest_N_free\n";
  for (int64_t i = 0; i < data->size(); ++i) {
    std::cout << data->name(i) << '\t' << data->length(i) << '\t' << n_runs.total(i) << '\t' << n_runs.runs(i)
              << '\t' << n_runs.longest_gap(i) << '\n';
  }
  return 0;
}

}  // namespace

int run_data(const std::vector<std::string>& args) {
  check(!args.empty(), "spindle data: expected a subcommand: get or info (see spindle help)");
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "get") return data_get(rest);
  if (args[0] == "info") return data_info(rest);
  fail("spindle data: unknown subcommand '", args[0], "': expected get or info");
}

}  // namespace spindle
