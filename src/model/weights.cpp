#include "model/weights.h"

namespace spindle {

namespace {

constexpr WeightPrecision kFp32 = WeightPrecision::Fp32;

// Consecutive blocks of rows of a stacked [rows, width] weight, as views.
class StackedRows {
 public:
  explicit StackedRows(const Tensor& stacked) : stacked_(stacked), width_(stacked.dim(1)) {}
  Tensor next(int64_t rows) {
    const Tensor t = stacked_.block(row_ * width_, {rows, width_});
    row_ += rows;
    return t;
  }

 private:
  Tensor stacked_;
  int64_t width_, row_ = 0;
};

HyperConnectionWeights make_hc(const ModelConfig& c, const WeightFactory& make_tensor) {
  const int64_t mix = (2 + c.hc_mult) * c.hc_mult;
  return {make_tensor({mix, c.hc_mult * c.hidden_size}, kFp32), make_tensor({mix}, kFp32),
          make_tensor({3}, kFp32)};
}

MlpWeights make_mlp(int64_t hidden, int64_t intermediate, const WeightFactory& make_tensor) {
  const auto make = [&](const Shape& shape) { return make_tensor(shape, WeightPrecision::Compute); };
  MlpWeights m;
  m.gate_up = make({2 * intermediate, hidden});
  StackedRows rows(m.gate_up);
  m.gate_proj = rows.next(intermediate);
  m.up_proj = rows.next(intermediate);
  m.down_proj = make({hidden, intermediate});
  return m;
}

}  // namespace

ModelWeights allocate_weights(const ModelConfig& c, DType dtype, bool shapes_only) {
  return build_weights(c, dtype, [&](const Shape& shape, WeightPrecision) {
    return shapes_only ? Tensor::meta(shape, dtype) : Tensor::empty(shape, dtype, MemoryCategory::Weights);
  });
}

ModelWeights build_weights(const ModelConfig& c, DType dtype, const WeightFactory& make_tensor) {
  const auto make = [&](const Shape& shape) { return make_tensor(shape, WeightPrecision::Compute); };
  ModelWeights w;
  w.dtype = dtype;
  const int64_t D = c.hidden_size;
  w.embed_tokens = make({c.vocab_size, D});
  w.norm = make({D});
  w.lm_head = c.tie_word_embeddings ? w.embed_tokens : make({c.vocab_size, D});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    LayerWeights l;
    l.attention = c.layer_types[static_cast<size_t>(i)];
    l.mlp = c.mlp_layer_types[static_cast<size_t>(i)];
    l.attn_hc = make_hc(c, make_tensor);
    l.ffn_hc = make_hc(c, make_tensor);
    l.input_layernorm = make({D});
    l.post_attention_layernorm = make({D});
    if (l.attention == AttentionKind::Kda) {
      const int64_t qkv = c.linear_qkv_dim(), hd = c.linear_head_dim, K = c.linear_conv_kernel_dim;
      KdaWeights& k = l.kda;
      k.in_proj = make({3 * qkv + 2 * hd + c.linear_num_heads, D});
      StackedRows rows(k.in_proj);
      k.q_proj = rows.next(qkv);
      k.k_proj = rows.next(qkv);
      k.v_proj = rows.next(qkv);
      k.g_a_proj = rows.next(hd);
      k.f_a_proj = rows.next(hd);
      k.b_proj = rows.next(c.linear_num_heads);
      k.q_conv = make_tensor({qkv, 1, K}, kFp32);
      k.k_conv = make_tensor({qkv, 1, K}, kFp32);
      k.v_conv = make_tensor({qkv, 1, K}, kFp32);
      k.f_b_proj = make({qkv, hd});
      k.dt_bias = make_tensor({qkv}, kFp32);
      k.A_log = make_tensor({c.linear_num_heads}, kFp32);
      k.g_b_proj = make({qkv, hd});
      k.o_norm = make({hd});
      k.o_proj = make({D, qkv});
    } else {
      DsaWeights& a = l.dsa;
      const int64_t H = c.num_attention_heads;
      const int64_t id = c.index_head_dim, kv_rows = c.kv_lora_rank + c.qk_rope_head_dim;
      a.has_indexer = c.indexer_types[static_cast<size_t>(i)] == IndexerKind::Full;
      a.x_proj = make({c.q_lora_rank + kv_rows + (a.has_indexer ? 2 * id : 0), D});
      StackedRows rows(a.x_proj);
      a.q_a_proj = rows.next(c.q_lora_rank);
      a.q_a_layernorm = make({c.q_lora_rank});
      a.q_b_proj = make({H * c.qk_head_dim(), c.q_lora_rank});
      a.kv_a_proj = rows.next(kv_rows);
      a.kv_a_layernorm = make({c.kv_lora_rank});
      a.kv_b_proj = make({H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
      a.o_proj = make({D, H * c.v_head_dim});
      if (a.has_indexer) {
        IndexerWeights& x = a.indexer;
        x.wq_b = make({c.index_n_heads * id, c.q_lora_rank});
        x.wk = rows.next(id);
        x.k_norm_weight = make({id});
        x.k_norm_bias = make({id});
        x.weights_proj = make({c.index_n_heads, D});
        x.compress_ape = make({c.index_kpool, id});
        x.compress_gate = rows.next(id);
      }
    }
    if (l.mlp == MlpKind::Dense) {
      l.dense = make_mlp(D, c.intermediate_size, make_tensor);
    } else {
      MoeWeights& m = l.moe;
      const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size;
      m.router = make({E, D});
      m.correction_bias = make_tensor({E}, kFp32);
      m.experts_gate_up = make({E, 2 * I, D});
      m.experts_down = make({E, D, I});
      m.shared = make_mlp(D, I * c.n_shared_experts, make_tensor);
    }
    w.layers.push_back(std::move(l));
  }
  return w;
}

std::vector<Param> parameter_table(const ModelConfig& c, ModelWeights& w) {
  std::vector<Param> table;
  const std::string text = kTextPrefix;
  auto add = [&](const std::string& name, const Tensor& t, ParamRole role) {
    table.push_back({name, t, role});
  };
  auto add_mlp = [&](const std::string& p, const MlpWeights& m) {
    add(p + "gate_proj.weight", m.gate_proj, ParamRole::Matrix);
    add(p + "up_proj.weight", m.up_proj, ParamRole::Matrix);
    add(p + "down_proj.weight", m.down_proj, ParamRole::Matrix);
  };
  auto add_hc = [&](const std::string& p, const HyperConnectionWeights& h) {
    add(p + "_fn", h.fn, ParamRole::HcFn);
    add(p + "_base", h.base, ParamRole::HcBase);
    add(p + "_scale", h.scale, ParamRole::HcScale);
  };

  add(text + "embed_tokens.weight", w.embed_tokens, ParamRole::Embedding);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = text + "layers." + std::to_string(i) + ".";
    add_hc(p + "hc_attn", l.attn_hc);
    add_hc(p + "hc_ffn", l.ffn_hc);
    add(p + "input_layernorm.weight", l.input_layernorm, ParamRole::Norm);
    add(p + "post_attention_layernorm.weight", l.post_attention_layernorm, ParamRole::Norm);
    const std::string a = p + "self_attn.";
    if (l.attention == AttentionKind::Kda) {
      const KdaWeights& k = l.kda;
      add(a + "q_proj.weight", k.q_proj, ParamRole::Matrix);
      add(a + "k_proj.weight", k.k_proj, ParamRole::Matrix);
      add(a + "v_proj.weight", k.v_proj, ParamRole::Matrix);
      add(a + "q_conv1d.weight", k.q_conv, ParamRole::Matrix);
      add(a + "k_conv1d.weight", k.k_conv, ParamRole::Matrix);
      add(a + "v_conv1d.weight", k.v_conv, ParamRole::Matrix);
      add(a + "f_a_proj.weight", k.f_a_proj, ParamRole::Matrix);
      add(a + "f_b_proj.weight", k.f_b_proj, ParamRole::Matrix);
      add(a + "dt_bias", k.dt_bias, ParamRole::DtBias);
      add(a + "A_log", k.A_log, ParamRole::ALog);
      add(a + "b_proj.weight", k.b_proj, ParamRole::Matrix);
      add(a + "g_a_proj.weight", k.g_a_proj, ParamRole::Matrix);
      add(a + "g_b_proj.weight", k.g_b_proj, ParamRole::Matrix);
      add(a + "o_norm.weight", k.o_norm, ParamRole::Norm);
      add(a + "o_proj.weight", k.o_proj, ParamRole::Matrix);
    } else {
      const DsaWeights& d = l.dsa;
      add(a + "q_a_proj.weight", d.q_a_proj, ParamRole::Matrix);
      add(a + "q_a_layernorm.weight", d.q_a_layernorm, ParamRole::Norm);
      add(a + "q_b_proj.weight", d.q_b_proj, ParamRole::Matrix);
      add(a + "kv_a_proj_with_mqa.weight", d.kv_a_proj, ParamRole::Matrix);
      add(a + "kv_a_layernorm.weight", d.kv_a_layernorm, ParamRole::Norm);
      add(a + "kv_b_proj.weight", d.kv_b_proj, ParamRole::Matrix);
      add(a + "o_proj.weight", d.o_proj, ParamRole::Matrix);
      if (d.has_indexer) {
        const IndexerWeights& x = d.indexer;
        const std::string n = a + "indexer.";
        add(n + "wq_b.weight", x.wq_b, ParamRole::Matrix);
        add(n + "wk.weight", x.wk, ParamRole::Matrix);
        add(n + "k_norm.weight", x.k_norm_weight, ParamRole::Norm);
        add(n + "k_norm.bias", x.k_norm_bias, ParamRole::NormBias);
        add(n + "weights_proj.weight", x.weights_proj, ParamRole::Matrix);
        add(n + "index_kpool_compress_ape", x.compress_ape, ParamRole::CompressApe);
        add(n + "index_kpool_compress_gate", x.compress_gate, ParamRole::CompressGate);
      }
    }
    if (l.mlp == MlpKind::Dense) {
      add_mlp(p + "mlp.", l.dense);
    } else {
      const MoeWeights& m = l.moe;
      add(p + "mlp.gate.weight", m.router, ParamRole::Matrix);
      add(p + "mlp.gate.e_score_correction_bias", m.correction_bias, ParamRole::RouterBias);
      for (int64_t e = 0; e < c.n_routed_experts; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        const Tensor gate_up = m.experts_gate_up.select(e);
        const int64_t I = c.moe_intermediate_size, D = c.hidden_size;
        add(x + "gate_proj.weight", gate_up.block(0, {I, D}), ParamRole::Matrix);
        add(x + "up_proj.weight", gate_up.block(I * D, {I, D}), ParamRole::Matrix);
        add(x + "down_proj.weight", m.experts_down.select(e), ParamRole::Matrix);
      }
      add_mlp(p + "mlp.shared_experts.", m.shared);
    }
  }
  add(text + "norm.weight", w.norm, ParamRole::Norm);
  if (!c.tie_word_embeddings) add("lm_head.weight", w.lm_head, ParamRole::Matrix);
  return table;
}

}  // namespace spindle
