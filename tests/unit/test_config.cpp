// Config parsing against transformers 5.17's configuration_glm5_next.py: defaults, derived
// schedules, the three file forms, strict types and every validation error.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "model/config.h"

namespace spindle {
namespace {

using nlohmann::json;

ModelConfig parse(const json& j) { return parse_model_config(j, "test.json"); }

// The message of the error parsing `j` raises; fails the test if it parses.
std::string error_of(const json& j) {
  try {
    parse(j);
  } catch (const Error& error) {
    return error.what();
  }
  ADD_FAILURE() << "parsed without error: " << j.dump();
  return "";
}

#define EXPECT_ERROR(j, ...)                                                                      \
  do {                                                                                            \
    const std::string message = error_of(j);                                                      \
    for (const char* part : {__VA_ARGS__}) {                                                      \
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message; \
    }                                                                                             \
  } while (0)

// A small valid text config: every layer DSA, so any indexer schedule with a full first layer works.
json all_dsa(int layers) {
  json types = json::array();
  for (int i = 0; i < layers; ++i) types.push_back("deepseek_sparse_attention");
  return {{"num_hidden_layers", layers}, {"layer_types", types}};
}

int count(const auto& kinds, auto kind) {
  return static_cast<int>(std::count(kinds.begin(), kinds.end(), kind));
}

void expect_same(const ModelConfig& a, const ModelConfig& b) {
#define SAME(field) EXPECT_EQ(a.field, b.field) << #field
  SAME(vocab_size);
  SAME(hidden_size);
  SAME(intermediate_size);
  SAME(moe_intermediate_size);
  SAME(num_hidden_layers);
  SAME(num_attention_heads);
  SAME(num_key_value_heads);
  SAME(n_shared_experts);
  SAME(n_routed_experts);
  SAME(routed_scaling_factor);
  SAME(kv_lora_rank);
  SAME(q_lora_rank);
  SAME(qk_rope_head_dim);
  SAME(v_head_dim);
  SAME(qk_nope_head_dim);
  SAME(n_group);
  SAME(topk_group);
  SAME(num_experts_per_tok);
  SAME(norm_topk_prob);
  SAME(hidden_act);
  SAME(max_position_embeddings);
  SAME(initializer_range);
  SAME(rms_norm_eps);
  SAME(pad_token_id);
  SAME(bos_token_id);
  SAME(eos_token_id);
  SAME(tie_word_embeddings);
  SAME(attention_bias);
  SAME(attention_dropout);
  SAME(index_topk);
  SAME(index_head_dim);
  SAME(index_n_heads);
  SAME(swiglu_limit);
  SAME(linear_head_dim);
  SAME(linear_num_heads);
  SAME(linear_conv_kernel_dim);
  SAME(linear_lower_bound);
  SAME(hc_mult);
  SAME(hc_eps);
  SAME(hc_sinkhorn_iters);
  SAME(router_aux_loss_coef);
  SAME(index_kpool);
  SAME(index_kpool_always_select_tail);
  SAME(layer_types);
  SAME(mlp_layer_types);
  SAME(indexer_types);
#undef SAME
}

TEST(Config, EmptyConfigHasPythonDefaults) {
  const ModelConfig c = parse(json::object());
  // The dataclass defaults of Glm5NextTextConfig.
  EXPECT_EQ(c.vocab_size, 154880);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 45);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.num_key_value_heads, 64);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.n_routed_experts, 288);
  EXPECT_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.qk_rope_head_dim, 0);
  EXPECT_EQ(c.v_head_dim, 256);
  EXPECT_EQ(c.qk_nope_head_dim, 256);
  EXPECT_EQ(c.qk_head_dim(), 256);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.max_position_embeddings, 1048576);
  EXPECT_EQ(c.initializer_range, 0.02);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.pad_token_id, 154820);
  EXPECT_FALSE(c.bos_token_id.has_value());
  EXPECT_TRUE(c.eos_token_id.is_null());
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.attention_dropout, 0.0);
  EXPECT_EQ(c.index_topk, 2048);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_n_heads, 32);
  EXPECT_EQ(c.swiglu_limit, 10.0);
  EXPECT_EQ(c.linear_head_dim, 128);
  EXPECT_EQ(c.linear_num_heads, 64);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.linear_lower_bound, -5.0);
  EXPECT_EQ(c.hc_mult, 4);
  EXPECT_EQ(c.hc_eps, 1e-6);
  EXPECT_EQ(c.hc_sinkhorn_iters, 20);
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_EQ(c.index_kpool, 16);
  EXPECT_TRUE(c.index_kpool_always_select_tail);
  EXPECT_EQ(c.source, "test.json");

  // layer_types: DSA where i % 4 == 3, i.e. 3, 7, ..., 43: 11 of 45.
  ASSERT_EQ(c.layer_types.size(), 45u);
  EXPECT_EQ(count(c.layer_types, AttentionKind::Kda), 34);
  EXPECT_EQ(count(c.layer_types, AttentionKind::Dsa), 11);
  EXPECT_EQ(c.layer_types[0], AttentionKind::Kda);
  EXPECT_EQ(c.layer_types[2], AttentionKind::Kda);
  EXPECT_EQ(c.layer_types[3], AttentionKind::Dsa);
  EXPECT_EQ(c.layer_types[43], AttentionKind::Dsa);
  EXPECT_EQ(c.layer_types[44], AttentionKind::Kda);
  // mlp_layer_types: ["dense"] * 3 + ["sparse"] * 42.
  ASSERT_EQ(c.mlp_layer_types.size(), 45u);
  EXPECT_EQ(count(c.mlp_layer_types, MlpKind::Dense), 3);
  EXPECT_EQ(c.mlp_layer_types[2], MlpKind::Dense);
  EXPECT_EQ(c.mlp_layer_types[3], MlpKind::Sparse);
  EXPECT_EQ(c.mlp_layer_types[44], MlpKind::Sparse);
  // indexer_types with freq 1: max(i - 1, 0) % 1 == 0 for every layer, so all full.
  ASSERT_EQ(c.indexer_types.size(), 45u);
  EXPECT_EQ(count(c.indexer_types, IndexerKind::Full), 45);
  for (int64_t i = 0; i < 45; ++i) EXPECT_FALSE(c.dsa_shares_previous_selection(i));
}

