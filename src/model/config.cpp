// Parses the GLM-5.3-Flash configuration the way transformers 5.17 does (Glm5NextTextConfig and
// Glm5NextConfig in models/glm5_next/configuration_glm5_next.py), then adds the checks Spindle's
// kernels rely on. What transformers would silently ignore or misread is, where it could matter, an
// error here.
#include "model/config.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string_view>
#include <variant>

#include "core/error.h"
#include "core/log.h"

namespace spindle {
namespace {

using nlohmann::json;

// Generic Hugging Face PreTrainedConfig fields with no architecture meaning: ignored wherever they
// appear (top level or text_config). Every other unknown field is an error, so that a typo or a new
// architecture field is never dropped silently. num_nextn_predict_layers describes the
// multi-token-prediction layer, which Spindle neither loads nor trains. quantization_config is
// deliberately not here: quantized checkpoints are rejected (see check_key).
constexpr std::string_view kIgnoredFields[] = {
    "architectures",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_name_or_path",
    "model_type",
    "use_cache",
    "output_router_logits",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "is_encoder_decoder",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "prefix",
    "sep_token_id",
    "decoder_start_token_id",
    "task_specific_params",
    "finetuning_task",
    "tie_encoder_decoder",
    "auto_map",
    "keys_to_ignore_at_inference",
    "num_nextn_predict_layers",
};

// Glm5NextConfig's own fields for the vision tower; the text model never reads them.
constexpr std::string_view kMultimodalFields[] = {
    "vision_config",      "image_token_id",       "video_token_id",     "image_start_token_id",
    "image_end_token_id", "video_start_token_id", "video_end_token_id",
};

// Keys Glm5NextTextConfig consumes in __post_init__ besides its dataclass fields.
constexpr std::string_view kTextExtraKeys[] = {
    "eos_token_id",
    "mlp_layer_types",
    "layer_types",
    "indexer_types",
    "index_topk_pattern",
    "index_topk_freq",
    "index_skip_topk_offset",
    "linear_attn_config",
    "head_dim",
    "qk_head_dim",
    "num_local_experts",
};

// The scalar text fields, in Glm5NextTextConfig's order; one list drives parsing and writing so
// that model_config_to_json and parse_model_config cannot drift apart.
using Member = std::variant<int64_t ModelConfig::*, double ModelConfig::*, bool ModelConfig::*,
                            std::string ModelConfig::*, std::optional<int64_t> ModelConfig::*,
                            std::optional<double> ModelConfig::*>;
struct Field {
  std::string_view name;
  Member member;
};
const Field kFields[] = {
    {"vocab_size", &ModelConfig::vocab_size},
    {"hidden_size", &ModelConfig::hidden_size},
    {"intermediate_size", &ModelConfig::intermediate_size},
    {"moe_intermediate_size", &ModelConfig::moe_intermediate_size},
    {"num_hidden_layers", &ModelConfig::num_hidden_layers},
    {"num_attention_heads", &ModelConfig::num_attention_heads},
    {"num_key_value_heads", &ModelConfig::num_key_value_heads},
    {"n_shared_experts", &ModelConfig::n_shared_experts},
    {"n_routed_experts", &ModelConfig::n_routed_experts},
    {"routed_scaling_factor", &ModelConfig::routed_scaling_factor},
    {"kv_lora_rank", &ModelConfig::kv_lora_rank},
    {"q_lora_rank", &ModelConfig::q_lora_rank},
    {"qk_rope_head_dim", &ModelConfig::qk_rope_head_dim},
    {"v_head_dim", &ModelConfig::v_head_dim},
    {"qk_nope_head_dim", &ModelConfig::qk_nope_head_dim},
    {"n_group", &ModelConfig::n_group},
    {"topk_group", &ModelConfig::topk_group},
    {"num_experts_per_tok", &ModelConfig::num_experts_per_tok},
    {"norm_topk_prob", &ModelConfig::norm_topk_prob},
    {"hidden_act", &ModelConfig::hidden_act},
    {"max_position_embeddings", &ModelConfig::max_position_embeddings},
    {"initializer_range", &ModelConfig::initializer_range},
    {"rms_norm_eps", &ModelConfig::rms_norm_eps},
    {"pad_token_id", &ModelConfig::pad_token_id},
    {"bos_token_id", &ModelConfig::bos_token_id},
    {"tie_word_embeddings", &ModelConfig::tie_word_embeddings},
    {"attention_bias", &ModelConfig::attention_bias},
    {"attention_dropout", &ModelConfig::attention_dropout},
    {"index_topk", &ModelConfig::index_topk},
    {"index_head_dim", &ModelConfig::index_head_dim},
    {"index_n_heads", &ModelConfig::index_n_heads},
    {"swiglu_limit", &ModelConfig::swiglu_limit},
    {"linear_head_dim", &ModelConfig::linear_head_dim},
    {"linear_num_heads", &ModelConfig::linear_num_heads},
    {"linear_conv_kernel_dim", &ModelConfig::linear_conv_kernel_dim},
    {"linear_lower_bound", &ModelConfig::linear_lower_bound},
    {"hc_mult", &ModelConfig::hc_mult},
    {"hc_eps", &ModelConfig::hc_eps},
    {"hc_sinkhorn_iters", &ModelConfig::hc_sinkhorn_iters},
    {"router_aux_loss_coef", &ModelConfig::router_aux_loss_coef},
    {"index_kpool", &ModelConfig::index_kpool},
    {"index_kpool_always_select_tail", &ModelConfig::index_kpool_always_select_tail},
};

template <size_t N>
bool in_list(const std::string_view (&list)[N], std::string_view key) {
  for (std::string_view item : list) {
    if (item == key) return true;
  }
  return false;
}

bool is_text_key(std::string_view key) {
  for (const Field& field : kFields) {
    if (field.name == key) return true;
  }
  return in_list(kTextExtraKeys, key);
}

// Where a value sits, for messages: the file and the path of the object inside it.
struct Where {
  const std::string& source;
  std::string prefix;  // "" or "text_config."
};

std::string describe(const json& value) {
  switch (value.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean (" + value.dump() + ")";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer (" + value.dump() + ")";
    case json::value_t::number_float:
      return "a float (" + value.dump() + ")";
    case json::value_t::string:
      return "a string (" + value.dump() + ")";
    case json::value_t::array:
      return "a list (" + value.dump() + ")";
    case json::value_t::object:
      return "an object";
    default:
      return "a value of another type (" + value.dump() + ")";
  }
}

[[noreturn]] void type_error(const Where& where, std::string_view name, const json& value,
                             std::string_view expected) {
  fail(where.source, ": ", where.prefix, name, " must be ", expected, ", got ", describe(value));
}

// Strict like huggingface_hub's @strict: an int field takes only integers (not floats, not bools),
// a float field takes floats or integers, a bool field only booleans.
int64_t read_int(const Where& where, std::string_view name, const json& value) {
  if (!value.is_number_integer()) type_error(where, name, value, "an integer");
  if (value.is_number_unsigned() &&
      value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    type_error(where, name, value, "an integer that fits in 64 bits");
  }
  return value.get<int64_t>();
}

double read_float(const Where& where, std::string_view name, const json& value) {
  if (!value.is_number()) type_error(where, name, value, "a number");
  return value.get<double>();
}

bool read_bool(const Where& where, std::string_view name, const json& value) {
  if (!value.is_boolean()) type_error(where, name, value, "a boolean");
  return value.get<bool>();
}

std::string read_string(const Where& where, std::string_view name, const json& value) {
  if (!value.is_string()) type_error(where, name, value, "a string");
  return value.get<std::string>();
}

void read_field(const Where& where, const Field& field, const json& value, ModelConfig& config) {
  std::visit(
      [&](auto member) {
        using T = std::remove_reference_t<decltype(config.*member)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          config.*member = read_int(where, field.name, value);
        } else if constexpr (std::is_same_v<T, double>) {
          config.*member = read_float(where, field.name, value);
        } else if constexpr (std::is_same_v<T, bool>) {
          config.*member = read_bool(where, field.name, value);
        } else if constexpr (std::is_same_v<T, std::string>) {
          config.*member = read_string(where, field.name, value);
        } else if constexpr (std::is_same_v<T, std::optional<int64_t>>) {
          config.*member = value.is_null() ? std::nullopt : std::optional(read_int(where, field.name, value));
        } else {
          config.*member =
              value.is_null() ? std::nullopt : std::optional(read_float(where, field.name, value));
        }
      },
      field.member);
}

void write_field(const Field& field, const ModelConfig& config, json& out) {
  std::visit(
      [&](auto member) {
        const auto& value = config.*member;
        using T = std::remove_cvref_t<decltype(value)>;
        if constexpr (std::is_same_v<T, std::optional<int64_t>> || std::is_same_v<T, std::optional<double>>) {
          out[std::string(field.name)] = value ? json(*value) : json(nullptr);
        } else {
          out[std::string(field.name)] = value;
        }
      },
      field.member);
}

std::optional<AttentionKind> attention_kind(std::string_view name) {
  if (name == "linear_attention") return AttentionKind::Kda;
  // transformers maps "full_attention" onto the sparse MLA layer.
  if (name == "deepseek_sparse_attention" || name == "full_attention") return AttentionKind::Dsa;
  return std::nullopt;
}

std::optional<MlpKind> mlp_kind(std::string_view name) {
  if (name == "dense") return MlpKind::Dense;
  if (name == "sparse") return MlpKind::Sparse;
  return std::nullopt;
}

std::optional<IndexerKind> indexer_kind(std::string_view name) {
  if (name == "full") return IndexerKind::Full;
  if (name == "shared") return IndexerKind::Shared;
  return std::nullopt;
}

// A list of names, each mapped by `convert`; transformers compares these strings with == and
// treats anything unrecognised as the other kind, so Spindle rejects unknown names instead.
template <class Kind, class Convert>
std::vector<Kind> read_schedule(const Where& where, std::string_view name, const json& value, Convert convert,
                                std::string_view allowed) {
  if (!value.is_array()) type_error(where, name, value, "a list of strings");
  std::vector<Kind> kinds;
  for (size_t i = 0; i < value.size(); ++i) {
    const json& item = value[i];
    std::optional<Kind> kind = item.is_string() ? convert(item.get<std::string>()) : std::nullopt;
    if (!kind) {
      fail(where.source, ": ", where.prefix, name, "[", i, "] is ", describe(item), "; expected ", allowed);
    }
    kinds.push_back(*kind);
  }
  return kinds;
}

// index_topk_pattern: a string of 'F'/'S' characters or a list of "full"/"shared".
std::vector<IndexerKind> read_pattern(const Where& where, const json& value) {
  if (!value.is_string()) {
    return read_schedule<IndexerKind>(where, "index_topk_pattern", value, indexer_kind,
                                      "\"full\" or \"shared\"");
  }
  std::vector<IndexerKind> kinds;
  const std::string pattern = value.get<std::string>();
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == 'F') {
      kinds.push_back(IndexerKind::Full);
    } else if (pattern[i] == 'S') {
      kinds.push_back(IndexerKind::Shared);
    } else {
      fail(where.source, ": ", where.prefix, "index_topk_pattern \"", pattern, "\" has '", pattern[i],
           "' at position ", i, "; expected only 'F' (full) and 'S' (shared)");
    }
  }
  return kinds;
}

