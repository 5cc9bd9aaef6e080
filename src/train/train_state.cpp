#include "train/train_state.h"

#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "io/safetensors.h"

namespace spindle {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kFormat = "spindle-trainer-state";
constexpr int kVersion = 1;

std::string hex_word(uint64_t word) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%016" PRIx64, word);
  return text;
}

uint64_t parse_hex_word(const json& value, const std::string& where) {
  check(value.is_string(), where, " should be a hex string \"0x...\", got ", value.dump());
  const std::string text = value.get<std::string>();
  check(text.size() == 18 && text.starts_with("0x") &&
            text.find_first_not_of("0123456789abcdefABCDEF", 2) == std::string::npos,
        where, " should be \"0x\" and 16 hex digits, got \"", text, "\"");
  return std::stoull(text.substr(2), nullptr, 16);
}

// A non-negative integer field of the trainer state.
int64_t field_count(const json& j, const char* key, const std::string& file) {
  check(j.contains(key), file, ": missing field '", key, "'");
  const json& v = j[key];
  check(v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0), file, ": field '", key,
        "' should be a non-negative integer, got ", v.dump());
  return v.get<int64_t>();
}

// Validates the trainer state document `j` (read from `path`) into `state`; returns the
// optimizer's update count.
int64_t parse_trainer_state(const json& j, const std::string& path, TrainState& state) {
  check(j.is_object() && j.value("format", "") == kFormat, path, ": expected \"format\": \"", kFormat, "\"");
  check(j.value("version", 0) == kVersion, path, ": version ", j.value("version", json()).dump(),
        " is not supported (expected ", kVersion, ")");
  static const std::set<std::string> known = {"format",        "version",       "step", "optimizer_steps",
                                              "schedule_step", "data_position", "rng",  "loss_history",
                                              "config_hash",   "optimizer"};
  for (const auto& [key, value] : j.items())
    check(known.count(key) != 0, path, ": unknown field '", key, "'");

  state.step = field_count(j, "step", path);
  const int64_t optimizer_steps = field_count(j, "optimizer_steps", path);
  state.schedule_step = field_count(j, "schedule_step", path);
  check(j.contains("data_position") && j["data_position"].is_number_unsigned(), path,
        ": field 'data_position' should be a non-negative integer");
  state.data_position = j["data_position"].get<uint64_t>();
  check(j.contains("rng") && j["rng"].is_array() && j["rng"].size() == 4, path,
        ": field 'rng' should be an array of 4 hex strings");
  bool any_bit = false;
  for (size_t i = 0; i < 4; ++i) {
    state.rng[i] = parse_hex_word(j["rng"][i], path + ": rng[" + std::to_string(i) + "]");
    any_bit = any_bit || state.rng[i] != 0;
  }
  check(any_bit, path, ": rng state is all zero, which xoshiro256** cannot leave");
  check(j.contains("loss_history") && j["loss_history"].is_array(), path,
        ": field 'loss_history' should be an array");
  for (const json& v : j["loss_history"]) {
    check(v.is_number(), path, ": loss_history holds a non-number ", v.dump());
    state.loss_history.push_back(v.get<double>());
  }
  check(j.contains("config_hash") && j["config_hash"].is_string(), path,
        ": field 'config_hash' should be a string");
  state.config_hash = j["config_hash"].get<std::string>();

  return optimizer_steps;
}

}  // namespace

void save_train_state(const std::string& dir, const TrainState& state, const AdamW& optimizer,
                      bool with_optimizer) {
  check(state.step >= 0 && state.schedule_step >= 0, "train state: step and schedule step must be >= 0");
  const std::string step_text = std::to_string(state.step);
  if (with_optimizer) {
    NamedTensors tensors;
    for (const AdamW::Slot& s : optimizer.slots()) {
      tensors.emplace_back(s.name + ".master", s.master);
      tensors.emplace_back(s.name + ".exp_avg", s.exp_avg);
      tensors.emplace_back(s.name + ".exp_avg_sq", s.exp_avg_sq);
    }
    write_safetensors((fs::path(dir) / kOptimizerFile).string(), tensors,
                      {{"format", "spindle-optimizer"},
                       {"step", step_text},
                       {"optimizer_steps", std::to_string(optimizer.steps())}});
  }

  json j = json::object();
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["step"] = state.step;
  j["optimizer_steps"] = optimizer.steps();
  j["schedule_step"] = state.schedule_step;
  j["data_position"] = state.data_position;
  j["rng"] = json::array();
  for (uint64_t word : state.rng) j["rng"].push_back(hex_word(word));
  j["loss_history"] = state.loss_history;
  j["config_hash"] = state.config_hash;
  if (!with_optimizer) j["optimizer"] = false;
  const std::string path = (fs::path(dir) / kTrainerStateFile).string();
  std::ofstream out(path, std::ios::binary);
  out << j.dump(2) << '\n';
  out.close();
  check(out.good(), "cannot write ", path);
}

