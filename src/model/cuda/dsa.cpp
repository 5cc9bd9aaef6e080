// MLA + DSA on the GPU: the CPU module's steps (model/dsa.cpp) with bf16 activations, the k-pool
// indexer scored in query blocks, sparse attention over the selection, and the indexer's KL
// training with detached inputs. A chunk of a streamed sequence attends into the cache of the
// keys and values before it (the plain pass: one chunk over its own cache).
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "backend/cuda/check.h"
#include "kernels/cuda/convert.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/indexer_training.h"
#include "kernels/cuda/norms.h"
#include "kernels/cuda/selection_pools.h"
#include "kernels/cuda/sparse_attention.h"
#include "kernels/cuda/sparse_mla.h"
#include "kernels/cuda/sparse_mla_backward_hopper.h"
#include "kernels/cuda/sparse_mla_hopper.h"
#include "kernels/cuda/union_attention.h"
#include "kernels/cuda/union_attention_hopper.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/modules.h"

namespace spindle::cuda {

namespace {

constexpr float kIndexerNormEps = 1e-6f;
constexpr size_t kSelectWorkspaceBytes = size_t{1} << 30;  // the score tile of a query block

// Columns of a row of MlaActivations::low and of the backward's gradients into x: q_a's, kv_a's
// and, where the pass runs the layer's indexer, its raw keys and its pool gates (the rows of
// DsaWeights::x_proj, so that a prefix of them is the product's weight).
struct XProjColumns {
  int64_t q, kv, index;  // q_lora_rank, kv_lora_rank, index_head_dim or 0
  int64_t width() const { return q + kv + 2 * index; }
  int64_t raw_keys() const { return q + kv; }
  int64_t gates() const { return q + kv + index; }
};

XProjColumns x_proj_columns(const ModelConfig& c, bool indexer) {
  check(c.qk_rope_head_dim == 0, "DSA on the GPU: kv_a_proj's RoPE rows (the layers use NoPE)");
  return {c.q_lora_rank, c.kv_lora_rank, indexer ? c.index_head_dim : 0};
}

// MLA's activations. In the absorbed form every head attends over the 512-wide
// latent c itself: the query is absorbed into it (q_lat_h = q_h W_k,h), keys and values are c
// (the cache holds [c | c] per token, one key head), and the head's output is o_lat_h W_v,h^T. In
// the expanded form kv_b_proj expands c into per-head keys and values first. Same function.
struct MlaActivations {
  DeviceBuffer<bf16> low, q_resid, q, kv_normed, q_lat, o_lat, attended;  // low: x's low-rank projections
  XProjColumns cols;                                                      // low's columns
  DeviceBuffer<float> lse;  // absorbed form on the tensor cores or union form: each query head's log-sum-exp
  bool union_form = false;  // the attention ran in the union form: `attended` and `lse` are its output
  std::optional<ChunkUnion> chunk_union;  // the union form's, where this pass made it (the backward's then)
  const bf16* attention_query() const { return q_lat.size() ? q_lat.data() : q.data(); }
};

// The indexer over `tokens` keys, for the queries from `first` on.
cpu::IndexerShape indexer_shape(const ModelConfig& c, int64_t tokens, int64_t first = 0) {
  return {tokens,        c.index_n_heads, c.index_head_dim,
          c.index_kpool, c.index_topk,    c.index_kpool_always_select_tail,
          first};
}

int64_t selection_width(const ModelConfig& c) { return indexer_shape(c, 0).width(); }

// The indexer's per-head queries and head weights (already scaled by heads^-0.5) of L queries.
struct IndexerQueries {
  DeviceBuffer<bf16> q, head_weights;
};

IndexerQueries indexer_queries(Context& ctx, const ModelConfig& c, const IndexerWeights& w, const bf16* x,
                               const bf16* q_resid, int64_t L) {
  const int64_t Hi = c.index_n_heads, d = c.index_head_dim;
  IndexerQueries a{activations(L * Hi * d), activations(L * Hi)};
  ctx.gemm.linear(q_resid, bf16_data(w.wq_b), a.q.data(), L, c.q_lora_rank, Hi * d, ctx.stream());
  ctx.gemm.linear(x, bf16_data(w.weights_proj), a.head_weights.data(), L, c.hidden_size, Hi, ctx.stream(),
                  1.0f / std::sqrt(static_cast<float>(Hi)));
  return a;
}

// This chunk's indexer keys (normalised) and pool gates join the cache at rows cache.tokens ..
// + L, and the pools they complete are pooled: from the raw keys (x wk^T) and gates (x
// compress_gate^T) among the projections' columns.
void append_index_keys(Context& ctx, const ModelConfig& c, const IndexerWeights& w, const MlaActivations& a,
                       int64_t L, DsaCache& cache) {
  const int64_t d = c.index_head_dim, kp = c.index_kpool;
  const int64_t p0 = cache.tokens / kp, p1 = (cache.tokens + L) / kp;
  // The last chunk's rows alone (DsaCache::index_rows): this chunk's, from its start on a pool.
  if (cache.index_keys.size() < static_cast<size_t>(cache.capacity * d)) {
    check(cache.tokens % kp == 0, "DSA cache keeping one chunk's indexer rows: the chunk at token ",
          cache.tokens, " does not start on a pool of ", kp);
    cache.index_rows_first = cache.tokens;
  }
  check(cache.index_keys.size() >= static_cast<size_t>((cache.tokens + L - cache.index_rows_first) * d),
        "DSA cache without room for the indexer's keys of tokens up to ", cache.tokens + L);
  const int64_t at = (cache.tokens - cache.index_rows_first) * d,
                pooled = (p0 * kp - cache.index_rows_first) * d;
  const cudaStream_t s = ctx.stream();
  const int64_t ld = a.cols.width();
  check(a.cols.index == d, "DSA projections without the indexer's columns");
  layer_norm_forward(a.low.data() + a.cols.raw_keys(), ld, bf16_data(w.k_norm_weight),
                     bf16_data(w.k_norm_bias), cache.index_keys.data() + at, L, d, kIndexerNormEps, s);
  SPINDLE_CUDA(cudaMemcpy2DAsync(cache.index_gate.data() + at, d * sizeof(bf16),
                                 a.low.data() + a.cols.gates(), ld * sizeof(bf16), d * sizeof(bf16),
                                 static_cast<size_t>(L), cudaMemcpyDeviceToDevice, s));
  if (p1 > p0)
    indexer_pool_keys(indexer_shape(c, (p1 - p0) * kp), cache.index_keys.data() + pooled,
                      cache.index_gate.data() + pooled, bf16_data(w.compress_ape),
                      cache.pool_keys.data() + p0 * d, s);
}

// The L queries after the cache's first `first` tokens (whose indexer rows, and theirs, are in the
// cache) select among the complete pools they see.
void run_indexer(Context& ctx, const ModelConfig& c, const IndexerWeights& w, const bf16* x,
                 const bf16* q_resid, int64_t L, const DsaCache& cache, int64_t first,
                 DeviceBuffer<int32_t>& selection) {
  const cpu::IndexerShape shape = indexer_shape(c, first + L, first);
  IndexerQueries a = indexer_queries(ctx, c, w, x, q_resid, L);
  // Query blocks whose score tile fits kSelectWorkspaceBytes (at least one row), with their tile maxima.
  const size_t row_bytes = std::max<size_t>(1, static_cast<size_t>(shape.complete_pools()) * sizeof(float));
  const int64_t block =
      std::max<int64_t>(1, std::min(L, static_cast<int64_t>(kSelectWorkspaceBytes / row_bytes)));
  const size_t bytes = indexer_select_workspace_bytes(shape, block);
  DeviceBuffer<float> workspace((bytes + 3) / 4, MemoryCategory::Workspace);
  if (selection.size() != static_cast<size_t>(L * shape.width()))
    selection = DeviceBuffer<int32_t>(static_cast<size_t>(L * shape.width()), MemoryCategory::Activations);
  indexer_select(shape, a.q.data(), cache.pool_keys.data(), a.head_weights.data(), selection.data(),
                 workspace.data(), workspace.size() * 4, ctx.stream());
  ctx.record.note("dsa/indexer", std::string("cuda k-pool scores (") + indexer_scorer(shape) +
                                     ") + top-k from the tile maxima in query blocks");
}

// Rows of the indexer keys' and gates' gradient window: a chunk and the pool before it that
// straddles its start.
int64_t index_window_rows(const ModelConfig& c, int64_t tokens, int64_t chunk_tokens) {
  return std::min(tokens, chunk_tokens + c.index_kpool - 1);
}

// Moves the window of the indexer rows' gradients to the rows [row0, end) of the chunk about to
// run (row0 its first pool's first row): the rows the window held there (the straddling pool's,
// written by the chunk after) keep their values, every other row is zero.
void slide_index_rows(DsaCacheGrad& g, int64_t row0, int64_t end, int64_t d, cudaStream_t s) {
  const int64_t capacity = static_cast<int64_t>(g.index_keys.size()) / d;
  check(row0 <= end && end - row0 <= capacity, "the indexer's gradient window holds ", capacity,
        " rows, a chunk needs ", end - row0);
  const int64_t kept0 = std::max(row0, g.index_rows_first),
                kept1 = std::min(end, g.index_rows_first + capacity);
  const int64_t kept = std::max<int64_t>(0, kept1 - kept0);
  DeviceBuffer<bf16> saved(static_cast<size_t>(2 * kept * d), MemoryCategory::Workspace);
  const auto bytes = [d](int64_t rows) { return static_cast<size_t>(rows * d) * sizeof(bf16); };
  const int64_t from = (kept0 - g.index_rows_first) * d, to = (kept0 - row0) * d;
  if (kept > 0) {
    SPINDLE_CUDA(
        cudaMemcpyAsync(saved.data(), g.index_keys.data() + from, bytes(kept), cudaMemcpyDeviceToDevice, s));
    SPINDLE_CUDA(cudaMemcpyAsync(saved.data() + kept * d, g.index_gate.data() + from, bytes(kept),
                                 cudaMemcpyDeviceToDevice, s));
  }
  SPINDLE_CUDA(cudaMemsetAsync(g.index_keys.data(), 0, bytes(capacity), s));
  SPINDLE_CUDA(cudaMemsetAsync(g.index_gate.data(), 0, bytes(capacity), s));
  if (kept > 0) {
    SPINDLE_CUDA(
        cudaMemcpyAsync(g.index_keys.data() + to, saved.data(), bytes(kept), cudaMemcpyDeviceToDevice, s));
    SPINDLE_CUDA(cudaMemcpyAsync(g.index_gate.data() + to, saved.data() + kept * d, bytes(kept),
                                 cudaMemcpyDeviceToDevice, s));
  }
  g.index_rows_first = row0;
}

// KL(attention || indexer) on the indexer's own selection for the L queries first .. first + L;
// gradients reach the indexer only. The queries add their pooled keys' gradients to cache_grad;
// the pools that end inside the chunk then have all of theirs (later chunks ran first, earlier
// queries cannot see them) and go back to their tokens' keys and gates (a pool straddling the chunk
// before writes into its rows); the chunk's own rows, complete too, go back through the key norm,
// wk and compress_gate.
void train_indexer(Context& ctx, const ModelConfig& c, const IndexerWeights& w, const bf16* x,
                   const bf16* q_resid, int64_t L, const int32_t* selection, const float* mass,
                   const DsaCache& cache, int64_t first, DsaCacheGrad& cache_grad, IndexerLoss& loss,
                   IndexerWeights& grad) {
  const int64_t D = c.hidden_size, Hi = c.index_n_heads, d = c.index_head_dim, kp = c.index_kpool;
  const int64_t end = first + L;
  check(cache.index_rows_first == 0 && cache.index_keys.size() >= static_cast<size_t>(end * d) &&
            cache_grad.index_keys.size() > 0,
        "the indexer's KL training needs the sequence's indexer keys and their gradient buffers");
  const cudaStream_t s = ctx.stream();
  const int64_t p0 = first / kp, p1 = end / kp;  // the pools that end inside this chunk
  slide_index_rows(cache_grad, p0 * kp, end, d, s);
  const auto dkeys = [&](int64_t row) { return cache_grad.index_keys.data() + (row - p0 * kp) * d; };
  const auto dgate = [&](int64_t row) { return cache_grad.index_gate.data() + (row - p0 * kp) * d; };
  IndexerQueries a = indexer_queries(ctx, c, w, x, q_resid, L);
  DeviceBuffer<bf16> dq = activations(L * Hi * d), dhw = activations(L * Hi);
  indexer_kl_backward(indexer_shape(c, end, first), a.q.data(), cache.pool_keys.data(), a.head_weights.data(),
                      selection, mass, static_cast<float>(loss.coef / static_cast<double>(cache_grad.tokens)),
                      dq.data(), cache_grad.pool_keys.data(), dhw.data(), loss.sums.data(), s);
  if (first == 0) loss.layers += 1;  // a layer counts once, at its first chunk
  ctx.gemm.linear_backward_weight(dhw.data(), x, f32_data(grad.weights_proj), L, D, Hi, s,
                                  1.0f / std::sqrt(static_cast<float>(Hi)));
  ctx.gemm.linear_backward_weight(dq.data(), q_resid, f32_data(grad.wq_b), L, c.q_lora_rank, Hi * d, s);
  if (p1 > p0) {
    const int64_t at = p0 * kp * d;
    indexer_pool_keys_backward(indexer_shape(c, (p1 - p0) * kp), cache.index_keys.data() + at,
                               cache.index_gate.data() + at, bf16_data(w.compress_ape),
                               cache_grad.pool_keys.data() + p0 * d, dkeys(p0 * kp), dgate(p0 * kp),
                               f32_data(grad.compress_ape), s);
  }
  ctx.gemm.linear_backward_weight(dgate(first), x, f32_data(grad.compress_gate), L, D, d, s);
  DeviceBuffer<bf16> raw = activations(L * d), draw = activations(L * d);
  ctx.gemm.linear(x, bf16_data(w.wk), raw.data(), L, D, d, s);
  layer_norm_backward(raw.data(), bf16_data(w.k_norm_weight), dkeys(first), draw.data(),
                      f32_data(grad.k_norm_weight), f32_data(grad.k_norm_bias), L, d, kIndexerNormEps, s);
  ctx.gemm.linear_backward_weight(draw.data(), x, f32_data(grad.wk), L, D, d, s);
  ctx.record.note("dsa/indexer_kl", "cuda KL backward on the attention mass");
}

cpu::SparseAttentionShape attention_shape(const ModelConfig& c, int64_t L, bool absorbed) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_head_dim()));
  if (absorbed)
    return {L, c.num_attention_heads, c.kv_lora_rank, c.kv_lora_rank, selection_width(c), scale, 1};
  return {L, c.num_attention_heads, c.qk_head_dim(), c.v_head_dim, selection_width(c), scale};
}