TEST(Config, ShortModelsGetShortDefaultSchedules) {
  // ["dense"] * min(3, 2) + ["sparse"] * (2 - 3): Python's negative repeat is empty.
  const ModelConfig c = parse({{"num_hidden_layers", 2}});
  EXPECT_EQ(c.mlp_layer_types, (std::vector{MlpKind::Dense, MlpKind::Dense}));
  EXPECT_EQ(c.layer_types, (std::vector{AttentionKind::Kda, AttentionKind::Kda}));
  EXPECT_EQ(c.indexer_types.size(), 2u);
}

TEST(Config, IndexTopkPatternStringAndList) {
  json j = all_dsa(4);
  j["index_topk_pattern"] = "FFSF";
  const ModelConfig from_string = parse(j);
  const std::vector expected{IndexerKind::Full, IndexerKind::Full, IndexerKind::Shared, IndexerKind::Full};
  EXPECT_EQ(from_string.indexer_types, expected);
  EXPECT_FALSE(from_string.dsa_shares_previous_selection(1));
  EXPECT_TRUE(from_string.dsa_shares_previous_selection(2));
  EXPECT_FALSE(from_string.dsa_shares_previous_selection(3));

  j["index_topk_pattern"] = {"full", "full", "shared", "full"};
  EXPECT_EQ(parse(j).indexer_types, expected);

  // The pattern overrides the freq/offset schedule.
  j["index_topk_freq"] = 1;
  EXPECT_EQ(parse(j).indexer_types, expected);

  j["index_topk_pattern"] = "FFXF";
  EXPECT_ERROR(j, "index_topk_pattern", "'X'");
  j["index_topk_pattern"] = {"full", "full", "half", "full"};
  EXPECT_ERROR(j, "index_topk_pattern[2]", "half");
  j["index_topk_pattern"] = "FFS";
  EXPECT_ERROR(j, "indexer_types", "3 entries", "num_hidden_layers is 4");
}

