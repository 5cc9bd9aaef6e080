#include "train/run_config.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <utility>

#include "core/error.h"

// Debian's toml++ 3.3 installs toml.h; later releases name the header toml.hpp.
#if __has_include(<toml++/toml.hpp>)
#include <toml++/toml.hpp>
#else
#include <toml++/toml.h>
#endif

namespace spindle {

namespace {

namespace fs = std::filesystem;

// Every section and its keys, in the order describe() writes them.
const std::vector<std::pair<std::string, std::vector<std::string>>>& schema() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> sections = {
      {"model", {"dir", "config", "seed"}},
      {"data",
       {"train", "format", "chromosomes", "max_n_fraction", "holdout", "eval", "eval_format",
        "eval_chromosomes"}},
      {"train", {"seq_len", "batch", "accumulate", "steps", "seed", "dtype"}},
      {"optim", {"lr", "min_lr", "warmup", "beta1", "beta2", "eps", "weight_decay", "clip"}},
      {"indexer", {"kl_coef", "freeze", "freeze_steps"}},
      {"moe", {"bias_update_rate", "aux_loss_coef"}},
      {"checkpoint", {"dir", "every", "keep", "optimizer"}},
      {"eval", {"every", "windows", "bucket"}},
  };
  return sections;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out;
}

const char* type_name(toml::node_type type) {
  switch (type) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::date:
      return "a date";
    case toml::node_type::time:
      return "a time";
    case toml::node_type::date_time:
      return "a date-time";
    case toml::node_type::none:
      break;
  }
  return "nothing";
}

std::string value_text(const toml::node& node) {
  std::ostringstream out;
  out << toml::node_view<const toml::node>{&node};
  return out.str();
}

// "file:line" of a node, or just "file" when toml++ does not know the line.
std::string location(const std::string& file, const toml::source_region& source) {
  return source.begin.line > 0 ? file + ":" + std::to_string(source.begin.line) : file;
}

// Reads typed values out of a schema-checked document; every message names file, line and key.
class Reader {
 public:
  Reader(const toml::table& root, std::string file, fs::path base)
      : root_(root), file_(std::move(file)), base_(std::move(base)) {}

  const std::string& file() const { return file_; }

  const toml::node* find(const std::string& section, const std::string& key) const {
    const toml::node* s = root_.get(section);
    return s == nullptr ? nullptr : s->as_table()->get(key);
  }
  bool has(const std::string& section, const std::string& key) const { return find(section, key) != nullptr; }

  // "RUN.toml:7: train.steps = 0" for messages about a key ("RUN.toml: train.steps" if absent).
  std::string at(const std::string& section, const std::string& key) const {
    const toml::node* n = find(section, key);
    if (n == nullptr) return file_ + ": " + section + "." + key;
    return location(file_, n->source()) + ": " + section + "." + key + " = " + value_text(*n);
  }

  std::optional<int64_t> integer(const std::string& section, const std::string& key) const {
    const toml::node* n = find(section, key);
    if (n == nullptr) return std::nullopt;
    if (const auto* v = n->as_integer()) return v->get();
    wrong_type(section, key, *n, "an integer");
  }

  std::optional<double> real(const std::string& section, const std::string& key) const {
    const toml::node* n = find(section, key);
    if (n == nullptr) return std::nullopt;
    if (const auto* v = n->as_floating_point()) return v->get();
    if (const auto* v = n->as_integer()) return static_cast<double>(v->get());  // `clip = 1` is fine
    wrong_type(section, key, *n, "a number");
  }

  std::optional<bool> boolean(const std::string& section, const std::string& key) const {
    const toml::node* n = find(section, key);
    if (n == nullptr) return std::nullopt;
    if (const auto* v = n->as_boolean()) return v->get();
    wrong_type(section, key, *n, "a boolean (true or false)");
  }

  std::optional<std::string> string(const std::string& section, const std::string& key) const {
    const toml::node* n = find(section, key);
    if (n == nullptr) return std::nullopt;
    if (const auto* v = n->as_string()) return v->get();
    wrong_type(section, key, *n, "a string");
  }

