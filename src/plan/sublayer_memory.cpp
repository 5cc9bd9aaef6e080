#include "plan/sublayer_memory.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace spindle::plan {

namespace {

constexpr int64_t kKdaChunk = 64;                   // kernels/cuda/kda.h kKdaChunk
constexpr int64_t kKdaSegmentChunks = 256;          // kernels/cuda/kda.h kKdaSegmentChunks
constexpr int64_t kKdaBackwardSegmentChunks = 128;  // kernels/cuda/kda.h
constexpr int64_t kPermutationTile = 2048;          // kernels/cuda/moe_ops.cu kTile
constexpr int64_t kKdaMaxDim = 128;                 // kernels/cuda/kda.h: the blocks' strides
constexpr int64_t kKdaForwardBlockFloats = kKdaChunk * kKdaChunk + 3 * kKdaChunk * kKdaMaxDim + kKdaMaxDim;
constexpr int64_t kKdaBackwardOpsFloats = 2 * kKdaChunk * kKdaMaxDim + kKdaMaxDim;
// kernels/cuda/kda.h: A, Aq and Tinv packed by their lower triangles; kept, u after them
constexpr int64_t kKdaMatrixFloats = kKdaChunk * (kKdaChunk - 1) + kKdaChunk * (kKdaChunk + 1) / 2;
constexpr int64_t kKdaKeptFloats = kKdaMatrixFloats + kKdaChunk * kKdaMaxDim;
constexpr int64_t kSelectWorkspaceBytes = int64_t{1} << 30;  // model/cuda/dsa.cpp: the indexer's score tile
constexpr int64_t kIndexerTilePools = 64;  // kernels/cuda/indexer.h: pools per tile of the scores' maxima

using Blocks = std::vector<Ledger::Block>;

Ledger::Block bf16(Ledger& m, int64_t n) { return m.activations(2 * n); }
Ledger::Block f32(Ledger& m, int64_t n) { return m.activations(4 * n); }
Ledger::Block i32(Ledger& m, int64_t n) { return m.activations(4 * n); }

// The KDA input projections side by side (q, k, v and the two low-rank), the conv's carried rows
// on top: their rows and width.
int64_t kda_projected_rows(const Shapes& s, int64_t L) { return s.conv_kernel - 1 + L; }
int64_t kda_projected_width(const Shapes& s) { return 3 * s.kda_width() + 2 * s.kda_dim; }

int64_t kda_chunk_state_floats(const Shapes& s, int64_t L) {
  return ((L + kKdaChunk - 1) / kKdaChunk + 1) * s.kda_heads * s.kda_dim * s.kda_dim;
}

// KdaActivations of model/cuda/kda.cpp: the projections side by side (q, k, v and the two
// low-rank, the conv's carried rows on top), five bf16 [L, heads * dim] (v's conv, normalised q/k,
// gate, core), fp32 f and g, fp32 beta, the fp32 chunk states; with `kept`, the recurrence's (core,
// chunk states) are the forward's, with `projections_kept` the projections too.
Blocks kda_activations(Ledger& m, const Shapes& s, int64_t L, bool kept, bool projections_kept = false) {
  const int64_t w = s.kda_width(), H = s.kda_heads;
  Blocks a;
  if (!projections_kept) a.push_back(bf16(m, kda_projected_rows(s, L) * kda_projected_width(s)));
  for (int i = 0; i < (kept ? 4 : 5); ++i) a.push_back(bf16(m, L * w));
  a.push_back(f32(m, L * w));
  a.push_back(f32(m, L * w));
  a.push_back(f32(m, L * H));
  if (kept) return a;
  a.push_back(f32(m, kda_chunk_state_floats(s, L)));
  // The forward's per chunk-head blocks (Aq, W, Kb, u, G_last), a segment of at most 256 chunks
  // (kda_forward_workspace_floats).
  const int64_t segment = std::min<int64_t>((L + kKdaChunk - 1) / kKdaChunk, kKdaSegmentChunks);
  const Ledger::Block blocks = m.workspace(4 * segment * H * kKdaForwardBlockFloats);
  return a;
}

void kda_backward(Ledger& m, const Shapes& s, int64_t L, bool kept, bool matrices_kept,
                  bool projections_kept) {
  const int64_t w = s.kda_width(), dh = s.kda_dim, H = s.kda_heads;
  Blocks a = kda_activations(m, s, L, kept, projections_kept);
  for (int i = 0; i < 4; ++i) a.push_back(bf16(m, L * w));  // z, dz, dcore, dgate
  Ledger::Block dq = bf16(m, L * w), dk = bf16(m, L * w), dg = f32(m, L * w);
  a.push_back(f32(m, L * H));                               // dbeta
  Ledger::Block dv = bf16(m, (s.conv_kernel - 1 + L) * w);  // over v's conv window
  {  // the chunk-parallel backward's workspace (kda_backward_workspace_floats): its matrices, or Kb dS'
     // where they are kept
    const int64_t segment = std::min<int64_t>((L + kKdaChunk - 1) / kKdaChunk, kKdaBackwardSegmentChunks);
    const Ledger::Block workspace = m.workspace(
        4 *
        (segment * H * ((matrices_kept ? kKdaChunk * kKdaMaxDim : kKdaMatrixFloats) + kKdaBackwardOpsFloats) +
         (segment + 2) * H * dh * dh));
  }
  // The gradients into dx side by side: the q, k, v windows', the gate's and f's low-rank, db.
  const int64_t rows = s.conv_kernel - 1 + L, stacked_width = 3 * w + 2 * dh + H;
  a.push_back(bf16(m, rows * stacked_width));
  a.push_back(bf16(m, L * H));  // db
  a.push_back(bf16(m, L * w));  // df
  dg = {};                      // after the decay's backward
  dq = {};                      // q's and k's gradients after their conv inputs'
  dk = {};
  dv = {};  // after v's conv
}

// MlaActivations of model/cuda/dsa.cpp (mla_projections); with `indexer`, x's product has the
// indexer's raw keys and gates too; with `kept`, the attention's output and log-sum-exp are the
// forward's.
Blocks mla_projections(Ledger& m, const Shapes& s, const Pass& p, bool indexer, bool kept) {
  const int64_t L = p.tokens, H = s.mla_heads;
  Blocks a;
  a.push_back(bf16(m, L * (s.q_rank + s.kv_rank + (indexer ? 2 * s.index_dim : 0))));  // low
  a.push_back(bf16(m, L * s.q_rank));                                                  // q_resid
  a.push_back(bf16(m, L * H * s.qk_dim));
  a.push_back(bf16(m, L * s.kv_rank));    // kv_normed
  a.push_back(bf16(m, L * H * s.v_dim));  // attended
  if (p.streamed || p.absorbed) {
    a.push_back(bf16(m, L * H * s.kv_rank));  // q_lat
    if (!kept) {
      a.push_back(bf16(m, L * H * s.kv_rank));  // o_lat
      a.push_back(f32(m, L * H));               // lse (sparse MLA on the tensor cores)
    }
    if (!p.streamed) a.push_back(bf16(m, L * s.kv_rank));  // the cache: the latent once (tensor cores)
  } else {
    a.push_back(bf16(m, L * H * (s.qk_dim + s.v_dim)));  // expanded keys and values
  }
  return a;
}

// What the wgmma sparse MLA kernels allocate for a call: the pairs' lists (kernels/cuda/
// sparse_mla_pairs.h), where the forward (sparse_mla_hopper.h) or the backward
// (sparse_mla_backward_hopper.h: a latent of 512 alone) takes the absorbed attention's shape.
int64_t pair_list_bytes(const Shapes& s, const Pass& p, bool backward) {
  const int64_t dk = s.kv_rank + s.rope_dim;
  const bool takes =
      backward ? dk == 512 && s.kv_rank == 512 : dk % 64 == 0 && s.kv_rank % 64 == 0 && dk <= 512;
  if (!(p.streamed || p.absorbed) || !takes) return 0;
  return (p.tokens + 1) / 2 * (2 * s.width + 2) * 4;
}

int64_t complete_pools(const Shapes& s, const Pass& p) { return p.context / s.kpool; }

// IndexerActivations: queries, raw/normalised keys, pool gate, pooled keys (a chunk reads the
// cache's), head weights.
Blocks indexer_activations(Ledger& m, const Shapes& s, const Pass& p) {
  const int64_t L = p.tokens, d = s.index_dim;
  Blocks a;
  a.push_back(bf16(m, L * s.index_heads * d));
  for (int i = 0; i < 3; ++i) a.push_back(bf16(m, L * d));
  if (!p.streamed) a.push_back(bf16(m, std::max<int64_t>(1, complete_pools(s, p) * d)));
  a.push_back(bf16(m, L * s.index_heads));
  return a;
}

// run_indexer: the indexer's inputs, the score tile for a block of queries (at most 1 GiB, at
// least one row) and its tile maxima (1/64 of it), then the selection, which outlives the call.
Ledger::Block run_indexer(Ledger& m, const Shapes& s, const Pass& p) {
  Blocks a = indexer_activations(m, s, p);
  const int64_t pools = complete_pools(s, p), tiles = (pools + kIndexerTilePools - 1) / kIndexerTilePools;
  const int64_t block =
      std::max<int64_t>(1, std::min(p.tokens, kSelectWorkspaceBytes / std::max<int64_t>(1, pools * 4)));
  Ledger::Block tile = m.workspace(block * (pools + tiles) * 4);
  return m.activations(selection_bytes(s, p.tokens));
}

// train_indexer: the indexer's inputs again and the KL's gradients.
void train_indexer(Ledger& m, const Shapes& s, const Pass& p) {
  const int64_t L = p.tokens, d = s.index_dim;
  Blocks a = indexer_activations(m, s, p);
  a.push_back(bf16(m, L * s.index_heads * d));                                           // dq
  a.push_back(bf16(m, L * s.index_heads));                                               // dhw
  if (!p.streamed) a.push_back(f32(m, std::max<int64_t>(1, complete_pools(s, p) * d)));  // dpool
  a.push_back(bf16(m, L * d));                                                           // dgate
  a.push_back(bf16(m, L * d));                                                           // draw
}

void attention_gradients(Ledger& m, const Shapes& s, const Pass& p) {
  const int64_t L = p.tokens, H = s.mla_heads;
  Blocks a;
  if (!p.streamed) {
    // The cache's fp32 gradient (the latent's absorbed, expanded keys and values otherwise); a
    // chunk adds into its cache's.
    a.push_back(f32(m, p.absorbed ? L * s.kv_rank : L * H * (s.qk_dim + s.v_dim)));
  }
  if (p.streamed || p.absorbed) {
    a.push_back(bf16(m, L * H * s.kv_rank));  // d_o_lat
    a.push_back(bf16(m, L * H * s.kv_rank));  // dq_lat
  }
  const Ledger::Block lists = m.workspace(pair_list_bytes(s, p, true));  // for the attention's backward
}

void dsa_backward(Ledger& m, const Shapes& s, const LayerShape& layer, const Pass& p, bool kept) {
  const int64_t L = p.tokens, H = s.mla_heads;
  const bool kl = p.indexer_kl && layer.own_indexer;
  Blocks a = mla_projections(m, s, p, kl && !p.streamed, kept);  // the one-chunk pass appends the index keys
  if (!kept) {  // the attention runs again: its union lists for the call
    const Ledger::Block unions = m.workspace(pair_list_bytes(s, p, false));
  }
  a.push_back(bf16(m, L * H * s.v_dim));   // d_attended
  a.push_back(bf16(m, L * H * s.qk_dim));  // dq
  Ledger::Block d_normed = bf16(m, L * s.kv_rank);
  {
    // The attention mass, summed by the attention's backward, then the indexer's KL on it.
    Blocks mass;
    if (kl) mass.push_back(f32(m, L * s.width));
    attention_gradients(m, s, p);
    if (kl) train_indexer(m, s, p);
  }
  a.push_back(bf16(m, L * (s.q_rank + s.kv_rank)));  // d_low: the gradients into x's low-rank projections
  d_normed = {};
  a.push_back(bf16(m, L * s.q_rank));  // d_resid
}

// `keep_gate_up`: takes the [gate | up] product.
void mlp_forward(Ledger& m, int64_t L, int64_t inter, Ledger::Block* keep_gate_up = nullptr) {
  Ledger::Block gate_up = bf16(m, L * 2 * inter), hidden = bf16(m, L * inter);
  if (keep_gate_up != nullptr) *keep_gate_up = std::move(gate_up);
}

// `gate_up_kept`: the forward's product is taken (freed here), not made again.
void mlp_backward(Ledger& m, int64_t L, int64_t inter, Ledger::Block gate_up_kept = {}) {
  Ledger::Block gate_up = gate_up_kept.bytes() > 0 ? std::move(gate_up_kept) : bf16(m, L * 2 * inter),
                hidden = bf16(m, L * inter);
}

// Routing (model/cuda/moe.cpp route), what a kept routing holds (MoeRouting): router logits,
// weights, choices, the permutation and its inverse over every (token, choice) assignment.
Blocks routing(Ledger& m, const Shapes& s, int64_t L) {
  const int64_t all = L * s.topk;
  Blocks r;
  r.push_back(f32(m, L * s.experts));  // logits
  r.push_back(f32(m, all));            // weight
  r.push_back(i32(m, all));            // expert
  r.push_back(i32(m, all));            // permutation
  r.push_back(i32(m, all));            // inverse
  return r;
}

// The rest of route: the gathered rows of this GPU's experts (the offsets go to pinned host memory).
void expert_rows(Ledger& m, const Shapes& s, int64_t L, Blocks& r) {
  r.push_back(bf16(m, routed_rows(s, L) * s.hidden));
}

// The experts' gate and up (the halves of one [rows, 2 inter] block), hidden and outputs, and the
// shared expert's output, all before the experts' side streams fork; then the shared expert on the
// main stream while the host waits for the routed rows' offsets. `keep`: takes the routing, and
// with `products` the routed and shared [gate | up] products after it.
void moe_forward(Ledger& m, const Shapes& s, int64_t L, Blocks* keep, bool products) {
  const int64_t rows = routed_rows(s, L);
  Blocks kept = routing(m, s, L), r, a;
  expert_rows(m, s, L, r);
  Ledger::Block gate_up = bf16(m, rows * 2 * s.moe_inter), shared_gate_up;
  a.push_back(bf16(m, rows * s.moe_inter));  // hidden
  a.push_back(bf16(m, rows * s.hidden));     // out
  a.push_back(bf16(m, L * s.hidden));        // shared
  const bool keep_products = keep != nullptr && products;
  mlp_forward(m, L, s.shared_inter, keep_products ? &shared_gate_up : nullptr);
  if (keep == nullptr) return;
  *keep = std::move(kept);
  if (!keep_products) return;
  keep->push_back(std::move(gate_up));
  keep->push_back(std::move(shared_gate_up));
}

// The experts' gate and up and hidden again (not their output), dy gathered to the sorted rows and
// the hidden's gradient, then the shared expert's backward while the host waits for the offsets.
// With the forward's routing `kept`, only the rows are gathered again; with `products`, its last
// two blocks are the routed and shared [gate | up] products, taken instead of made again.
void moe_backward(Ledger& m, const Shapes& s, int64_t L, Blocks kept, bool products) {
  const int64_t rows = routed_rows(s, L);
  const bool taken = !kept.empty();
  Ledger::Block gate_up, shared_gate_up;
  if (taken && products) {
    shared_gate_up = std::move(kept.back());
    kept.pop_back();
    gate_up = std::move(kept.back());
    kept.pop_back();
  }
  Blocks r = taken ? std::move(kept) : routing(m, s, L), a;
  if (taken)
    r.push_back(bf16(m, rows * s.hidden));  // the rows gathered again
  else
    expert_rows(m, s, L, r);
  a.push_back(gate_up.bytes() > 0 ? std::move(gate_up) : bf16(m, rows * 2 * s.moe_inter));
  a.push_back(bf16(m, rows * s.moe_inter));  // hidden
  a.push_back(bf16(m, rows * s.hidden));     // dy_rows
  a.push_back(bf16(m, rows * s.moe_inter));  // dhidden
  a.push_back(f32(m, L * s.topk));           // dweight
  mlp_backward(m, L, s.shared_inter, std::move(shared_gate_up));
  a.push_back(f32(m, L * s.experts));   // dlogits
  a.push_back(bf16(m, L * s.experts));  // dlogits16
}

}  // namespace