// The absorbed form on the tensor cores: keys and values are the normalised latent itself, rows
// `stride` apart in the cache.
SparseMlaShape mla_shape(const ModelConfig& c, int64_t L, int64_t stride) {
  const cpu::SparseAttentionShape a = attention_shape(c, L, true);
  return {L, a.heads, a.qk_dim, a.v_dim, a.width, stride, static_cast<float>(a.scale)};
}

// Whether the absorbed form runs on the tensor cores; else on the CUDA-core kernel, loudly.
bool latent_on_tensor_cores(const ModelConfig& c) {
  return sparse_mla_unsupported(mla_shape(c, 0, c.kv_lora_rank)).empty();
}

// bf16 values per token of the keys and values the attention kernel reads: the latent once for
// the tensor-core kernel, [c | c] (a key and a value per row) for the CUDA-core one, or every
// head's expanded keys and values.
int64_t cache_row(const ModelConfig& c, bool absorbed) {
  if (!absorbed) return c.num_attention_heads * (c.qk_head_dim() + c.v_head_dim);
  return latent_on_tensor_cores(c) ? c.kv_lora_rank : 2 * c.kv_lora_rank;
}

// kv_b_proj's rows for head h: W_k,h ([qk_head_dim, kv_lora_rank]) then W_v,h ([v, kv_lora_rank]).
int64_t key_rows(const ModelConfig& c, int64_t h) { return h * (c.qk_head_dim() + c.v_head_dim); }
int64_t value_rows(const ModelConfig& c, int64_t h) { return key_rows(c, h) + c.qk_head_dim(); }
// Elements from one head's W_k,h (or W_v,h) to the next's: the per-head products run batched.
int64_t head_weight_stride(const ModelConfig& c) { return key_rows(c, 1) * c.kv_lora_rank; }