  std::optional<std::vector<std::string>> strings(const std::string& section, const std::string& key) const {
    const toml::node* n = find(section, key);
    if (n == nullptr) return std::nullopt;
    const toml::array* array = n->as_array();
    if (array == nullptr) wrong_type(section, key, *n, "an array of strings");
    std::vector<std::string> out;
    for (size_t i = 0; i < array->size(); ++i) {
      const toml::node& item = *array->get(i);
      const auto* v = item.as_string();
      check(v != nullptr, location(file_, item.source()), ": ", section, ".", key, "[", i,
            "] = ", value_text(item), " is ", type_name(item.type()), ", expected a string");
      check(!v->get().empty(), location(file_, item.source()), ": ", section, ".", key, "[", i, "] is empty");
      out.push_back(v->get());
    }
    return out;
  }

  // A non-empty path, resolved against the TOML file's directory when relative.
  std::optional<std::string> path(const std::string& section, const std::string& key) const {
    std::optional<std::string> text = string(section, key);
    if (!text) return std::nullopt;
    check(!text->empty(), at(section, key), ": expected a path, got an empty string");
    const fs::path p(*text);
    return (p.is_absolute() ? p : base_ / p).lexically_normal().string();
  }

  [[noreturn]] void missing(const std::string& section, const std::string& key,
                            const std::string& what) const {
    fail(file_, ": missing required key ", section, ".", key, " (", what, ") in [", section, "]");
  }

 private:
  [[noreturn]] void wrong_type(const std::string& section, const std::string& key, const toml::node& n,
                               const char* expected) const {
    fail(location(file_, n.source()), ": ", section, ".", key, " = ", value_text(n), " is ",
         type_name(n.type()), ", expected ", expected);
  }

  const toml::table& root_;
  std::string file_;
  fs::path base_;
};

// Rejects unknown sections, non-table sections and unknown keys before anything is read.
void check_schema(const toml::table& root, const std::string& file) {
  std::vector<std::string> section_names;
  for (const auto& [name, keys] : schema()) section_names.push_back(name);
  for (const auto& [key, node] : root) {
    const std::string name(key.str());
    auto it = std::find_if(schema().begin(), schema().end(), [&](const auto& s) { return s.first == name; });
    check(it != schema().end(), location(file, key.source()), ": unknown ",
          node.is_table() ? "section [" + name + "]" : "key '" + name + "' outside any section",
          " (known sections: ", join(section_names), ")");
    check(node.is_table(), location(file, node.source()), ": '", name, "' = ", value_text(node), " is ",
          type_name(node.type()), ", expected a table: write it as a section [", name, "]");
    for (const auto& [inner, value] : *node.as_table()) {
      const std::string k(inner.str());
      check(std::find(it->second.begin(), it->second.end(), k) != it->second.end(),
            location(file, inner.source()), ": unknown key '", k, "' in [", name,
            "] (known keys: ", join(it->second), ")");
    }
  }
}

// "fasta", "u32" or "megatron" from a file name, or "" when the name does not tell.
std::string infer_format(const std::string& path) {
  std::string name = fs::path(path).filename().string();
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const char* ext : {".fa", ".fasta", ".fna", ".fa.gz", ".fasta.gz", ".fna.gz", ".fa.bgz", ".fasta.bgz"})
    if (name.ends_with(ext)) return "fasta";
  if (name.ends_with(".u32")) return "u32";
  if (name.ends_with(".bin") || name.ends_with(".idx")) return "megatron";
  return "";
}

const char* kFormats = "\"fasta\", \"u32\" or \"megatron\"";
bool known_format(const std::string& f) { return f == "fasta" || f == "u32" || f == "megatron"; }

void read_model(const Reader& r, RunConfig::Model& m) {
  const std::optional<std::string> dir = r.path("model", "dir"), config = r.path("model", "config");
  check(
      !(dir && config), r.file(),
      ": [model] sets both dir and config; set dir to start from a model directory, or config (and seed) to "
      "initialise a new model");
  check(dir || config, r.file(),
        ": [model] needs dir = \"...\" (a Hugging Face model directory to start from) or config = \"...\" (a "
        "config.json to initialise from, with seed)");
  if (dir) {
    check(!r.has("model", "seed"), r.at("model", "seed"),
          ": model.seed only applies with model.config (a model loaded from model.dir keeps its weights)");
    m.dir = *dir;
  } else {
    m.config = *config;
    const int64_t seed = r.integer("model", "seed").value_or(0);
    check(seed >= 0, r.at("model", "seed"), ": must be >= 0");
    m.seed = static_cast<uint64_t>(seed);
  }
}