template <class Kind>
void check_length(const ModelConfig& c, std::string_view name, const std::vector<Kind>& kinds) {
  check(static_cast<int64_t>(kinds.size()) == c.num_hidden_layers, c.source, ": ", name, " has ",
        kinds.size(), " entries but num_hidden_layers is ", c.num_hidden_layers,
        "; it needs one entry per layer");
}

void check_positive(const ModelConfig& c, std::string_view name, int64_t value) {
  check(value >= 1, c.source, ": ", name, " must be at least 1, got ", value);
}

// transformers' validate_architecture, then the checks Spindle needs for its own kernels.
void validate(const ModelConfig& c) {
  check(c.num_attention_heads == c.num_key_value_heads, c.source, ": num_attention_heads (",
        c.num_attention_heads, ") must be the same as num_key_value_heads (", c.num_key_value_heads, ")");
  check(c.index_kpool >= 1, c.source, ": index_kpool must be positive, got ", c.index_kpool);
  check(c.index_topk % c.index_kpool == 0, c.source, ": index_topk (", c.index_topk,
        ") must be divisible by index_kpool (", c.index_kpool, ")");
  check(c.qk_rope_head_dim == 0, c.source,
        ": qk_rope_head_dim must be 0 (the DSA attention layers use NoPE), got ", c.qk_rope_head_dim);

  for (auto [name, value] : {
           std::pair<std::string_view, int64_t>{"vocab_size", c.vocab_size},
           {"hidden_size", c.hidden_size},
           {"intermediate_size", c.intermediate_size},
           {"moe_intermediate_size", c.moe_intermediate_size},
           {"num_attention_heads", c.num_attention_heads},
           {"n_shared_experts", c.n_shared_experts},
           {"n_routed_experts", c.n_routed_experts},
           {"kv_lora_rank", c.kv_lora_rank},
           {"q_lora_rank", c.q_lora_rank},
           {"v_head_dim", c.v_head_dim},
           {"qk_nope_head_dim", c.qk_nope_head_dim},
           {"n_group", c.n_group},
           {"topk_group", c.topk_group},
           {"num_experts_per_tok", c.num_experts_per_tok},
           {"max_position_embeddings", c.max_position_embeddings},
           {"index_topk", c.index_topk},
           {"index_head_dim", c.index_head_dim},
           {"index_n_heads", c.index_n_heads},
           {"linear_head_dim", c.linear_head_dim},
           {"linear_num_heads", c.linear_num_heads},
           {"linear_conv_kernel_dim", c.linear_conv_kernel_dim},
           {"hc_mult", c.hc_mult},
           {"hc_sinkhorn_iters", c.hc_sinkhorn_iters},
       }) {
    check_positive(c, name, value);
  }

  // The router views the experts as n_group groups, scores each group by its best two experts, keeps
  // topk_group groups and picks num_experts_per_tok experts among them.
  check(c.n_routed_experts % c.n_group == 0, c.source, ": n_routed_experts (", c.n_routed_experts,
        ") must be divisible by n_group (", c.n_group, ")");
  const int64_t per_group = c.n_routed_experts / c.n_group;
  check(per_group >= 2, c.source, ": each of the n_group (", c.n_group,
        ") expert groups needs at least 2 experts ",
        "(the router scores a group by its top two), got n_routed_experts ", c.n_routed_experts);
  check(c.topk_group <= c.n_group, c.source, ": topk_group (", c.topk_group, ") must not exceed n_group (",
        c.n_group, ")");
  check(c.num_experts_per_tok <= c.n_routed_experts, c.source, ": num_experts_per_tok (",
        c.num_experts_per_tok, ") must not exceed n_routed_experts (", c.n_routed_experts, ")");
  check((c.num_experts_per_tok - 1) / per_group + 1 <= c.topk_group, c.source, ": num_experts_per_tok (",
        c.num_experts_per_tok, ") exceeds the experts in the topk_group (", c.topk_group,
        ") selected groups of ", per_group, " experts each");

  check(c.hidden_act == "silu", c.source,
        ": hidden_act must be \"silu\" (the only activation Spindle implements), got \"", c.hidden_act, "\"");
  check(c.rms_norm_eps > 0, c.source, ": rms_norm_eps must be positive, got ", c.rms_norm_eps);
  check(c.hc_eps >= 0, c.source, ": hc_eps must not be negative, got ", c.hc_eps);
  check(c.swiglu_limit > 0, c.source, ": swiglu_limit must be positive, got ", c.swiglu_limit);
  check(c.attention_dropout >= 0 && c.attention_dropout < 1, c.source,
        ": attention_dropout must be in [0, 1), got ", c.attention_dropout);
  check(c.initializer_range >= 0, c.source, ": initializer_range must not be negative, got ",
        c.initializer_range);
  // transformers passes pad_token_id to nn.Embedding as padding_idx, which must index a row.
  if (c.pad_token_id) {
    check(*c.pad_token_id >= 0 && *c.pad_token_id < c.vocab_size, c.source, ": pad_token_id (",
          *c.pad_token_id, ") must be a token id below vocab_size (", c.vocab_size, ") or null");
  }

  check_length(c, "layer_types", c.layer_types);
  check_length(c, "mlp_layer_types", c.mlp_layer_types);
  check_length(c, "indexer_types", c.indexer_types);

  // A shared DSA layer reuses the top-k selection that the layer right before it returns, and only a
  // DSA layer with a full indexer returns one; transformers finds out mid-forward, Spindle at load.
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (!c.dsa_shares_previous_selection(i)) continue;
    check(i > 0, c.source,
          ": layer 0 is a DSA layer with indexer_types \"shared\", but there is no earlier layer ",
          "whose top-k selection it could reuse");
    const bool previous_full_dsa =
        c.layer_types[i - 1] == AttentionKind::Dsa && c.indexer_types[i - 1] == IndexerKind::Full;
    check(previous_full_dsa, c.source, ": layer ", i,
          " is a DSA layer with indexer_types \"shared\", so layer ", i - 1,
          " must be a DSA layer with indexer_types \"full\" (transformers hands the top-k selection "
          "only to the next layer), but layer ",
          i - 1, " is ", attention_kind_name(c.layer_types[i - 1]), " with indexer_types \"",
          indexer_kind_name(c.indexer_types[i - 1]), "\"");
  }
}

