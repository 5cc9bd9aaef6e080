#include "model/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include "core/log.h"
#include "io/safetensors.h"

namespace spindle {

namespace {

// Where a parameter's values are in the file: a contiguous run of `source`.
struct SourceRef {
  std::string file_name;  // the name in the file, for messages
  Tensor tensor;
};

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// The name relative to the text model ("layers.3.mlp.gate.weight", "lm_head.weight"), or "" when
// the tensor belongs to something Spindle ignores (vision tower, multi-token prediction).
std::string text_relative_name(const std::string& name, int64_t layers) {
  if (name == "lm_head.weight" || name == "language_model.lm_head.weight") return "lm_head.weight";
  for (const char* ignored : {"model.visual.", "visual.", "model.vision_tower.", "vision_tower."}) {
    if (starts_with(name, ignored)) return "";
  }
  std::string rel = name;
  for (const char* prefix : {"model.language_model.", "language_model.model.", "model.", "language_model."}) {
    if (starts_with(name, prefix)) {
      rel = name.substr(std::string(prefix).size());
      break;
    }
  }
  static const std::regex layer_index(R"(^layers\.(\d+)\.)");
  std::smatch m;
  if (std::regex_search(rel, m, layer_index) && std::stoll(m[1].str()) >= layers) return "";  // MTP layer
  if (rel.find(".shared_head.") != std::string::npos) return "";
  return rel;
}

// Maps transformers' in-memory names onto the on-disk ones; fused tensors become slices.
void add_sources(const ModelConfig& c, const std::string& file_name, const std::string& rel, const Tensor& t,
                 std::map<std::string, SourceRef>& out) {
  static const std::regex hc(R"(^(layers\.\d+\.)(attn|ffn)_hc\.(fn|base|scale)$)");
  static const std::regex forget(R"(^(layers\.\d+\.self_attn\.)forget_gate\.(.*)$)");
  static const std::regex gate_up(R"(^(layers\.\d+\.mlp\.experts\.)gate_up_proj$)");
  static const std::regex down(R"(^(layers\.\d+\.mlp\.experts\.)down_proj$)");
  static const std::regex conv(R"(^(layers\.\d+\.self_attn\.)conv1d\.weight$)");
  std::smatch m;
  const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size, D = c.hidden_size;
  auto expect_shape = [&](const Shape& shape) {
    check(t.shape() == shape, "tensor '", file_name, "' has shape ", shape_string(t.shape()), ", expected ",
          shape_string(shape));
  };
  auto slice = [&](const std::string& name, int64_t offset, const Shape& shape) {
    out[name] = {file_name, t.block(offset, shape)};
  };
  if (std::regex_match(rel, m, hc)) {
    out[m[1].str() + "hc_" + m[2].str() + "_" + m[3].str()] = {file_name, t};
  } else if (std::regex_match(rel, m, forget)) {
    out[m[1].str() + m[2].str()] = {file_name, t};
  } else if (std::regex_match(rel, m, gate_up)) {
    expect_shape({E, 2 * I, D});
    for (int64_t e = 0; e < E; ++e) {
      const std::string p = m[1].str() + std::to_string(e) + ".";
      slice(p + "gate_proj.weight", e * 2 * I * D, {I, D});
      slice(p + "up_proj.weight", e * 2 * I * D + I * D, {I, D});
    }
  } else if (std::regex_match(rel, m, down)) {
    expect_shape({E, D, I});
    for (int64_t e = 0; e < E; ++e)
      slice(m[1].str() + std::to_string(e) + ".down_proj.weight", e * D * I, {D, I});
  } else if (std::regex_match(rel, m, conv)) {
    const int64_t qkv = c.linear_qkv_dim(), K = c.linear_conv_kernel_dim;
    expect_shape({3 * qkv, 1, K});
    const char* names[] = {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"};
    for (int64_t i = 0; i < 3; ++i) slice(m[1].str() + names[i], i * qkv * K, {qkv, 1, K});
  } else {
    out[rel] = {file_name, t};
  }
}

std::string relative_param_name(const std::string& on_disk) {
  const std::string prefix = kTextPrefix;
  return starts_with(on_disk, prefix) ? on_disk.substr(prefix.size()) : on_disk;
}

}  // namespace

void check_supported(const ModelConfig& c) {
  const std::string& src = c.source;
  check(!c.attention_bias, src,
        ": attention_bias=true is not supported by Spindle (GLM-5.3-Flash uses false)");
}

void load_weights(const std::string& dir, const ModelConfig& c, ModelWeights& w) {
  const SafetensorsReader reader = SafetensorsReader::open(dir);
  std::map<std::string, SourceRef> sources;
  std::vector<std::string> ignored;
  for (const std::string& name : reader.names()) {
    const std::string rel = text_relative_name(name, c.num_hidden_layers);
    if (rel.empty()) {
      ignored.push_back(name);
      continue;
    }
    add_sources(c, name, rel, reader.get(name), sources);
  }
  std::set<std::string> used;
  for (Param& p : parameter_table(c, w)) {
    const std::string rel = relative_param_name(p.name);
    auto it = sources.find(rel);
    check(it != sources.end(), "checkpoint ", reader.path(), ": missing tensor '", p.name,
          "' (expected shape ", shape_string(p.tensor.shape()), ")");
    const SourceRef& src = it->second;
    check(src.tensor.shape() == p.tensor.shape(), "checkpoint ", reader.path(), ": tensor '", src.file_name,
          "' has shape ", shape_string(src.tensor.shape()), ", expected ", shape_string(p.tensor.shape()));
    check(is_floating(src.tensor.dtype()), "checkpoint ", reader.path(), ": tensor '", src.file_name,
          "' has dtype ", dtype_name(src.tensor.dtype()),
          ", expected a floating-point dtype (f64, f32, bf16 or f16)");
    p.tensor.copy_from(src.tensor);
    used.insert(src.file_name);
  }
  std::vector<std::string> unused;
  for (const auto& [rel, src] : sources) {
    if (!used.count(src.file_name) && !(rel == "lm_head.weight" && c.tie_word_embeddings))
      unused.push_back(src.file_name);
  }
  if (!unused.empty()) {
    std::string list;
    for (size_t i = 0; i < unused.size() && i < 8; ++i) list += (i ? ", " : "") + unused[i];
    log_warn("checkpoint ", reader.path(), ": ", unused.size(), " tensor(s) not used by the model: ", list,
             unused.size() > 8 ? ", ..." : "");
  }
  if (!ignored.empty())
    log_info("checkpoint ", reader.path(), ": ignored ", ignored.size(), " vision/MTP tensor(s)");
}

Model load_model(const std::string& dir, DType dtype) {
  check(is_floating(dtype), "cannot hold model weights in ", dtype_name(dtype));
  Model model{load_model_config(dir), {}};
  check_supported(model.config);
  model.weights = allocate_weights(model.config, dtype);
  load_weights(dir, model.config, model.weights);
  return model;
}

void save_model(const std::string& dir, const ModelConfig& c, ModelWeights& w, DType dtype) {
  std::filesystem::create_directories(dir);
  NamedTensors tensors;
  for (Param& p : parameter_table(c, w)) tensors.emplace_back(p.name, p.tensor.to(dtype));
  write_safetensors_checkpoint(dir, tensors);
  const std::string config_path = dir + "/config.json";
  const std::string temp = config_path + ".tmp";
  {
    std::ofstream out(temp);
    out << model_config_to_json(c).dump(2) << '\n';
    check(out.good(), "could not write ", temp);
  }
  std::filesystem::rename(temp, config_path);
}

}  // namespace spindle