TEST(Config, IndexerFreqOffsetSchedule) {
  // Layer i is full iff max(i - offset + 1, 0) % freq == 0. With freq 2, offset 2 on 4 layers:
  // i=0 -> 0 full, i=1 -> 0 full, i=2 -> 1 shared, i=3 -> 2 full.
  json j = all_dsa(4);
  j["index_topk_freq"] = 2;
  j["index_skip_topk_offset"] = 2;
  EXPECT_EQ(parse(j).indexer_types,
            (std::vector{IndexerKind::Full, IndexerKind::Full, IndexerKind::Shared, IndexerKind::Full}));

  // Default 45 layers, freq 2, offset 2: layer 0 and the odd layers are full (23), even layers from 2
  // are shared (22); every DSA layer (3, 7, ...) is odd, hence full.
  const ModelConfig c = parse({{"index_topk_freq", 2}, {"index_skip_topk_offset", 2}});
  EXPECT_EQ(count(c.indexer_types, IndexerKind::Full), 23);
  EXPECT_EQ(count(c.indexer_types, IndexerKind::Shared), 22);
  EXPECT_EQ(c.indexer_types[0], IndexerKind::Full);
  EXPECT_EQ(c.indexer_types[2], IndexerKind::Shared);
  EXPECT_EQ(c.indexer_types[43], IndexerKind::Full);
  EXPECT_EQ(c.indexer_types[44], IndexerKind::Shared);
  EXPECT_FALSE(c.dsa_shares_previous_selection(44));  // shared, but a KDA layer

  // freq is clamped to at least 1: all full. Offset 0 on 4 layers with freq 3: i + 1 in {1, 2, 3, 4},
  // so only layer 2 is full.
  EXPECT_EQ(count(parse({{"index_topk_freq", 0}}).indexer_types, IndexerKind::Full), 45);
  json k = all_dsa(4);
  k["index_topk_freq"] = 3;
  k["index_skip_topk_offset"] = 0;
  EXPECT_ERROR(k, "layer 0");  // layer 0 would be a shared DSA layer
}

TEST(Config, ExplicitIndexerTypesMustAgreeWithPattern) {
  json j = all_dsa(4);
  j["indexer_types"] = {"full", "full", "shared", "full"};
  j["index_topk_pattern"] = "FFSF";
  EXPECT_EQ(parse(j).indexer_types[2], IndexerKind::Shared);
  j["index_topk_pattern"] = "FFFF";
  EXPECT_ERROR(j, "indexer_types", "index_topk_pattern", "FFFF");
  j["indexer_types"] = {"full", "full", "sometimes", "full"};
  EXPECT_ERROR(j, "indexer_types[2]", "sometimes");
}

TEST(Config, LinearAttnConfigOverridesLinearFields) {
  const ModelConfig c = parse(
      {{"linear_head_dim", 32},
       {"linear_attn_config",
        {{"head_dim", 64}, {"num_heads", 8}, {"short_conv_kernel_size", 3}, {"gate_lower_bound", -3.0}}}});
  EXPECT_EQ(c.linear_head_dim, 64);
  EXPECT_EQ(c.linear_num_heads, 8);
  EXPECT_EQ(c.linear_conv_kernel_dim, 3);
  EXPECT_EQ(c.linear_lower_bound, -3.0);
  EXPECT_EQ(c.linear_qkv_dim(), 512);

  // safe_gate (default true) replaces a null bound with -5.
  EXPECT_EQ(parse({{"linear_attn_config", {{"gate_lower_bound", nullptr}}}}).linear_lower_bound, -5.0);
  EXPECT_EQ(
      parse({{"linear_lower_bound", nullptr}, {"linear_attn_config", json::object()}}).linear_lower_bound,
      -5.0);
  EXPECT_FALSE(parse({{"linear_attn_config", {{"gate_lower_bound", nullptr}, {"safe_gate", false}}}})
                   .linear_lower_bound.has_value());
  // Without linear_attn_config a null bound stays null (softplus decay, no lower bound).
  EXPECT_FALSE(parse({{"linear_lower_bound", nullptr}}).linear_lower_bound.has_value());

  EXPECT_ERROR(json({{"linear_attn_config", {{"kda_layers", {1, 2}}}}}), "linear_attn_config.kda_layers",
               "test.json");
  EXPECT_ERROR(json({{"linear_attn_config", {{"head_dim", 64.5}}}}), "linear_attn_config.head_dim",
               "integer");
  EXPECT_ERROR(json({{"linear_attn_config", 3}}), "linear_attn_config", "object");
}