// The union form (docs/UNION_ATTENTION.md), where a chunk's pool slots hold at most this many
// times a query's pooled tokens between them: below its break-even against the absorbed kernels
// (bench_union_attention at 1M, forward twice and backward: 10.7 ms at 1x, 25.2 ms at 4x, the
// absorbed kernels 31.6 ms: even near 5x).
constexpr double kUnionLimit = 4.0;

UnionAttentionShape union_shape(const ModelConfig& c, int64_t L, int64_t span) {
  const cpu::SparseAttentionShape a = attention_shape(c, L, false);
  return {L, a.heads, a.qk_dim, a.v_dim, a.width, c.index_topk, span - L, static_cast<float>(a.scale)};
}

UnionLatent union_latent(const ModelConfig& c, const DsaWeights& w, const bf16* kv) {
  return {kv, cache_row(c, true), c.kv_lora_rank, bf16_data(w.kv_b_proj)};
}

// The chunk's union, or nothing where it is over the limit.
std::optional<ChunkUnion> union_within_limit(Context& ctx, const UnionAttentionShape& s,
                                             const int32_t* selection) {
  const auto most_keys = static_cast<int64_t>(kUnionLimit * static_cast<double>(s.pooled));
  ChunkUnion u = chunk_union(s, selection, ctx.stream(), most_keys);
  if (u.count > most_keys) return std::nullopt;
  return u;
}