int64_t selection_bytes(const Shapes& s, int64_t tokens) { return tokens * s.width * 4; }

std::vector<bool> kda_layers_keeping_projections(const Shapes& s, int64_t kept) {
  std::vector<AttentionKind> kinds;
  for (const LayerShape& layer : s.layers) kinds.push_back(layer.attention);
  return last_layers_of_kind(kinds, AttentionKind::Kda, kept);
}

Ledger::Block attention_forward(Ledger& m, const Shapes& s, const LayerShape& layer, const Pass& pass,
                                bool select) {
  if (layer.attention == AttentionKind::Kda) {
    Blocks a = kda_activations(m, s, pass.tokens, false);
    return {};
  }
  const bool indexer = select && layer.own_indexer;
  Blocks a = mla_projections(m, s, pass, indexer, false);
  Ledger::Block selection = indexer ? run_indexer(m, s, pass) : Ledger::Block{};
  const Ledger::Block unions = m.workspace(pair_list_bytes(s, pass, false));  // for the attention's call
  return selection;
}

std::vector<Ledger::Block> attention_kept(Ledger& m, const Shapes& s, const LayerShape& layer,
                                          const Pass& pass, bool projections) {
  const int64_t L = pass.tokens;
  Blocks kept;
  if (layer.attention == AttentionKind::Kda) {
    kept.push_back(bf16(m, L * s.kda_width()));
    kept.push_back(f32(m, kda_chunk_state_floats(s, L)));
    if (pass.keep_kda_matrices)
      kept.push_back(f32(m, (L + kKdaChunk - 1) / kKdaChunk * s.kda_heads * kKdaKeptFloats));
    if (projections) kept.push_back(bf16(m, kda_projected_rows(s, L) * kda_projected_width(s)));
  } else {
    kept.push_back(bf16(m, L * s.mla_heads * s.kv_rank));
    kept.push_back(f32(m, L * s.mla_heads));
  }
  return kept;
}