// Refuses what Spindle cannot read; returns whether `key` should be ignored.
bool check_key(const Where& where, const std::string& key) {
  check(key != "quantization_config", where.source, ": ", where.prefix,
        "quantization_config is present: quantized checkpoints are not supported");
  if (is_text_key(key)) return false;
  if (key == "model_type" || in_list(kIgnoredFields, key)) return true;
  fail(where.source, ": unknown field '", where.prefix, key,
       "' (not a Glm5NextTextConfig field; Spindle rejects unknown fields rather than ignore a setting)");
}

// Glm5NextTextConfig(**object): its dataclass defaults, then __post_init__'s derivations.
ModelConfig parse_text(const json& object, const Where& where) {
  ModelConfig c;
  c.source = where.source;
  for (const auto& [key, value] : object.items()) check_key(where, key);
  if (const auto it = object.find("model_type"); it != object.end()) {
    const std::string type = read_string(where, "model_type", *it);
    check(type == "glm5_next_text", where.source, ": ", where.prefix, "model_type is \"", type,
          "\"; expected \"glm5_next_text\"");
  }
  auto find = [&](std::string_view key) -> const json* {
    const auto it = object.find(std::string(key));
    return it == object.end() ? nullptr : &*it;
  };

  bool kv_heads_null = false;
  for (const Field& field : kFields) {
    const json* value = find(field.name);
    if (!value) continue;
    if (field.name == "num_key_value_heads" && value->is_null()) {
      kv_heads_null = true;  // __post_init__: None means one key/value head per attention head.
      continue;
    }
    if (field.name == "q_lora_rank" && value->is_null()) {
      fail(where.source, ": ", where.prefix,
           "q_lora_rank is null, but DSA attention layers strictly require a query LoRA rank");
    }
    read_field(where, field, *value, c);
  }
  if (kv_heads_null) c.num_key_value_heads = c.num_attention_heads;
  if (const json* value = find("eos_token_id")) {
    bool ok = value->is_null() || value->is_number_integer();
    if (value->is_array()) {
      ok = true;
      for (const json& item : *value) ok = ok && item.is_number_integer();
    }
    if (!ok) type_error(where, "eos_token_id", *value, "null, an integer or a list of integers");
    c.eos_token_id = *value;
  }
  // attribute_map: num_local_experts is another name for n_routed_experts.
  if (const json* value = find("num_local_experts")) {
    const int64_t experts = read_int(where, "num_local_experts", *value);
    check(!find("n_routed_experts") || experts == c.n_routed_experts, where.source, ": ", where.prefix,
          "num_local_experts (", experts, ") contradicts n_routed_experts (", c.n_routed_experts,
          "); they name the same setting");
    c.n_routed_experts = experts;
  }
  check_positive(c, "num_hidden_layers", c.num_hidden_layers);
  const int64_t layers = c.num_hidden_layers;

  const json* mlp = find("mlp_layer_types");
  if (mlp && !mlp->is_null()) {
    c.mlp_layer_types =
        read_schedule<MlpKind>(where, "mlp_layer_types", *mlp, mlp_kind, "\"dense\" or \"sparse\"");
  } else {
    for (int64_t i = 0; i < layers; ++i)
      c.mlp_layer_types.push_back(i < 3 ? MlpKind::Dense : MlpKind::Sparse);
  }

  const json* attention = find("layer_types");
  if (attention && !attention->is_null()) {
    c.layer_types = read_schedule<AttentionKind>(
        where, "layer_types", *attention, attention_kind,
        "\"linear_attention\", \"deepseek_sparse_attention\" or \"full_attention\"");
  } else {
    for (int64_t i = 0; i < layers; ++i)
      c.layer_types.push_back(i % 4 != 3 ? AttentionKind::Kda : AttentionKind::Dsa);
  }

  // Indexer schedule: an explicit list, else index_topk_pattern, else the freq/offset formula.
  const json* pattern = find("index_topk_pattern");
  std::optional<std::vector<IndexerKind>> from_pattern;
  if (pattern && !pattern->is_null()) from_pattern = read_pattern(where, *pattern);
  int64_t freq = 1;
  int64_t offset = 2;
  if (const json* value = find("index_topk_freq")) freq = read_int(where, "index_topk_freq", *value);
  if (const json* value = find("index_skip_topk_offset"))
    offset = read_int(where, "index_skip_topk_offset", *value);
  const json* indexer = find("indexer_types");
  if (indexer && !indexer->is_null()) {
    c.indexer_types =
        read_schedule<IndexerKind>(where, "indexer_types", *indexer, indexer_kind, "\"full\" or \"shared\"");
    // transformers saves both; it would silently follow indexer_types if they disagreed.
    if (from_pattern && *from_pattern != c.indexer_types) {
      fail(where.source, ": ", where.prefix, "indexer_types (", indexer->dump(),
           ") contradicts index_topk_pattern (", pattern->dump(), ")");
    }
  } else if (from_pattern) {
    c.indexer_types = *from_pattern;
  } else {
    freq = std::max<int64_t>(freq, 1);
    for (int64_t i = 0; i < layers; ++i) {
      const bool full = std::max<int64_t>(i - offset + 1, 0) % freq == 0;
      c.indexer_types.push_back(full ? IndexerKind::Full : IndexerKind::Shared);
    }
  }

  // linear_attn_config (Kimi-Linear's form) overrides the linear_* fields.
  const json* linear = find("linear_attn_config");
  if (linear && !linear->is_null()) {
    if (!linear->is_object()) type_error(where, "linear_attn_config", *linear, "an object");
    const Where inner{where.source, where.prefix + "linear_attn_config."};
    bool safe_gate = true;
    for (const auto& [key, value] : linear->items()) {
      if (key == "head_dim") {
        c.linear_head_dim = read_int(inner, key, value);
      } else if (key == "num_heads") {
        c.linear_num_heads = read_int(inner, key, value);
      } else if (key == "short_conv_kernel_size") {
        c.linear_conv_kernel_dim = read_int(inner, key, value);
      } else if (key == "gate_lower_bound") {
        c.linear_lower_bound = value.is_null() ? std::nullopt : std::optional(read_float(inner, key, value));
      } else if (key == "safe_gate") {
        safe_gate = read_bool(inner, key, value);
      } else {
        fail(where.source, ": unknown field '", inner.prefix, key,
             "' (linear_attn_config takes head_dim, num_heads, short_conv_kernel_size, gate_lower_bound and "
             "safe_gate)");
      }
    }
    if (safe_gate && !c.linear_lower_bound) c.linear_lower_bound = -5.0;
  }

  // head_dim is forced to the RoPE width whatever the file says; a stored qk_head_dim would override
  // transformers' derived one, so it has to agree.
  if (const json* value = find("head_dim")) read_int(where, "head_dim", *value);
  if (const json* value = find("qk_head_dim")) {
    const int64_t qk_head_dim = read_int(where, "qk_head_dim", *value);
    check(qk_head_dim == c.qk_head_dim(), where.source, ": ", where.prefix, "qk_head_dim (", qk_head_dim,
          ") must equal qk_rope_head_dim + qk_nope_head_dim (", c.qk_rope_head_dim, " + ", c.qk_nope_head_dim,
          ")");
  }

  validate(c);
  return c;
}

}  // namespace