// Projections up to the (latent) queries and the normalised latent c, all of x's low-rank ones in one
// product; `indexer`: with the indexer's raw keys and pool gates (the layer's own indexer runs);
// `output_kept`: the attention's output comes from an AttentionKept (not allocated here).
MlaActivations mla_projections(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x,
                               int64_t L, bool indexer, bool output_kept = false) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, dqk = c.qk_head_dim(), dv = c.v_head_dim;
  const int64_t qr = c.q_lora_rank, kr = c.kv_lora_rank;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const cudaStream_t s = ctx.stream();
  const XProjColumns cols = x_proj_columns(c, indexer);
  check(!indexer || w.has_indexer, "DSA projections: the indexer's columns of a layer without an indexer");
  MlaActivations a;
  a.cols = cols;
  a.low = activations(L * cols.width());
  a.q_resid = activations(L * qr);
  a.q = activations(L * H * dqk);
  a.kv_normed = activations(L * kr);
  const bool attended_kept = output_kept && !ctx.absorbed_mla;  // the expanded form keeps the heads' output
  if (!attended_kept) a.attended = activations(L * H * dv);
  ctx.gemm.linear(x, bf16_data(w.x_proj), a.low.data(), L, D, cols.width(), s);
  rms_norm_forward(a.low.data(), cols.width(), bf16_data(w.q_a_layernorm), a.q_resid.data(), qr, L, qr, eps,
                   s);
  ctx.gemm.linear(a.q_resid.data(), bf16_data(w.q_b_proj), a.q.data(), L, qr, H * dqk, s);
  rms_norm_forward(a.low.data() + cols.q, cols.width(), bf16_data(w.kv_a_layernorm), a.kv_normed.data(), kr,
                   L, kr, eps, s);
  ctx.record.note("dsa/projections",
                  ctx.absorbed_mla ? "cublaslt bf16 (queries absorbed into the latent where the absorbed "
                                     "kernels run)"
                                   : "cublaslt bf16 (expanded keys and values)");
  return a;
}

// The absorbed form's queries in the latent, q_lat_h [L, kr] = q_h [L, dqk] W_k,h [dqk, kr], every
// head h in one launch (the union form reads q itself and needs none).
void absorb_queries(Context& ctx, const ModelConfig& c, const DsaWeights& w, int64_t L, MlaActivations& a) {
  const int64_t H = c.num_attention_heads, dqk = c.qk_head_dim(), kr = c.kv_lora_rank;
  a.q_lat = activations(L * H * kr);
  ctx.gemm.matmul_batched(false, false, kr, L, dqk, bf16_data(w.kv_b_proj) + key_rows(c, 0) * kr, kr,
                          head_weight_stride(c), a.q.data(), H * dqk, dqk, a.q_lat.data(), CUDA_R_16BF,
                          H * kr, kr, H, 1.0f, 0.0f, ctx.stream(), Gemm::Rows::N);
}

// This chunk's keys and values join the cache at rows cache.tokens .. + L.
void append_kv(Context& ctx, const ModelConfig& c, const DsaWeights& w, int64_t L, const bf16* kv_normed,
               DsaCache& cache) {
  const int64_t kr = c.kv_lora_rank;
  bf16* rows = cache.kv.data() + cache.tokens * cache.row;
  if (!ctx.absorbed_mla) {
    ctx.gemm.linear(kv_normed, bf16_data(w.kv_b_proj), rows, L, kr, cache.row, ctx.stream());
    return;
  }
  for (int64_t at = 0; at < cache.row; at += kr)  // once, or twice for [c | c]
    SPINDLE_CUDA(cudaMemcpy2DAsync(rows + at, cache.row * sizeof(bf16), kv_normed, kr * sizeof(bf16),
                                   kr * sizeof(bf16), static_cast<size_t>(L), cudaMemcpyDeviceToDevice,
                                   ctx.stream()));
}

// Absorbed: the heads' output from the latent one, attended_h [L, dv] = o_lat_h [L, kr] W_v,h^T.
void project_attended(Context& ctx, const ModelConfig& c, const DsaWeights& w, int64_t L, MlaActivations& a) {
  const int64_t H = c.num_attention_heads, kr = c.kv_lora_rank, dv = c.v_head_dim;
  const bf16* wkv = bf16_data(w.kv_b_proj);
  ctx.gemm.matmul_batched(true, false, dv, L, kr, wkv + value_rows(c, 0) * kr, kr, head_weight_stride(c),
                          a.o_lat.data(), H * kr, kr, a.attended.data(), CUDA_R_16BF, H * dv, dv, H, 1.0f,
                          0.0f, ctx.stream(), Gemm::Rows::N);
}

// What the forward's attention left in `kept` back into `a` (the form's output, and the
// log-sum-exp where the tensor cores wrote one), and the heads' output from it.
void take_attention(Context& ctx, const ModelConfig& c, const DsaWeights& w, int64_t L, MlaActivations& a,
                    AttentionKept& kept) {
  const int64_t H = c.num_attention_heads;
  const int64_t width = ctx.absorbed_mla && !kept.union_form ? c.kv_lora_rank : c.v_head_dim;
  check(kept.out.size() == static_cast<size_t>(L * H * width), "DSA backward: a kept attention output of ",
        kept.out.size(), " values for ", L, " queries");
  if (!ctx.absorbed_mla) {
    a.attended = std::move(kept.out);
    return;
  }
  if (kept.union_form) {
    a.attended = std::move(kept.out);
    a.lse = std::move(kept.stats);
    a.union_form = true;
    return;
  }
  a.o_lat = std::move(kept.out);
  a.lse = std::move(kept.stats);
  absorb_queries(ctx, c, w, L, a);  // the backward's
  project_attended(ctx, c, w, L, a);
}