TEST(Config, AliasesAndDerivedFields) {
  EXPECT_EQ(parse({{"num_local_experts", 64}}).n_routed_experts, 64);
  EXPECT_EQ(parse({{"num_local_experts", 64}, {"n_routed_experts", 64}}).n_routed_experts, 64);
  EXPECT_ERROR(json({{"num_local_experts", 64}, {"n_routed_experts", 32}}), "num_local_experts",
               "n_routed_experts");

  const ModelConfig kv = parse({{"num_attention_heads", 16}, {"num_key_value_heads", nullptr}});
  EXPECT_EQ(kv.num_key_value_heads, 16);

  // head_dim is forced to qk_rope_head_dim (0); qk_head_dim must match rope + nope.
  EXPECT_EQ(parse({{"head_dim", 192}}).qk_rope_head_dim, 0);
  EXPECT_EQ(parse({{"qk_head_dim", 256}}).qk_head_dim(), 256);
  EXPECT_ERROR(json({{"qk_head_dim", 192}}), "qk_head_dim", "192");
  EXPECT_ERROR(json({{"head_dim", 1.5}}), "head_dim");

  // "full_attention" is transformers' old name for the DSA layer.
  json j = all_dsa(2);
  j["layer_types"] = {"linear_attention", "full_attention"};
  EXPECT_EQ(parse(j).layer_types, (std::vector{AttentionKind::Kda, AttentionKind::Dsa}));
  j["layer_types"] = {"linear_attention", "sliding_attention"};
  EXPECT_ERROR(j, "layer_types[1]", "sliding_attention");
  EXPECT_ERROR(json({{"num_hidden_layers", 2}, {"mlp_layer_types", {"dense", "moe"}}}), "mlp_layer_types[1]",
               "moe");

  json eos = {{"eos_token_id", {154820, 154827}}, {"bos_token_id", 1}, {"pad_token_id", nullptr}};
  const ModelConfig tokens = parse(eos);
  EXPECT_EQ(tokens.eos_token_id, json({154820, 154827}));
  EXPECT_EQ(tokens.bos_token_id, 1);
  EXPECT_FALSE(tokens.pad_token_id.has_value());
  EXPECT_EQ(parse({{"eos_token_id", 7}}).eos_token_id, json(7));
  EXPECT_ERROR(json({{"eos_token_id", "</s>"}}), "eos_token_id");
}

TEST(Config, FormsAreEquivalent) {
  const json text = {{"hidden_size", 1024},
                     {"num_hidden_layers", 8},
                     {"n_routed_experts", 16},
                     {"index_topk_freq", 2},
                     {"linear_attn_config", {{"num_heads", 16}}},
                     {"eos_token_id", {1, 2}}};
  json bare = text;
  bare["model_type"] = "glm5_next_text";
  json flat = text;
  flat["model_type"] = "glm5_next";
  flat["image_token_id"] = 154854;
  flat["vision_config"] = {{"depth", 24}};
  json nested = {{"model_type", "glm5_next"},
                 {"architectures", {"Glm5NextForConditionalGeneration"}},
                 {"text_config", text},
                 {"vision_config", {{"depth", 2}}},
                 {"image_token_id", 1},
                 {"video_token_id", 2},
                 {"image_start_token_id", 3},
                 {"image_end_token_id", 4},
                 {"video_start_token_id", 5},
                 {"video_end_token_id", 6},
                 {"transformers_version", "5.17.0"}};
  nested["text_config"]["model_type"] = "glm5_next_text";
  const ModelConfig reference = parse(text);
  EXPECT_EQ(reference.hidden_size, 1024);
  EXPECT_EQ(reference.linear_num_heads, 16);
  expect_same(parse(bare), reference);
  expect_same(parse(flat), reference);
  expect_same(parse(nested), reference);
  json null_text = flat;
  null_text["text_config"] = nullptr;  // transformers treats a null text_config as the flat form
  expect_same(parse(null_text), reference);

  EXPECT_ERROR(json({{"model_type", "llama"}}), "llama");
  EXPECT_ERROR(json({{"model_type", "glm5_next"}, {"text_config", {{"model_type", "glm5_next"}}}}),
               "text_config.model_type", "glm5_next");
  EXPECT_ERROR(json({{"model_type", "glm5_next"}, {"text_config", 4}}), "text_config", "object");
  // The multimodal fields belong to Glm5NextConfig, not to a bare text config.
  EXPECT_ERROR(json({{"model_type", "glm5_next_text"}, {"image_token_id", 1}}), "image_token_id");
  EXPECT_ERROR(json::array(), "JSON object");
}