bool ModelConfig::dsa_shares_previous_selection(int64_t layer) const {
  check(layer >= 0 && layer < static_cast<int64_t>(layer_types.size()) &&
            layer < static_cast<int64_t>(indexer_types.size()),
        "dsa_shares_previous_selection: layer ", layer, " is out of range (", layer_types.size(), " layers)");
  return layer_types[layer] == AttentionKind::Dsa && indexer_types[layer] == IndexerKind::Shared;
}

ModelConfig parse_model_config(const json& json_config, const std::string& source) {
  const Where top{source, ""};
  check(json_config.is_object(), source, ": a model config must be a JSON object, got ",
        describe(json_config));
  std::string model_type;
  if (const auto it = json_config.find("model_type"); it != json_config.end()) {
    model_type = read_string(top, "model_type", *it);
  }
  // A bare Glm5NextTextConfig; a file without model_type is read the same way.
  if (model_type.empty() || model_type == "glm5_next_text") return parse_text(json_config, top);
  check(model_type == "glm5_next", source, ": model_type \"", model_type,
        "\" is not supported; Spindle reads GLM-5.3-Flash configs (model_type \"glm5_next\" or "
        "\"glm5_next_text\")");

  // Glm5NextConfig: split its own fields from the text fields.
  json top_text = json::object();
  std::optional<bool> top_tie;
  for (const auto& [key, value] : json_config.items()) {
    if (key == "text_config" || in_list(kMultimodalFields, key)) continue;
    if (key == "tie_word_embeddings") {
      top_tie = read_bool(top, key, value);  // a Glm5NextConfig field; the model ties by this one
      continue;
    }
    if (!check_key(top, key)) top_text[key] = value;
  }
  const auto text_it = json_config.find("text_config");
  if (text_it == json_config.end() || text_it->is_null()) {
    // Flat form: transformers builds text_config from the top-level fields.
    ModelConfig c = parse_text(top_text, top);
    c.tie_word_embeddings = top_tie.value_or(false);
    return c;
  }
  const json& text = *text_it;
  if (!text.is_object()) type_error(top, "text_config", text, "an object");
  ModelConfig c = parse_text(text, Where{source, "text_config."});

  // Glm5NextForConditionalGeneration ties by the top-level field alone; text_config's copy has no
  // effect, and transformers itself saves a flat tied config with text_config's left false.
  const bool tie = top_tie.value_or(false);
  if (c.tie_word_embeddings && !tie) {
    log_warn(source, ": text_config.tie_word_embeddings is true but the top-level tie_word_embeddings is ",
             top_tie ? "false" : "absent (false)",
             "; like transformers, Spindle does not tie the embeddings");
  }
  c.tie_word_embeddings = tie;

  // With a text_config present transformers reads no text field from the top level (it only keeps
  // them as attributes, and writes them back when saving); accept each only if it agrees.
  const json reference = model_config_to_json(c);
  for (const auto& [key, value] : top_text.items()) {
    json probe = text;
    probe[key] = value;
    ModelConfig merged;
    try {
      merged = parse_text(probe, top);
    } catch (const Error& error) {
      fail(source, ": top-level ", key, " (", value.dump(), ") contradicts text_config: ", error.what());
    }
    merged.tie_word_embeddings = tie;
    check(model_config_to_json(merged) == reference, source, ": top-level ", key, " (", value.dump(),
          ") contradicts text_config.", key, " (",
          text.contains(key) ? text[key].dump() : "absent, so the default",
          "); transformers reads only text_config when it is present");
  }
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  std::filesystem::path file(path);
  std::error_code ignored;
  if (std::filesystem::is_directory(file, ignored)) file /= "config.json";
  std::ifstream in(file);
  check(in.good(), "cannot read model config ", file.string(), ": ", std::strerror(errno));
  json json_config;
  try {
    json_config = json::parse(in);
  } catch (const json::parse_error& error) {
    fail(file.string(), ": invalid JSON: ", error.what());
  }
  return parse_model_config(json_config, file.string());
}