// The L queries attend over `kv` (the cache: the selection's absolute positions index its rows,
// all below `span`).
void attend(Context& ctx, const ModelConfig& c, const DsaWeights& w, int64_t L, MlaActivations& a,
            const bf16* kv, const int32_t* selection, int64_t span) {
  const cudaStream_t s = ctx.stream();
  if (!ctx.absorbed_mla) {
    sparse_attention_forward(attention_shape(c, L, false), a.q.data(), kv, selection, a.attended.data(), s);
    ctx.record.note("dsa/attention", "cuda sparse attention, expanded heads");
    return;
  }
  const UnionAttentionShape us = union_shape(c, L, span);
  if (ctx.union_attention && union_fused_unsupported(us).empty()) {
    if (std::optional<ChunkUnion> u = union_within_limit(ctx, us, selection)) {
      a.lse = activations_f32(L * c.num_attention_heads);
      union_attention_forward(ctx.gemm, us, *u, union_latent(c, w, kv), selection, a.q.data(),
                              a.attended.data(), a.lse.data(), s);
      a.union_form = true;
      a.chunk_union = std::move(u);
      ctx.record.note("dsa/attention/union", "union form: the chunk's selected keys expanded (fused, wgmma)");
      return;
    }
    ctx.record.note("dsa/attention/union_over_limit",
                    "absorbed form: the chunk's union over the union form's limit");
  }
  absorb_queries(ctx, c, w, L, a);
  a.o_lat = activations(L * c.num_attention_heads * c.kv_lora_rank);
  const SparseMlaShape mla = mla_shape(c, L, cache_row(c, true));
  const std::string unsupported = sparse_mla_unsupported(mla);  // the cache holds [c | c] then
  if (unsupported.empty()) {
    a.lse = activations_f32(L * c.num_attention_heads);
    sparse_mla_forward(mla, a.q_lat.data(), kv, selection, a.o_lat.data(), a.lse.data(), s);
  } else {
    sparse_attention_forward(attention_shape(c, L, true), a.q_lat.data(), kv, selection, a.o_lat.data(), s);
  }
  project_attended(ctx, c, w, L, a);
  if (unsupported.empty())
    ctx.record.note("dsa/attention",
                    sparse_mla_hopper_takes(mla)
                        ? "sparse MLA on the tensor cores (absorbed; wgmma forward, pools by TMA)"
                        : "sparse MLA on the tensor cores (absorbed; mma.sync forward)");
  else
    ctx.record.note("dsa/attention",
                    "cuda-core sparse attention over [c | c] (tensor cores: " + unsupported + ")", true);
}

// The attention's probabilities summed over the heads, [L, width] (written), where the sparse MLA
// backward cannot add them itself: a pass of its own on the CUDA cores (at 32k on the 4B model
// 20x the sparse MLA backward's time, docs/PERF.md).
void attention_mass_pass(Context& ctx, const ModelConfig& c, int64_t L, MlaActivations& a, const bf16* kv,
                         const int32_t* selection, float* mass) {
  cpu::SparseAttentionShape shape = attention_shape(c, L, ctx.absorbed_mla);
  if (ctx.absorbed_mla)
    shape.v_dim = cache_row(c, true) - shape.qk_dim;  // the mass reads keys only: row stride
  attention_mass(shape, a.attention_query(), kv, selection, mass, ctx.stream());
  ctx.record.note("dsa/attention_mass", "cuda attention mass in a pass of its own (CUDA cores, slow)");
}

// The union form's backward: dq written, the latent's gradient added to dkv (the cache's, fp32) and
// kv_b_proj's accumulated; mass, unless null, written (the fused mass kernel).
void union_attention_backward_over(Context& ctx, const ModelConfig& c, const DsaWeights& w, int64_t L,
                                   MlaActivations& a, const bf16* kv, const int32_t* selection, int64_t span,
                                   const bf16* d_attended, bf16* dq, float* dkv, float* mass,
                                   DsaWeights& grad) {
  const UnionAttentionShape us = union_shape(c, L, span);
  if (!a.chunk_union)
    a.chunk_union = union_within_limit(ctx, us, selection);  // the forward's outputs were kept
  check(a.chunk_union.has_value(),
        "DSA backward: the union form's forward ran on a union its backward finds over the limit");
  union_attention_backward(ctx.gemm, us, *a.chunk_union, union_latent(c, w, kv), selection, a.q.data(),
                           a.attended.data(), a.lse.data(), d_attended, dq, dkv, f32_data(grad.kv_b_proj),
                           mass, ctx.stream());
  ctx.record.note("dsa/attention_backward/union", "union form backward (fused, wgmma)");
}

