// The model's sublayers on the GPU, the same contracts as model/modules.h but for dx: x is the
// normalised sublayer input [tokens, hidden] (bf16), y the output (bf16, written). Each backward
// recomputes its sublayer's forward from x, writes the input gradient into dx (fp32: its first
// product into dx overwrites it, so that no caller zeroes the buffer and no product reads it
// first) and accumulates the parameter gradients into `grad` (fp32 device weights, same layout as
// the weights). The attention backwards also write the recomputed output into y unless it is null:
// the mHC combine's backward needs it, and it costs them one projection, not a forward.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "model/backward.h"
#include "model/config.h"
#include "model/cuda/context.h"
#include "model/weights.h"

namespace spindle::cuda {

using bf16 = __nv_bfloat16;

// What a KDA layer carries from one chunk of a sequence to the next (docs/STREAMING.md): the
// delta-rule state (fp32 [heads, dk, dv]) and the last kernel - 1 rows of the q, k and v
// projections (bf16 [kernel - 1, 3 qkv], q's, k's and v's side by side: the causal conv's
// windows). Zero at the start. As a gradient: of the state a chunk handed on, then of the one it
// received.
struct KdaCarry {
  KdaCarry(const ModelConfig& c, cudaStream_t stream);   // zeros
  KdaCarry(const KdaCarry& other, cudaStream_t stream);  // a copy
  DeviceBuffer<float> state;
  DeviceBuffer<bf16> tails;
};

// What the streaming executor keeps of an attention sublayer's forward in a chunk's
// recomputation, so that the sublayer's backward does not compute it a third time
// (LossOptions::keep_outputs): KDA, the recurrence's output (`out`), fp32 chunk states (`stats`)
// and, if `keep_matrices` (LossOptions::keep_kda_matrices), intra-chunk matrices (`matrices`: A,
// Aq and Tinv, kernels/cuda/kda.h kept_matrices); DSA, the attention's output (absorbed: o_lat,
// and its log-sum-exp on the tensor cores; expanded, or the union form: the heads' output, and
// for the union form its log-sum-exp). The backward takes them; empty, it recomputes them.
struct AttentionKept {
  bool keep_matrices = false;
  bool keep_projections = false;  // KDA: also the input projections (LossOptions::kda_projections_kept)
  bool union_form = false;  // DSA: `out` is the heads' output of the union form (docs/UNION_ATTENTION.md)
  DeviceBuffer<bf16> out;
  DeviceBuffer<float> stats;
  DeviceBuffer<float> matrices;
  DeviceBuffer<bf16> projected;  // KDA: x's projections and the conv windows' carried rows
  bool empty() const { return out.size() == 0; }
};

void kda_forward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L, bf16* y);
// Continues a sequence whose earlier tokens left `carry`, and updates it; fills `keep` if given.
// With y null it only updates the carry (the streamed forward's last layer: nothing reads its output).
void kda_forward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L, bf16* y,
                 KdaCarry& carry, AttentionKept* keep = nullptr);
void kda_backward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, KdaWeights& grad, bf16* y);
// Backward of a chunk whose forward received `carry_in`. `carry_grad` holds on entry the gradient
// of the carry the chunk handed on (zero for the last chunk), on return that of `carry_in`.
// `kept` (if not null and not empty): that forward's recurrence, taken instead of recomputed.
void kda_backward(Context& ctx, const ModelConfig& c, const KdaWeights& w, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, KdaWeights& grad, const KdaCarry& carry_in, KdaCarry& carry_grad,
                  bf16* y, AttentionKept* kept = nullptr);

// The indexer's KL training, accumulated over DSA layers on the device.
struct IndexerLoss {
  IndexerLoss(double coef, cudaStream_t stream);  // the sums zeroed on the stream
  // Into `result` (after the backward): the mean over layers of the mean KL over the sequence's
  // `tokens` queries, and the share of the trained queries with every relu closed.
  void read(int64_t tokens, LossResult& result) const;