TEST(Config, TopLevelTextFieldsMustAgreeWithTextConfig) {
  const json text = {{"hidden_size", 1024}, {"num_hidden_layers", 4}};
  json j = {{"model_type", "glm5_next"}, {"text_config", text}};
  // transformers saves the flat fields it was built from at the top level too: equal values are fine,
  // including ones it normalised ("full_attention") or ignores (head_dim).
  j["hidden_size"] = 1024;
  j["layer_types"] = {"linear_attention", "linear_attention", "linear_attention", "full_attention"};
  j["head_dim"] = 64;
  j["vocab_size"] = 154880;  // equals text_config's default
  EXPECT_EQ(parse(j).hidden_size, 1024);

  j["hidden_size"] = 2048;
  EXPECT_ERROR(j, "hidden_size", "2048", "1024", "contradicts");
  j["hidden_size"] = 1024;
  j["vocab_size"] = 200000;
  EXPECT_ERROR(j, "vocab_size", "200000", "default");
  j.erase("vocab_size");
  j["num_hidden_layers"] = 8;
  EXPECT_ERROR(j, "num_hidden_layers", "contradicts");
  j.erase("num_hidden_layers");
  j["not_a_field"] = 1;
  EXPECT_ERROR(j, "not_a_field", "unknown");
  j.erase("not_a_field");

  // The model ties embeddings by Glm5NextConfig's own tie_word_embeddings; text_config's copy is
  // inert (transformers saves a flat tied config as top-level true, text_config false).
  j["tie_word_embeddings"] = true;
  EXPECT_TRUE(parse(j).tie_word_embeddings);
  j["text_config"]["tie_word_embeddings"] = false;
  EXPECT_TRUE(parse(j).tie_word_embeddings);
  j.erase("tie_word_embeddings");
  j["text_config"]["tie_word_embeddings"] = true;
  testing::internal::CaptureStderr();
  EXPECT_FALSE(parse(j).tie_word_embeddings);
  EXPECT_NE(testing::internal::GetCapturedStderr().find("does not tie"), std::string::npos);
  json flat = {{"model_type", "glm5_next"}, {"tie_word_embeddings", true}};
  EXPECT_TRUE(parse(flat).tie_word_embeddings);
}

TEST(Config, AcceptsWhatTransformersSaves) {
  // Glm5NextConfig.from_dict(flat).to_diff_dict() in transformers 5.17: the flat fields stay at the top
  // level (head_dim unnormalised) beside a full text_config with derived fields.
  const json flat = {{"model_type", "glm5_next"},
                     {"hidden_size", 1024},
                     {"index_topk_pattern", std::string(45, 'F')},
                     {"head_dim", 64},
                     {"tie_word_embeddings", true}};
  json saved = flat;
  saved["text_config"] = model_config_to_json(parse(flat))["text_config"];
  saved["text_config"]["tie_word_embeddings"] = false;
  saved["text_config"]["qk_head_dim"] = 256;
  saved["text_config"]["use_cache"] = true;
  saved["text_config"]["output_router_logits"] = false;
  saved["text_config"]["index_topk_pattern"] = std::string(45, 'F');
  saved["vision_config"] = {{"depth", 24}, {"rope_parameters", {{"rope_type", "axial"}}}};
  saved["image_token_id"] = 154854;
  saved["transformers_version"] = "5.17.0";
  saved["dtype"] = "bfloat16";
  const ModelConfig c = parse(saved);
  expect_same(c, parse(flat));
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.hidden_size, 1024);
}