// From the attention output's gradient to the gradient of the keys and values the queries read
// (dkv, fp32 like kv, accumulated), accumulating kv_b_proj's query-side gradient and writing dq
// ([L, H, qk_head_dim], bf16). mass, unless null: the attention mass that trains the indexer,
// [L, width] fp32, written.
void attention_backward(Context& ctx, const ModelConfig& c, const DsaWeights& w, int64_t L, MlaActivations& a,
                        const bf16* kv, const int32_t* selection, int64_t span, const bf16* d_attended,
                        bf16* dq, float* dkv, float* mass, DsaWeights& grad) {
  const int64_t H = c.num_attention_heads, dqk = c.qk_head_dim(), dv = c.v_head_dim, kr = c.kv_lora_rank;
  const cudaStream_t s = ctx.stream();
  if (a.union_form) {
    union_attention_backward_over(ctx, c, w, L, a, kv, selection, span, d_attended, dq, dkv, mass, grad);
    return;
  }
  const bool absorbed = ctx.absorbed_mla;
  const cpu::SparseAttentionShape shape = attention_shape(c, L, absorbed);
  const bool tensor_cores = a.lse.size() != 0;  // the absorbed forward ran on the tensor cores
  if (mass != nullptr && !tensor_cores) attention_mass_pass(ctx, c, L, a, kv, selection, mass);
  if (!absorbed) {
    sparse_attention_backward(shape, a.q.data(), kv, selection, d_attended, dq, dkv, s);
    return;
  }
  const bf16* wkv = bf16_data(w.kv_b_proj);
  float* gkv = f32_data(grad.kv_b_proj);
  DeviceBuffer<bf16> d_o_lat = activations(L * H * kr), dq_lat = activations(L * H * kr);
  const int64_t ws = head_weight_stride(c);
  // For every head h at once: d_o_lat_h = d_attended_h W_v,h; dW_v,h += d_attended_h^T o_lat_h.
  ctx.gemm.matmul_batched(false, false, kr, L, dv, wkv + value_rows(c, 0) * kr, kr, ws, d_attended, H * dv,
                          dv, d_o_lat.data(), CUDA_R_16BF, H * kr, kr, H, 1.0f, 0.0f, s, Gemm::Rows::N);
  ctx.gemm.matmul_batched(false, true, kr, dv, L, a.o_lat.data(), H * kr, kr, d_attended, H * dv, dv,
                          gkv + value_rows(c, 0) * kr, CUDA_R_32F, kr, ws, H, 1.0f, 1.0f, s, Gemm::Rows::K);
  if (tensor_cores) {  // the latent's gradient lands in the cache gradient's rows
    if (mass != nullptr) SPINDLE_CUDA(cudaMemsetAsync(mass, 0, L * shape.width * sizeof(float), s));
    const SparseMlaShape mla = mla_shape(c, L, cache_row(c, true));
    if (sparse_mla_backward_hopper_takes(mla))
      ctx.record.note(
          "dsa/attention_backward/wgmma",
          "sparse MLA backward on wgmma (the latent of 512; pairs of queries that share rows together)");
    else
      ctx.record.note("dsa/attention_backward/mma_sync",
                      "sparse MLA backward on mma.sync (a latent other than 512)");
    sparse_mla_backward(mla, a.q_lat.data(), kv, selection, a.o_lat.data(), a.lse.data(), d_o_lat.data(),
                        dq_lat.data(), dkv, mass, s);
  } else
    sparse_attention_backward(shape, a.q_lat.data(), kv, selection, d_o_lat.data(), dq_lat.data(), dkv, s);
  // For every head h at once: dq_h = dq_lat_h W_k,h^T; dW_k,h += q_h^T dq_lat_h.
  ctx.gemm.matmul_batched(true, false, dqk, L, kr, wkv + key_rows(c, 0) * kr, kr, ws, dq_lat.data(), H * kr,
                          kr, dq, CUDA_R_16BF, H * dqk, dqk, H, 1.0f, 0.0f, s, Gemm::Rows::N);
  ctx.gemm.matmul_batched(false, true, kr, dqk, L, dq_lat.data(), H * kr, kr, a.q.data(), H * dqk, dqk,
                          gkv + key_rows(c, 0) * kr, CUDA_R_32F, kr, ws, H, 1.0f, 1.0f, s, Gemm::Rows::K);
}

// The chunk's own rows of the keys' and values' gradient (fp32 [L, row], complete) to the
// gradient of the normalised latent c (bf16, written); expanded, through kv_b_proj.
void latent_backward(Context& ctx, const ModelConfig& c, const DsaWeights& w, int64_t L, MlaActivations& a,
                     const float* dkv, bf16* d_normed, DsaWeights& grad) {
  const int64_t kr = c.kv_lora_rank, row = cache_row(c, ctx.absorbed_mla);
  const cudaStream_t s = ctx.stream();
  if (ctx.absorbed_mla) {
    if (row == kr)
      f32_to_bf16(dkv, d_normed, L * kr, s);
    else
      sum_row_halves_to_bf16(dkv, L, kr, d_normed, s);  // [c | c]: c was both the keys and the values
    return;
  }
  DeviceBuffer<bf16> dkv16 = activations(L * row);
  f32_to_bf16(dkv, dkv16.data(), L * row, s);
  ctx.gemm.linear_backward_input(dkv16.data(), bf16_data(w.kv_b_proj), d_normed, L, kr, row, s);
  ctx.gemm.linear_backward_weight(dkv16.data(), a.kv_normed.data(), f32_data(grad.kv_b_proj), L, kr, row, s);
}