void attention_backward(Ledger& m, const Shapes& s, const LayerShape& layer, const Pass& pass, bool kept,
                        bool projections) {
  if (layer.attention == AttentionKind::Kda)
    kda_backward(m, s, pass.tokens, kept, kept && pass.keep_kda_matrices, kept && projections);
  else
    dsa_backward(m, s, layer, pass, kept);
}

void ffn_forward(Ledger& m, const Shapes& s, const LayerShape& layer, const Pass& pass,
                 Blocks* keep_routing) {
  if (layer.mlp == MlpKind::Dense)
    mlp_forward(m, pass.tokens, s.dense_inter);
  else
    moe_forward(m, s, pass.tokens, keep_routing, pass.rebuild_ffn_inputs);
}

void ffn_backward(Ledger& m, const Shapes& s, const LayerShape& layer, const Pass& pass,
                  Blocks kept_routing) {
  if (layer.mlp == MlpKind::Dense)
    mlp_backward(m, pass.tokens, s.dense_inter);
  else
    moe_backward(m, s, pass.tokens, std::move(kept_routing), pass.rebuild_ffn_inputs);
}

int64_t routed_rows(const Shapes& s, int64_t tokens) {
  return static_cast<int64_t>(std::ceil(static_cast<double>(tokens) * s.routed_rows_per_token));
}

int64_t permutation_workspace_bytes(const Shapes& s, int64_t tokens) {
  const int64_t tiles = std::max<int64_t>(1, (tokens * s.topk + kPermutationTile - 1) / kPermutationTile);
  return 4 * s.experts * tiles;
}

}  // namespace spindle::plan