void read_data(const Reader& r, RunConfig::Data& d) {
  const std::optional<std::string> train = r.path("data", "train");
  if (!train) r.missing("data", "train", "the training data file");
  d.train = *train;

  // The format named, or inferred from `file`'s name; `fallback` when the name does not tell.
  auto format_of = [&](const char* key, const std::string& file, const char* file_key,
                       const std::string& fallback) {
    if (const std::optional<std::string> f = r.string("data", key)) {
      check(known_format(*f), r.at("data", key), ": expected ", kFormats);
      return *f;
    }
    const std::string inferred = infer_format(file);
    if (!inferred.empty()) return inferred;
    if (!fallback.empty()) return fallback;
    fail(r.file(), ": cannot infer data.", key, " from the name of data.", file_key, " = \"", file,
         "\" (.fa/.fasta/.fna[.gz] is fasta, .u32 is u32, .bin/.idx is megatron); set data.", key, " to ",
         kFormats);
  };
  d.format = format_of("format", d.train, "train", "");

  if (std::optional<std::vector<std::string>> c = r.strings("data", "chromosomes")) {
    check(d.format == "fasta", r.at("data", "chromosomes"),
          ": chromosomes only apply to fasta data, but data.format is ", d.format);
    d.chromosomes = std::move(*c);
  }
  if (std::optional<double> f = r.real("data", "max_n_fraction")) {
    check(*f >= 0 && *f <= 1, r.at("data", "max_n_fraction"), ": must be in [0, 1]");
    d.max_n_fraction = *f;
  }

  if (std::optional<double> h = r.real("data", "holdout")) {
    check(*h >= 0 && *h < 1, r.at("data", "holdout"), ": must be in [0, 1)");
    check(
        *h == 0 || (!r.has("data", "eval") && !r.has("data", "eval_chromosomes")), r.at("data", "holdout"),
        ": holds out the end of the training data for evaluation, so it cannot be combined with data.eval or "
        "data.eval_chromosomes");
    d.holdout = *h;
  }

  std::optional<std::vector<std::string>> eval_chromosomes = r.strings("data", "eval_chromosomes");
  if (std::optional<std::string> eval = r.path("data", "eval")) {
    d.eval = *eval;
  } else if (eval_chromosomes) {
    d.eval = d.train;  // held-out chromosomes of the training file
  } else {
    check(!r.has("data", "eval_format"), r.at("data", "eval_format"), ": set without data.eval");
  }
  if (!d.eval.empty())
    d.eval_format = format_of("eval_format", d.eval, "eval", d.eval == d.train ? d.format : "");
  if (eval_chromosomes) {
    check(d.eval_format == "fasta", r.at("data", "eval_chromosomes"),
          ": eval_chromosomes only apply to fasta data, but the eval format is ", d.eval_format);
    d.eval_chromosomes = std::move(*eval_chromosomes);
  }
}

void read_train(const Reader& r, RunConfig::Train& t) {
  const std::optional<int64_t> seq_len = r.integer("train", "seq_len"), steps = r.integer("train", "steps");
  if (!seq_len) r.missing("train", "seq_len", "tokens per sequence, an integer >= 2");
  if (!steps) r.missing("train", "steps", "optimizer steps to run, an integer >= 1");
  check(*seq_len >= 2, r.at("train", "seq_len"), ": must be >= 2 (a next-token loss needs two tokens)");
  check(*steps >= 1, r.at("train", "steps"), ": must be >= 1");
  t.seq_len = *seq_len;
  t.steps = *steps;
  t.batch = r.integer("train", "batch").value_or(t.batch);
  check(t.batch >= 1, r.at("train", "batch"), ": must be >= 1");
  t.accumulate = r.integer("train", "accumulate").value_or(t.accumulate);
  check(t.accumulate >= 1, r.at("train", "accumulate"), ": must be >= 1");
  const int64_t seed = r.integer("train", "seed").value_or(0);
  check(seed >= 0, r.at("train", "seed"), ": must be >= 0");
  t.seed = static_cast<uint64_t>(seed);
  if (std::optional<std::string> dtype = r.string("train", "dtype")) {
    check(*dtype == "f32" || *dtype == "f64", r.at("train", "dtype"), ": expected \"f32\" or \"f64\"");
    t.dtype = *dtype == "f32" ? DType::F32 : DType::F64;
  }
}