TEST(Config, ValidationErrorsNameTheField) {
  // validate_architecture.
  EXPECT_ERROR(json({{"num_key_value_heads", 8}}), "num_key_value_heads", "8", "64");
  EXPECT_ERROR(json({{"index_kpool", 0}}), "index_kpool", "0");
  EXPECT_ERROR(json({{"index_topk", 2040}}), "index_topk", "2040", "index_kpool");
  EXPECT_ERROR(json({{"q_lora_rank", nullptr}}), "q_lora_rank");
  EXPECT_ERROR(json({{"qk_rope_head_dim", 64}}), "qk_rope_head_dim", "64");

  // Schedule lengths.
  EXPECT_ERROR(json({{"mlp_layer_types", {"dense", "sparse", "sparse"}}}), "mlp_layer_types", "3 entries",
               "45");
  EXPECT_ERROR(json({{"layer_types", {"linear_attention"}}}), "layer_types", "1 entries", "45");
  EXPECT_ERROR(json({{"indexer_types", {"full", "full"}}}), "indexer_types", "2 entries", "45");

  // Sizes.
  for (const char* field :
       {"vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "n_shared_experts", "kv_lora_rank", "q_lora_rank", "v_head_dim", "qk_nope_head_dim",
        "num_experts_per_tok", "max_position_embeddings", "index_head_dim", "index_n_heads",
        "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "hc_mult", "hc_sinkhorn_iters"}) {
    EXPECT_ERROR(json({{field, 0}}), field);
  }
  EXPECT_ERROR(json({{"num_attention_heads", 0}, {"num_key_value_heads", 0}}), "num_attention_heads");
  EXPECT_ERROR(json({{"index_topk", 0}}), "index_topk");

  // Router groups.
  EXPECT_ERROR(json({{"n_group", 5}}), "n_routed_experts", "n_group", "5");
  EXPECT_ERROR(json({{"n_group", 0}}), "n_group");
  EXPECT_ERROR(json({{"topk_group", 2}}), "topk_group", "n_group");
  EXPECT_ERROR(json({{"num_experts_per_tok", 300}}), "num_experts_per_tok", "n_routed_experts");
  EXPECT_ERROR(json({{"n_routed_experts", 8}, {"n_group", 8}}), "n_group", "2 experts");
  EXPECT_ERROR(json({{"n_group", 8}, {"topk_group", 1}, {"num_experts_per_tok", 40}}), "num_experts_per_tok",
               "topk_group");
  EXPECT_EQ(parse({{"n_group", 8}, {"topk_group", 4}}).n_group, 8);

  // Other values.
  EXPECT_ERROR(json({{"hidden_act", "gelu"}}), "hidden_act", "gelu");
  EXPECT_ERROR(json({{"hc_mult", -1}}), "hc_mult", "-1");
  EXPECT_ERROR(json({{"rms_norm_eps", 0}}), "rms_norm_eps");
  EXPECT_ERROR(json({{"swiglu_limit", -1.0}}), "swiglu_limit");
  EXPECT_ERROR(json({{"attention_dropout", 1.0}}), "attention_dropout");
  EXPECT_ERROR(json({{"vocab_size", 1000}}), "pad_token_id", "154820", "vocab_size");
  EXPECT_EQ(parse({{"vocab_size", 1000}, {"pad_token_id", nullptr}}).vocab_size, 1000);
}

TEST(Config, SharedDsaLayerMustFollowFullDsaLayer) {
  // Layer 3 is DSA and shared, but layer 2 is a KDA layer: nothing hands it a selection.
  json j = {{"num_hidden_layers", 4},
            {"layer_types",
             {"linear_attention", "linear_attention", "linear_attention", "deepseek_sparse_attention"}},
            {"indexer_types", {"full", "full", "full", "shared"}}};
  EXPECT_ERROR(j, "layer 3", "layer 2", "linear_attention");
  // A shared DSA layer 0 has no predecessor.
  j = all_dsa(2);
  j["indexer_types"] = {"shared", "full"};
  EXPECT_ERROR(j, "layer 0");
  // A shared layer passes nothing on, so two shared layers in a row fail at the second.
  j = all_dsa(4);
  j["index_topk_pattern"] = "FSSF";
  EXPECT_ERROR(j, "layer 2", "layer 1", "shared");
  // Shared KDA layers are irrelevant: the indexer exists only in DSA layers.
  j = {{"num_hidden_layers", 4},
       {"layer_types",
        {"deepseek_sparse_attention", "linear_attention", "deepseek_sparse_attention",
         "deepseek_sparse_attention"}},
       {"index_topk_pattern", "FSFS"}};
  const ModelConfig c = parse(j);
  EXPECT_FALSE(c.dsa_shares_previous_selection(1));
  EXPECT_TRUE(c.dsa_shares_previous_selection(3));
  EXPECT_THROW(c.dsa_shares_previous_selection(4), Error);
}

TEST(Config, UnknownAndIgnoredFields) {
  EXPECT_ERROR(json({{"hiden_size", 1}}), "hiden_size", "test.json", "unknown");
  EXPECT_ERROR(json({{"model_type", "glm5_next"}, {"text_config", {{"rope_theta", 1e6}}}}),
               "text_config.rope_theta", "test.json");
  EXPECT_ERROR(json({{"model_type", "glm5_next"}, {"text_config", json::object()}, {"foo", 1}}), "foo");
  EXPECT_ERROR(json({{"quantization_config", {{"quant_method", "fp8"}}}}), "quantization_config",
               "quantized");
  EXPECT_ERROR(json({{"model_type", "glm5_next"}, {"quantization_config", json::object()}}),
               "quantization_config");

  // Generic PreTrainedConfig fields carry no architecture meaning.
  const json generic = {{"architectures", {"Glm5NextForConditionalGeneration"}},
                        {"transformers_version", "5.17.0"},
                        {"dtype", "bfloat16"},
                        {"torch_dtype", "bfloat16"},
                        {"_name_or_path", "zai-org/GLM-5.3-Flash"},
                        {"use_cache", true},
                        {"output_router_logits", false},
                        {"output_hidden_states", false},
                        {"output_attentions", false},
                        {"return_dict", true},
                        {"is_encoder_decoder", false},
                        {"chunk_size_feed_forward", 0},
                        {"id2label", {{"0", "LABEL_0"}}},
                        {"label2id", {{"LABEL_0", 0}}},
                        {"problem_type", nullptr},
                        {"tokenizer_class", nullptr},
                        {"prefix", nullptr},
                        {"sep_token_id", nullptr},
                        {"decoder_start_token_id", nullptr},
                        {"task_specific_params", nullptr},
                        {"finetuning_task", nullptr},
                        {"tie_encoder_decoder", false},
                        {"auto_map", json::object()},
                        {"keys_to_ignore_at_inference", {"past_key_values"}},
                        {"num_nextn_predict_layers", 1}};
  expect_same(parse(generic), parse(json::object()));
  json nested = generic;
  nested["model_type"] = "glm5_next";
  nested["text_config"] = generic;
  expect_same(parse(nested), parse(json::object()));
}

TEST(Config, StrictTypes) {
  EXPECT_ERROR(json({{"hidden_size", 4096.0}}), "hidden_size", "integer", "4096.0");
  EXPECT_ERROR(json({{"hidden_size", "4096"}}), "hidden_size", "integer", "\"4096\"");
  EXPECT_ERROR(json({{"hidden_size", true}}), "hidden_size", "integer", "boolean");
  EXPECT_ERROR(json({{"hidden_size", nullptr}}), "hidden_size", "integer", "null");
  EXPECT_ERROR(json({{"norm_topk_prob", 1}}), "norm_topk_prob", "boolean");
  EXPECT_ERROR(json({{"rms_norm_eps", "1e-5"}}), "rms_norm_eps", "number");
  EXPECT_ERROR(json({{"hidden_act", 1}}), "hidden_act", "string");
  EXPECT_ERROR(json({{"pad_token_id", 1.0}}), "pad_token_id", "integer");
  EXPECT_ERROR(json({{"index_topk_freq", "2"}}), "index_topk_freq");
  EXPECT_ERROR(json({{"layer_types", "linear_attention"}}), "layer_types", "list");
  EXPECT_ERROR(json({{"model_type", "glm5_next"}, {"text_config", {{"hidden_size", 1.5}}}}),
               "text_config.hidden_size", "1.5");
  EXPECT_ERROR(json({{"vocab_size", 18446744073709551615ull}}), "vocab_size");
  // Floats accept integers; optional fields accept null.
  EXPECT_EQ(parse({{"routed_scaling_factor", 3}}).routed_scaling_factor, 3.0);
  EXPECT_FALSE(parse({{"bos_token_id", nullptr}}).bos_token_id.has_value());
}

ModelConfig unusual_config() {
  json j = {{"vocab_size", 1000},
            {"hidden_size", 64},
            {"intermediate_size", 96},
            {"moe_intermediate_size", 32},
            {"num_hidden_layers", 6},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 4},
            {"n_shared_experts", 2},
            {"n_routed_experts", 8},
            {"routed_scaling_factor", 1.75},
            {"kv_lora_rank", 32},
            {"q_lora_rank", 48},
            {"v_head_dim", 16},
            {"qk_nope_head_dim", 24},
            {"n_group", 2},
            {"topk_group", 1},
            {"num_experts_per_tok", 3},
            {"norm_topk_prob", false},
            {"max_position_embeddings", 4096},
            {"initializer_range", 0.1},
            {"rms_norm_eps", 1e-6},
            {"pad_token_id", nullptr},
            {"bos_token_id", 3},
            {"eos_token_id", {5, 6}},
            {"tie_word_embeddings", true},
            {"attention_bias", true},
            {"attention_dropout", 0.1},
            {"index_topk", 64},
            {"index_head_dim", 16},
            {"index_n_heads", 2},
            {"swiglu_limit", 7.0},
            {"linear_head_dim", 8},
            {"linear_num_heads", 4},
            {"linear_conv_kernel_dim", 3},
            {"linear_lower_bound", nullptr},
            {"hc_mult", 2},
            {"hc_eps", 1e-7},
            {"hc_sinkhorn_iters", 5},
            {"router_aux_loss_coef", 0.0123456789},
            {"index_kpool", 8},
            {"index_kpool_always_select_tail", false},
            {"mlp_layer_types", {"dense", "sparse", "dense", "sparse", "sparse", "sparse"}},
            {"layer_types",
             {"linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
              "linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention"}},
            {"index_topk_pattern", "FFSSFS"}};
  return parse(j);
}