// The backward of the chunk of queries first .. first + L (activations `a`) over `cache`.
void backward_over_cache(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                         MlaActivations& a, const int32_t* selection, const bf16* dy, float* dx,
                         DsaWeights& grad, IndexerLoss* indexer_loss, const DsaCache& cache, int64_t first,
                         DsaCacheGrad& cache_grad, bf16* y, AttentionKept* kept) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, dqk = c.qk_head_dim(), dv = c.v_head_dim;
  const int64_t qr = c.q_lora_rank, kr = c.kv_lora_rank;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const cudaStream_t s = ctx.stream();
  Gemm& gemm = ctx.gemm;
  check(first >= 0 && first + L <= cache.tokens && cache.row == cache_row(c, ctx.absorbed_mla) &&
            cache_grad.kv.size() >= static_cast<size_t>(cache.tokens * cache.row),
        "DSA backward: chunk [", first, ", ", first + L, ") outside the key/value cache of ", cache.tokens,
        " tokens or its gradient");
  {
    const TimedScope timed = ctx.timed("dsa.attention");
    if (kept != nullptr && !kept->empty())
      take_attention(ctx, c, w, L, a, *kept);
    else
      attend(ctx, c, w, L, a, cache.kv.data(), selection, first + L);
  }
  if (y != nullptr) gemm.linear(a.attended.data(), bf16_data(w.o_proj), y, L, H * dv, D, s);

  DeviceBuffer<bf16> d_attended = activations(L * H * dv), dq = activations(L * H * dqk);
  gemm.linear_backward_input(dy, bf16_data(w.o_proj), d_attended.data(), L, H * dv, D, s);
  gemm.linear_backward_weight(dy, a.attended.data(), f32_data(grad.o_proj), L, H * dv, D, s);
  DeviceBuffer<bf16> d_normed = activations(L * kr);
  {
    // The indexer learns from the attention's mass, which the attention's backward sums as it goes.
    const bool kl = indexer_loss != nullptr && w.has_indexer && indexer_loss->coef > 0;
    DeviceBuffer<float> mass =
        kl ? activations_f32(L * attention_shape(c, L, ctx.absorbed_mla).width) : DeviceBuffer<float>();
    {
      const TimedScope timed = ctx.timed("dsa.attention_backward");
      attention_backward(ctx, c, w, L, a, cache.kv.data(), selection, first + L, d_attended.data(), dq.data(),
                         cache_grad.kv.data(), kl ? mass.data() : nullptr, grad);
      // This chunk's keys and values have every gradient they will get: later chunks ran first.
      latent_backward(ctx, c, w, L, a, cache_grad.kv.data() + first * cache.row, d_normed.data(), grad);
    }
    if (kl) {
      const TimedScope timed = ctx.timed("dsa.indexer_kl");
      train_indexer(ctx, c, w.indexer, x, a.q_resid.data(), L, selection, mass.data(), cache, first,
                    cache_grad, *indexer_loss, grad.indexer);
    }
  }
  // The low-rank projections' gradients side by side, as x_proj's first rows: dx in one product (each
  // product adding into the fp32 dx would read and write all of it), their weights' in another.
  const XProjColumns dcols = x_proj_columns(c, false);
  const int64_t ld = dcols.width(), low_ld = a.cols.width();
  DeviceBuffer<bf16> d_low = activations(L * ld);
  rms_norm_backward(a.low.data() + a.cols.q, low_ld, bf16_data(w.kv_a_layernorm), d_normed.data(),
                    d_low.data() + dcols.q, ld, f32_data(grad.kv_a_layernorm), L, kr, eps, s);
  d_normed = {};
  DeviceBuffer<bf16> d_resid = activations(L * qr);
  gemm.linear_backward_input(dq.data(), bf16_data(w.q_b_proj), d_resid.data(), L, qr, H * dqk, s);
  gemm.linear_backward_weight(dq.data(), a.q_resid.data(), f32_data(grad.q_b_proj), L, qr, H * dqk, s);
  rms_norm_backward(a.low.data(), low_ld, bf16_data(w.q_a_layernorm), d_resid.data(), d_low.data(), ld,
                    f32_data(grad.q_a_layernorm), L, qr, eps, s);
  gemm.linear_backward_input(d_low.data(), bf16_data(w.x_proj), dx, L, D, ld, 0.0f, s);  // writes dx
  gemm.linear_backward_weight(d_low.data(), x, f32_data(grad.x_proj), L, D, ld, s);
}

}  // namespace

IndexerLoss::IndexerLoss(double coef, cudaStream_t stream) : coef(coef), sums(3, MemoryCategory::Workspace) {
  SPINDLE_CUDA(cudaMemsetAsync(sums.data(), 0, 3 * sizeof(double), stream));
}

void IndexerLoss::read(int64_t tokens, LossResult& result) const {
  if (layers == 0) return;
  const std::vector<double> v = sums.download();
  result.indexer_kl = v[0] / static_cast<double>(tokens) / static_cast<double>(layers);
  if (v[1] > 0) result.indexer_closed = v[2] / v[1];
}

DsaCache::DsaCache(const ModelConfig& c, bool absorbed_mla, bool indexer, int64_t capacity_tokens,
                   int64_t index_rows)
    : capacity(capacity_tokens),
      row(cache_row(c, absorbed_mla)),
      kv(static_cast<size_t>(capacity_tokens * row), MemoryCategory::Activations),
      index_keys(static_cast<size_t>(
                     indexer ? (index_rows > 0 ? index_rows : capacity_tokens) * c.index_head_dim : 0),
                 MemoryCategory::Activations),
      index_gate(index_keys.size(), MemoryCategory::Activations),
      pool_keys(static_cast<size_t>(
                    indexer ? std::max<int64_t>(1, capacity_tokens / c.index_kpool) * c.index_head_dim : 0),
                MemoryCategory::Activations) {}

DsaCacheGrad::DsaCacheGrad(const ModelConfig& c, const DsaCache& cache, int64_t sequence_tokens,
                           int64_t chunk_tokens, bool indexer, cudaStream_t stream)
    : tokens(sequence_tokens),
      kv(static_cast<size_t>(sequence_tokens * cache.row), MemoryCategory::Activations),
      pool_keys(static_cast<size_t>(
                    indexer ? std::max<int64_t>(1, sequence_tokens / c.index_kpool) * c.index_head_dim : 0),
                MemoryCategory::Activations),
      index_keys(static_cast<size_t>(
                     indexer ? index_window_rows(c, sequence_tokens, chunk_tokens) * c.index_head_dim : 0),
                 MemoryCategory::Activations),
      index_gate(index_keys.size(), MemoryCategory::Activations),
      index_rows_first(sequence_tokens) {
  SPINDLE_CUDA(cudaMemsetAsync(kv.data(), 0, kv.size() * sizeof(float), stream));
  SPINDLE_CUDA(cudaMemsetAsync(pool_keys.data(), 0, pool_keys.size() * sizeof(float), stream));
  SPINDLE_CUDA(cudaMemsetAsync(index_keys.data(), 0, index_keys.size() * sizeof(bf16), stream));
  SPINDLE_CUDA(cudaMemsetAsync(index_gate.data(), 0, index_gate.size() * sizeof(bf16), stream));
}