  double coef = 0.0;  // gradients of coef * mean KL go to the indexer only
  // Three values summed over layers and queries: KL_q, the queries trained, and those with every
  // relu closed (cuda::indexer_kl_backward's sums).
  DeviceBuffer<double> sums;
  int64_t layers = 0;
};

// What a DSA layer carries from one chunk of a sequence to the next: the keys and values of every
// earlier token as the attention kernel reads them (absorbed MLA: the normalised latent c, stored
// [c | c] per token, one key head; expanded: every head's keys and values) and, for a layer with
// its own indexer, the indexer keys and pool gates before pooling (a pool can straddle two chunks)
// and the pooled keys of the complete pools. Rows [0, tokens) are filled; room for `capacity`.
// The indexer's rows are kept for the whole capacity where `index_rows` is 0; else only the last
// chunk's, index_rows of them from sequence row index_rows_first: enough where every chunk starts
// on a pool (its pools need no row before it) and no KL training reads them in the backward (0.54
// GB a layer at 1M for the 4B config).
struct DsaCache {
  DsaCache(const ModelConfig& c, bool absorbed_mla, bool indexer, int64_t capacity, int64_t index_rows = 0);
  int64_t tokens = 0, capacity, row;  // row: bf16 values of kv per token
  int64_t index_rows_first = 0;       // the sequence row of index_keys' and index_gate's first row
  DeviceBuffer<bf16> kv, index_keys, index_gate, pool_keys;
};

// The gradients of a whole sequence's DsaCache gathered over a backward in chunks (last chunk
// first): keys and values (fp32, like kv) and, when the indexer is trained, its pooled keys (fp32)
// and its keys and gates (bf16) for a window of rows: the chunk being backpropagated and the pool
// that straddles its start, whose rows before the chunk this chunk writes and the one before reads
// (slide_index_rows moves the window). Zero to begin with. `tokens`: the whole sequence;
// `chunk_tokens`: the longest chunk.
struct DsaCacheGrad {
  DsaCacheGrad(const ModelConfig& c, const DsaCache& cache, int64_t tokens, int64_t chunk_tokens,
               bool indexer, cudaStream_t stream);
  int64_t tokens;
  DeviceBuffer<float> kv, pool_keys;
  DeviceBuffer<bf16> index_keys, index_gate;  // [window rows, index_head_dim]
  int64_t index_rows_first;                   // the sequence position of the window's first row
};

// One layer's carry across the chunks of a streamed sequence: its KdaCarry or its DsaCache.
struct LayerCarry {
  std::optional<KdaCarry> kda;
  std::optional<DsaCache> dsa;
};

// `selection` ([tokens, width] int32, absolute positions) is written by a layer with its own
// indexer and read by one that shares the previous layer's, or by a recomputation
// (reuse_selection).
void dsa_forward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                 DeviceBuffer<int32_t>& selection, bf16* y, bool reuse_selection = false);
// Continues a sequence whose first cache.tokens tokens are in `cache`, and appends this chunk's
// rows to it (with reuse_selection, the indexer's rows are taken to be there already); fills
// `keep` if given. With y null it only appends the rows and selects (no attention: the streamed
// forward's last layer).
void dsa_forward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                 DeviceBuffer<int32_t>& selection, bf16* y, bool reuse_selection, DsaCache& cache,
                 AttentionKept* keep = nullptr);
void dsa_backward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                  const int32_t* selection, const bf16* dy, float* dx, DsaWeights& grad,
                  IndexerLoss* indexer_loss, bf16* y);
// The selection of queries first .. first + L as its pool list (kernels/cuda/selection_pools.h),
// and back: the streaming executor keeps a chunk's from the forward so that the recomputation
// before its backward runs no indexer (dsa_forward with reuse_selection). 16 bits a pool where
// they fit (narrow), else 32 (wide); one of the two is empty.
struct PoolLists {
  DeviceBuffer<uint16_t> narrow;
  DeviceBuffer<int32_t> wide;
};
PoolLists keep_selection(Context& ctx, const ModelConfig& c, const DeviceBuffer<int32_t>& selection,
                         int64_t first, int64_t L);