void read_optim(const Reader& r, const RunConfig::Train& t, RunConfig::Optim& o) {
  auto number = [&](const char* key, double& out, double low, bool low_open, double high, bool high_open,
                    const char* range) {
    if (std::optional<double> v = r.real("optim", key)) {
      const bool ok =
          std::isfinite(*v) && (low_open ? *v > low : *v >= low) && (high_open ? *v < high : *v <= high);
      check(ok, r.at("optim", key), ": must be ", range);
      out = *v;
    }
  };
  const double inf = INFINITY;
  number("lr", o.lr, 0, true, inf, true, "> 0");
  number("min_lr", o.min_lr, 0, false, inf, true, ">= 0");
  check(o.min_lr <= o.lr, r.file(), ": optim.min_lr = ", o.min_lr, " exceeds optim.lr = ", o.lr);
  number("beta1", o.beta1, 0, false, 1, true, "in [0, 1)");
  number("beta2", o.beta2, 0, false, 1, true, "in [0, 1)");
  number("eps", o.eps, 0, true, inf, true, "> 0");
  number("weight_decay", o.weight_decay, 0, false, inf, true, ">= 0");
  number("clip", o.clip, 0, false, inf, true, ">= 0 (0 turns clipping off)");
  // The default warmup shortens itself for runs shorter than it; an explicit one must fit.
  o.warmup = r.integer("optim", "warmup").value_or(std::min(o.warmup, t.steps));
  check(o.warmup >= 0, r.at("optim", "warmup"), ": must be >= 0");
  check(o.warmup <= t.steps, r.at("optim", "warmup"), ": must not exceed train.steps = ", t.steps);
}

// A non-negative number (coefficients and rates).
double non_negative(const Reader& r, const char* section, const char* key, double fallback) {
  const std::optional<double> v = r.real(section, key);
  if (!v) return fallback;
  check(std::isfinite(*v) && *v >= 0, r.at(section, key), ": must be >= 0");
  return *v;
}

int64_t at_least(const Reader& r, const char* section, const char* key, int64_t fallback, int64_t low,
                 const char* why = "") {
  const std::optional<int64_t> v = r.integer(section, key);
  if (!v) return fallback;
  check(*v >= low, r.at(section, key), ": must be >= ", low, why);
  return *v;
}

// TOML's basic string, escaped.
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          char code[8];
          std::snprintf(code, sizeof(code), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += code;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// The shortest text that reads back as the same double, always a TOML float.
std::string real_text(double v) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), v);
  std::string text(buffer, result.ptr);
  if (text.find_first_of(".eEn") == std::string::npos) text += ".0";  // 'n': inf, nan
  return text;
}

std::string list_text(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + quoted(items[i]);
  return out + "]";
}

}  // namespace

RunConfig parse_run_config(std::string_view text, const std::string& path) {
  toml::table root;
  try {
    root = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    fail(path, ":", e.source().begin.line, ":", e.source().begin.column, ": invalid TOML: ", e.description());
  }
  check_schema(root, path);
  const Reader r(root, path, fs::absolute(fs::path(path)).parent_path());

  RunConfig c;
  c.source = path;
  read_model(r, c.model);
  read_data(r, c.data);
  read_train(r, c.train);
  read_optim(r, c.train, c.optim);

  c.indexer.kl_coef = non_negative(r, "indexer", "kl_coef", c.indexer.kl_coef);
  c.indexer.freeze = r.boolean("indexer", "freeze").value_or(c.indexer.freeze);
  c.indexer.freeze_steps = r.integer("indexer", "freeze_steps").value_or(c.indexer.freeze_steps);
  check(c.indexer.freeze_steps >= 0, r.at("indexer", "freeze_steps"), ": must be >= 0");
  check(c.indexer.freeze_steps <= c.train.steps, r.at("indexer", "freeze_steps"),
        ": must not exceed train.steps = ", c.train.steps, " (freeze = true freezes them throughout)");
  check(!(c.indexer.freeze && c.indexer.freeze_steps > 0), r.at("indexer", "freeze_steps"),
        ": freeze = true freezes the indexers throughout; give one of the two");
  c.moe.bias_update_rate = non_negative(r, "moe", "bias_update_rate", c.moe.bias_update_rate);
  c.moe.aux_loss_coef = non_negative(r, "moe", "aux_loss_coef", c.moe.aux_loss_coef);

  const std::optional<std::string> checkpoint_dir = r.path("checkpoint", "dir");
  if (!checkpoint_dir) r.missing("checkpoint", "dir", "where checkpoints go, e.g. \"runs/NAME\"");
  c.checkpoint.dir = *checkpoint_dir;
  c.checkpoint.every = at_least(r, "checkpoint", "every", c.checkpoint.every, 0, " (0 = only at the end)");
  c.checkpoint.keep = at_least(r, "checkpoint", "keep", c.checkpoint.keep, 1);
  c.checkpoint.optimizer = r.boolean("checkpoint", "optimizer").value_or(c.checkpoint.optimizer);

  c.eval.every = at_least(r, "eval", "every", c.eval.every, 0, " (0 = only at the end)");
  c.eval.windows = at_least(r, "eval", "windows", c.eval.windows, 1);
  c.eval.bucket = at_least(r, "eval", "bucket", c.eval.bucket, 1);
  return c;
}