void dsa_forward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                 DeviceBuffer<int32_t>& selection, bf16* y, bool reuse_selection) {
  DsaCache cache(c, ctx.absorbed_mla, w.has_indexer && !reuse_selection, L);
  dsa_forward(ctx, c, w, x, L, selection, y, reuse_selection, cache);
}

void dsa_forward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                 DeviceBuffer<int32_t>& selection, bf16* y, bool reuse_selection, DsaCache& cache,
                 AttentionKept* keep) {
  check(cache.row == cache_row(c, ctx.absorbed_mla) && cache.tokens + L <= cache.capacity, "DSA cache of ",
        cache.capacity, " tokens (", cache.row, " values each) cannot take tokens ", cache.tokens, " .. ",
        cache.tokens + L, " of this form of MLA");
  const bool select = w.has_indexer && !reuse_selection;
  MlaActivations a = mla_projections(ctx, c, w, x, L, select);
  append_kv(ctx, c, w, L, a.kv_normed.data(), cache);
  if (select) {
    const TimedScope timed = ctx.timed("dsa.indexer");
    append_index_keys(ctx, c, w.indexer, a, L, cache);
    run_indexer(ctx, c, w.indexer, x, a.q_resid.data(), L, cache, cache.tokens, selection);
  }
  check(selection.size() == static_cast<size_t>(L * selection_width(c)),
        "DSA layer without a selection to share");
  if (y == nullptr) {  // the cache's rows and the selection alone
    check(keep == nullptr, "DSA forward without an output keeps nothing");
    cache.tokens += L;
    return;
  }
  {
    const TimedScope timed = ctx.timed("dsa.attention");
    attend(ctx, c, w, L, a, cache.kv.data(), selection.data(), cache.tokens + L);
  }
  ctx.gemm.linear(a.attended.data(), bf16_data(w.o_proj), y, L, c.num_attention_heads * c.v_head_dim,
                  c.hidden_size, ctx.stream());
  cache.tokens += L;
  if (keep == nullptr) return;
  if (ctx.absorbed_mla) {
    keep->union_form = a.union_form;
    keep->out = a.union_form ? std::move(a.attended) : std::move(a.o_lat);
    keep->stats = std::move(a.lse);
  } else {
    keep->out = std::move(a.attended);
  }
}

PoolLists keep_selection(Context& ctx, const ModelConfig& c, const DeviceBuffer<int32_t>& selection,
                         int64_t first, int64_t L) {
  const cpu::IndexerShape shape = indexer_shape(c, first + L, first);
  check(selection.size() == static_cast<size_t>(L * shape.width()), "keep_selection: a selection of ",
        selection.size(), " values for ", L, " queries of width ", shape.width());
  const auto values = static_cast<size_t>(L * selection_pools_per_query(shape));
  PoolLists pools;
  if (pool_lists_fit_16_bits(shape)) {
    pools.narrow = DeviceBuffer<uint16_t>(values, MemoryCategory::Activations);
    selection_to_pools(shape, selection.data(), pools.narrow.data(), ctx.stream());
  } else {
    pools.wide = DeviceBuffer<int32_t>(values, MemoryCategory::Activations);
    selection_to_pools(shape, selection.data(), pools.wide.data(), ctx.stream());
  }
  return pools;
}

void restore_selection(Context& ctx, const ModelConfig& c, const PoolLists& pools, int64_t first, int64_t L,
                       DeviceBuffer<int32_t>& selection) {
  const cpu::IndexerShape shape = indexer_shape(c, first + L, first);
  const bool narrow = pool_lists_fit_16_bits(shape);
  const size_t kept = narrow ? pools.narrow.size() : pools.wide.size();
  check(kept == static_cast<size_t>(L * selection_pools_per_query(shape)), "restore_selection: ", kept,
        " kept pools for ", L, " queries");
  if (selection.size() != static_cast<size_t>(L * shape.width()))
    selection = DeviceBuffer<int32_t>(static_cast<size_t>(L * shape.width()), MemoryCategory::Activations);
  if (narrow)
    pools_to_selection(shape, pools.narrow.data(), selection.data(), ctx.stream());
  else
    pools_to_selection(shape, pools.wide.data(), selection.data(), ctx.stream());
  ctx.record.note("dsa/indexer", "streamed backward: the forward's selection kept as pool lists");
}

void dsa_backward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                  const int32_t* selection, const bf16* dy, float* dx, DsaWeights& grad,
                  IndexerLoss* indexer_loss, bf16* y) {
  // The whole sequence is one chunk over its own cache.
  const bool trained = indexer_loss != nullptr && w.has_indexer && indexer_loss->coef > 0;
  MlaActivations a = mla_projections(ctx, c, w, x, L, trained);
  DsaCache cache(c, ctx.absorbed_mla, trained, L);
  append_kv(ctx, c, w, L, a.kv_normed.data(), cache);
  if (trained) append_index_keys(ctx, c, w.indexer, a, L, cache);
  cache.tokens = L;
  DsaCacheGrad cache_grad(c, cache, L, L, trained, ctx.stream());
  backward_over_cache(ctx, c, w, x, L, a, selection, dy, dx, grad, indexer_loss, cache, 0, cache_grad, y,
                      nullptr);
}

void dsa_backward(Context& ctx, const ModelConfig& c, const DsaWeights& w, const bf16* x, int64_t L,
                  const int32_t* selection, const bf16* dy, float* dx, DsaWeights& grad,
                  IndexerLoss* indexer_loss, const DsaCache& cache, int64_t first, DsaCacheGrad& cache_grad,
                  bf16* y, AttentionKept* kept) {
  MlaActivations a = mla_projections(ctx, c, w, x, L, false, kept != nullptr && !kept->empty());
  backward_over_cache(ctx, c, w, x, L, a, selection, dy, dx, grad, indexer_loss, cache, first, cache_grad, y,
                      kept);
}

}  // namespace spindle::cuda