void restore_selection(Context& ctx, const ModelConfig& c, const PoolLists& pools, int64_t first, int64_t L,
                       DeviceBuffer<int32_t>& selection);
// Backward of the chunk of queries first .. first + L over the forward's final cache. Every
// chunk adds its keys' and values' gradients (and the indexer's pooled keys') to `cache_grad`;
// this chunk's own rows are complete when it runs (later chunks ran first) and flow back into dx
// (keys and values) or the indexer's weights. The indexer's KL is normalised by the whole
// sequence (cache_grad.tokens). `kept` (if not null and not empty): the chunk's forward attention,
// taken instead of recomputed.
void dsa_backward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                  const int32_t* selection, const bf16* dy, float* dx, DsaWeights& grad,
                  IndexerLoss* indexer_loss, const DsaCache& cache, int64_t first, DsaCacheGrad& cache_grad,
                  bf16* y, AttentionKept* kept = nullptr);

// `keep_gate_up` (may be null): takes the [gate | up] product ([L, 2 I]).
void mlp_forward(Context& ctx, const MlpWeights& w, double swiglu_limit, const bf16* x, int64_t L, bf16* y,
                 DeviceBuffer<bf16>* keep_gate_up = nullptr);
// `kept_gate_up` (if not null and not empty): the forward's product of the same x, taken instead of
// multiplied again.
void mlp_backward(Context& ctx, const MlpWeights& w, double swiglu_limit, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, MlpWeights& grad, DeviceBuffer<bf16>* kept_gate_up = nullptr);

// The balance loss's pooled statistics (device) and its coefficient, for the routers' gradient.
struct BalanceLoss {
  double coef = 0.0;
  const double* counts = nullptr;  // [experts]: top-k picks over all MoE layers
  double rows = 0.0;               // tokens over all MoE layers
};

// A MoE sublayer's routing of its tokens, which the streaming executor keeps from a chunk's
// recomputation for that sublayer's backward (LossOptions::keep_outputs), so that the backward
// neither routes the same rows again nor waits for the experts' row offsets: the router's logits
// [tokens, experts], each (token, choice) assignment's weight and expert, the expert-sorted
// permutation of the assignments and its inverse, and the experts' first rows (host, [experts + 1]).
// With `keep_products` set before the forward (LossOptions::rebuild_ffn_inputs), also the routed
// experts' and the shared expert's [gate | up] products, which the backward then takes instead of
// multiplying the rows again.
struct MoeRouting {
  bool keep_products = false;
  DeviceBuffer<float> logits, weight;
  DeviceBuffer<int32_t> expert, permutation, inverse;
  std::vector<int32_t> host_offsets;
  DeviceBuffer<bf16> gate_up, shared_gate_up;  // [assignments, 2 I] in expert order; [tokens, 2 I]
  bool empty() const { return host_offsets.empty(); }
};

// `load` (host, may be null): tokens routed to each expert. `router_logits` (device fp32
// [tokens, experts], may be null): written. `keep` (may be null): takes the routing.
void moe_forward(Context& ctx, const ModelConfig& c, const MoeWeights& w, const bf16* x, int64_t L, bf16* y,
                 std::vector<int64_t>* load = nullptr, float* router_logits = nullptr,
                 MoeRouting* keep = nullptr);
// `kept` (if not null and not empty): the forward's routing of the same x, taken instead of routing
// again.
void moe_backward(Context& ctx, const ModelConfig& c, const MoeWeights& w, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, MoeWeights& grad, const BalanceLoss* balance = nullptr,
                  MoeRouting* kept = nullptr);

// A bf16 activation buffer of n elements (category Activations).
inline DeviceBuffer<bf16> activations(int64_t n) {
  return DeviceBuffer<bf16>(static_cast<size_t>(n), MemoryCategory::Activations);
}
inline DeviceBuffer<float> activations_f32(int64_t n) {
  return DeviceBuffer<float>(static_cast<size_t>(n), MemoryCategory::Activations);
}

}  // namespace spindle::cuda