json model_config_to_json(const ModelConfig& config) {
  json text = json::object();
  for (const Field& field : kFields) write_field(field, config, text);
  text["eos_token_id"] = config.eos_token_id;
  json mlp = json::array();
  for (MlpKind kind : config.mlp_layer_types) mlp.push_back(mlp_kind_name(kind));
  json attention = json::array();
  for (AttentionKind kind : config.layer_types) attention.push_back(attention_kind_name(kind));
  json indexer = json::array();
  for (IndexerKind kind : config.indexer_types) indexer.push_back(indexer_kind_name(kind));
  text["mlp_layer_types"] = mlp;
  text["layer_types"] = attention;
  text["indexer_types"] = indexer;
  text["model_type"] = "glm5_next_text";
  text["head_dim"] = config.qk_rope_head_dim;  // transformers forces head_dim to the RoPE width

  // The smallest vision tower transformers will build, so a reference model costs almost nothing.
  json vision = {{"depth", 1},
                 {"hidden_size", 16},
                 {"num_heads", 2},
                 {"intermediate_size", 16},
                 {"out_hidden_size", config.hidden_size},
                 {"projection_intermediate_size", 16},
                 {"model_type", "glm5_next_vision"}};
  json out = json::object();
  out["architectures"] = json::array({"Glm5NextForConditionalGeneration"});
  out["model_type"] = "glm5_next";
  out["tie_word_embeddings"] = config.tie_word_embeddings;
  out["text_config"] = std::move(text);
  out["vision_config"] = std::move(vision);
  return out;
}

std::vector<bool> last_layers_of_kind(const std::vector<AttentionKind>& kinds, AttentionKind kind,
                                      int64_t n) {
  std::vector<bool> last(kinds.size(), false);
  for (size_t i = kinds.size(); i-- > 0 && n > 0;)
    if (kinds[i] == kind) {
      last[i] = true;
      --n;
    }
  return last;
}

const char* attention_kind_name(AttentionKind kind) {
  return kind == AttentionKind::Kda ? "linear_attention" : "deepseek_sparse_attention";
}

const char* mlp_kind_name(MlpKind kind) { return kind == MlpKind::Dense ? "dense" : "sparse"; }

const char* indexer_kind_name(IndexerKind kind) { return kind == IndexerKind::Full ? "full" : "shared"; }

}  // namespace spindle