TrainState load_train_state(const std::string& dir, AdamW& optimizer) {
  const std::string path = (fs::path(dir) / kTrainerStateFile).string();
  std::ifstream in(path, std::ios::binary);
  check(in.good(), "cannot open ", path, " (is ", dir, " a training checkpoint?)");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(path, " is not valid JSON: ", e.what());
  }
  TrainState state;
  int64_t optimizer_steps = 0;
  try {
    optimizer_steps = parse_trainer_state(j, path, state);
  } catch (const json::exception& e) {
    fail(path, ": ", e.what());
  }
  check(!j.contains("optimizer") || j["optimizer"] == true, dir,
        " holds no optimizer state (its run set [checkpoint] optimizer = false): it loads as a model "
        "([model] dir, --model), and cannot be resumed");
  // The optimizer file must belong to the same checkpoint and to this model.
  const std::string file = (fs::path(dir) / kOptimizerFile).string();
  const SafetensorsReader reader = SafetensorsReader::open(file);
  const auto& meta = reader.metadata();
  auto meta_value = [&](const char* key) {
    auto it = meta.find(key);
    check(it != meta.end(), file, ": metadata has no '", key, "'");
    return it->second;
  };
  check(meta_value("step") == std::to_string(state.step), file, ": written at step ", meta_value("step"),
        ", but ", path, " says step ", state.step, " (files of different checkpoints mixed)");
  check(meta_value("optimizer_steps") == std::to_string(optimizer_steps), file, ": optimizer_steps ",
        meta_value("optimizer_steps"), " differs from ", path, "'s ", optimizer_steps);

  std::set<std::string> expected;
  for (AdamW::Slot& s : optimizer.slots()) {
    for (const char* suffix : {".master", ".exp_avg", ".exp_avg_sq"}) {
      const std::string name = s.name + suffix;
      expected.insert(name);
      check(reader.contains(name), file, ": missing optimizer tensor '", name, "' (the model has parameter ",
            s.name, ")");
    }
  }
  for (const std::string& name : reader.names())
    check(expected.count(name) != 0, file, ": tensor '", name,
          "' belongs to no trained parameter of this model (a checkpoint of another model?)");
  // Validate everything before changing the optimizer, so a bad checkpoint leaves it intact.
  for (AdamW::Slot& s : optimizer.slots()) {
    for (const char* suffix : {".master", ".exp_avg", ".exp_avg_sq"}) {
      const Tensor& t = reader.get(s.name + suffix);
      check(t.dtype() == DType::F32 && t.shape() == s.master.shape(), file, ": tensor '", s.name, suffix,
            "' is ", t.describe(), ", expected f32", shape_string(s.master.shape()));
    }
  }
  for (AdamW::Slot& s : optimizer.slots()) {
    s.master.copy_from(reader.get(s.name + ".master"));
    s.exp_avg.copy_from(reader.get(s.name + ".exp_avg"));
    s.exp_avg_sq.copy_from(reader.get(s.name + ".exp_avg_sq"));
  }
  optimizer.set_steps(optimizer_steps);
  optimizer.write_weights();
  return state;
}

std::string save_checkpoint(CheckpointWriter& writer, const TrainState& state, const AdamW& optimizer,
                            const std::function<void(const std::string& dir)>& write_model,
                            bool with_optimizer) {
  return writer.write(state.step, [&](const std::string& dir) {
    write_model(dir);
    save_train_state(dir, state, optimizer, with_optimizer);
  });
}

std::optional<LoadedCheckpoint> load_latest(const std::string& root, AdamW& optimizer) {
  const std::optional<std::string> dir = latest_checkpoint(root);
  if (!dir) return std::nullopt;
  TrainState state = load_train_state(*dir, optimizer);
  check(state.step == checkpoint_step(*dir), *dir, ": ", kTrainerStateFile, " says step ", state.step,
        ", the directory name another");
  return LoadedCheckpoint{*dir, std::move(state)};
}

}  // namespace spindle