TEST(Config, RoundTripThroughTransformersForm) {
  for (const ModelConfig& original : {unusual_config(), parse(json::object())}) {
    const json out = model_config_to_json(original);
    EXPECT_EQ(out["architectures"], json::array({"Glm5NextForConditionalGeneration"}));
    EXPECT_EQ(out["model_type"], "glm5_next");
    EXPECT_EQ(out["tie_word_embeddings"], original.tie_word_embeddings);
    EXPECT_EQ(out["text_config"]["model_type"], "glm5_next_text");
    EXPECT_EQ(out["text_config"]["head_dim"], 0);
    EXPECT_EQ(out["text_config"]["layer_types"].size(), static_cast<size_t>(original.num_hidden_layers));
    EXPECT_EQ(out["vision_config"]["out_hidden_size"], original.hidden_size);
    EXPECT_EQ(out["vision_config"]["model_type"], "glm5_next_vision");
    const ModelConfig back = parse_model_config(json::parse(out.dump()), "roundtrip.json");
    expect_same(back, original);
    EXPECT_EQ(model_config_to_json(back), out);
  }
  const json out = model_config_to_json(unusual_config());
  EXPECT_EQ(out["text_config"]["indexer_types"],
            json({"full", "full", "shared", "shared", "full", "shared"}));
  EXPECT_TRUE(out["text_config"]["linear_lower_bound"].is_null());
  EXPECT_TRUE(out["text_config"]["pad_token_id"].is_null());
  EXPECT_EQ(out["text_config"]["mlp_layer_types"][1], "sparse");
}