RunConfig load_run_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check(in.good(), "cannot open run config ", path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  check(!in.bad(), "cannot read run config ", path);
  return parse_run_config(text, path);
}

std::string describe(const RunConfig& c) {
  std::ostringstream out;
  out << "# Spindle run configuration, resolved from " << c.source << "\n";
  out << "[model]\n";
  if (!c.model.dir.empty()) {
    out << "dir = " << quoted(c.model.dir) << "\n";
  } else {
    out << "config = " << quoted(c.model.config) << "\nseed = " << c.model.seed << "\n";
  }
  const RunConfig::Data& d = c.data;
  out << "\n[data]\ntrain = " << quoted(d.train) << "\nformat = " << quoted(d.format) << "\n";
  if (!d.chromosomes.empty()) out << "chromosomes = " << list_text(d.chromosomes) << "\n";
  out << "max_n_fraction = " << real_text(d.max_n_fraction) << "\n";
  if (d.holdout > 0) out << "holdout = " << real_text(d.holdout) << "\n";
  if (!d.eval.empty())
    out << "eval = " << quoted(d.eval) << "\neval_format = " << quoted(d.eval_format) << "\n";
  if (!d.eval_chromosomes.empty()) out << "eval_chromosomes = " << list_text(d.eval_chromosomes) << "\n";
  const RunConfig::Train& t = c.train;
  out << "\n[train]\nseq_len = " << t.seq_len << "\nbatch = " << t.batch << "\naccumulate = " << t.accumulate
      << "\nsteps = " << t.steps << "\nseed = " << t.seed << "\ndtype = " << quoted(dtype_name(t.dtype))
      << "\n";
  const RunConfig::Optim& o = c.optim;
  out << "\n[optim]\nlr = " << real_text(o.lr) << "\nmin_lr = " << real_text(o.min_lr)
      << "\nwarmup = " << o.warmup << "\nbeta1 = " << real_text(o.beta1) << "\nbeta2 = " << real_text(o.beta2)
      << "\neps = " << real_text(o.eps) << "\nweight_decay = " << real_text(o.weight_decay)
      << "\nclip = " << real_text(o.clip) << "\n";
  out << "\n[indexer]\nkl_coef = " << real_text(c.indexer.kl_coef)
      << "\nfreeze = " << (c.indexer.freeze ? "true" : "false");
  // Written only when set, so that the hash of runs from before the key stays the same.
  if (c.indexer.freeze_steps > 0) out << "\nfreeze_steps = " << c.indexer.freeze_steps;
  out << "\n";
  out << "\n[moe]\nbias_update_rate = " << real_text(c.moe.bias_update_rate)
      << "\naux_loss_coef = " << real_text(c.moe.aux_loss_coef) << "\n";
  out << "\n[checkpoint]\ndir = " << quoted(c.checkpoint.dir) << "\nevery = " << c.checkpoint.every
      << "\nkeep = " << c.checkpoint.keep << "\n";
  // Only when off, so that the settings' hash of runs from before the key stays what it was.
  if (!c.checkpoint.optimizer) out << "optimizer = false\n";
  out << "\n[eval]\nevery = " << c.eval.every << "\nwindows = " << c.eval.windows
      << "\nbucket = " << c.eval.bucket << "\n";
  return out.str();
}

std::string config_hash(const RunConfig& config) {
  // FNV-1a over the settings only (not the comment naming the source file).
  const std::string text = describe(config);
  const size_t body = text.find('\n');
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = body == std::string::npos ? 0 : body; i < text.size(); ++i) {
    h ^= static_cast<unsigned char>(text[i]);
    h *= 0x100000001b3ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

}  // namespace spindle