TEST(Config, LoadsFileOrDirectory) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "spindle_test_config";
  std::filesystem::create_directories(dir);
  const std::filesystem::path file = dir / "config.json";
  std::ofstream(file) << model_config_to_json(unusual_config()).dump(2);
  const ModelConfig from_dir = load_model_config(dir.string());
  EXPECT_EQ(from_dir.source, file.string());
  expect_same(from_dir, unusual_config());
  expect_same(load_model_config(file.string()), unusual_config());

  std::ofstream(file) << "{\"hidden_size\": 12,\n  oops}";
  try {
    load_model_config(dir.string());
    ADD_FAILURE() << "invalid JSON parsed";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find(file.string()), std::string::npos) << message;
    EXPECT_NE(message.find("line 2"), std::string::npos) << message;
  }
  std::ofstream(file) << "{\"hidden_size\": 12.5}";
  try {
    load_model_config(file.string());
    ADD_FAILURE() << "bad type parsed";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(file.string() + ": hidden_size"), std::string::npos)
        << error.what();
  }
  std::filesystem::remove_all(dir);
  try {
    load_model_config(dir.string());
    ADD_FAILURE() << "missing file loaded";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("spindle_test_config"), std::string::npos) << error.what();
  }
}

TEST(Config, KindNames) {
  EXPECT_STREQ(attention_kind_name(AttentionKind::Kda), "linear_attention");
  EXPECT_STREQ(attention_kind_name(AttentionKind::Dsa), "deepseek_sparse_attention");
  EXPECT_STREQ(mlp_kind_name(MlpKind::Dense), "dense");
  EXPECT_STREQ(mlp_kind_name(MlpKind::Sparse), "sparse");
  EXPECT_STREQ(indexer_kind_name(IndexerKind::Full), "full");
  EXPECT_STREQ(indexer_kind_name(IndexerKind::Shared), "shared");
}

}  // namespace
}  // namespace spindle
