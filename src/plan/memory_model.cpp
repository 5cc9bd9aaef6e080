#include "plan/memory_model.h"

#include <algorithm>
#include <deque>
#include <utility>
#include <vector>

#include "core/error.h"
#include "plan/ledger.h"
#include "plan/sublayer_memory.h"

namespace spindle::plan {

namespace {

using Block = Ledger::Block;
using Blocks = std::vector<Block>;

// The fused lm_head + loss (kernels/cuda/lm_loss.cpp): the step's forward_backward keeps a token
// block's logits over the whole vocabulary; its workspace grows to that and stays (a member of
// the Context), for token blocks of at most 2048 rows and vocabulary chunks of at most 16384 (the
// Context's LmHeadLoss defaults).
int64_t head_workspace_bytes(const Shapes& s, int64_t L) {
  const auto floats = [](int64_t n) { return (n + 63) / 64 * 64; };  // 256-byte aligned regions
  const int64_t Lb = std::min<int64_t>(L, 2048), chunk = 16384, C = (std::min(s.vocab, chunk) + 7) / 8 * 8;
  const int64_t chunks = (s.vocab + chunk - 1) / chunk, last = s.vocab - (chunks - 1) * chunk;
  const int64_t kept = (chunks - 1) * floats(Lb * C) + (Lb - 1) * C + last;
  return 4 * (floats(kept) + 4 * floats(Lb) + floats((Lb * C + 1) / 2) + floats(Lb * s.hidden));
}

int64_t stream_bytes(const Shapes& s, int64_t L) { return L * s.streams * s.hidden * 2; }

// residual_site_forward / site_inputs (model/cuda/residual.cpp): the mix (fp32; where `with_mix`,
// else taken from `kept`, a kept mix's block, where that is not empty), pre, post, comb (fp32), the
// collapsed and normalised input (bf16); the sublayer writes its output into `collapsed`.
Blocks site_activations(Ledger& m, const Shapes& s, int64_t L, bool with_mix, Blocks kept = {}) {
  const int64_t H = s.streams;
  Blocks a = std::move(kept);
  if (a.empty() && with_mix) a.push_back(m.activations(4 * L * ((2 + H) * H + 1)));
  a.push_back(m.activations(4 * L * H));
  a.push_back(m.activations(4 * L * H));
  a.push_back(m.activations(4 * L * H * H));
  a.push_back(m.activations(2 * L * s.hidden));
  a.push_back(m.activations(2 * L * s.hidden));
  return a;
}

// The two sublayers of a layer, as residual sites.
enum class Site { Attention, Ffn };

class StepReplay {
 public:
  StepReplay(Ledger& m, const Shapes& s, const Pass& pass) : m_(m), s_(s), pass_(pass) {}

  // residual_site_forward; `select`: the forward proper, where a DSA layer makes its selection.
  // With `keep_mix`, the site's mHC mix stays there for its backward, with `keep_routing` a MoE's
  // routing.
  void site_forward(const LayerShape& layer, Site site, bool select, Blocks& selections,
                    Blocks* keep_mix = nullptr, Blocks* keep_routing = nullptr) {
    Blocks a = site_activations(m_, s_, pass_.tokens, keep_mix != nullptr);
    if (site == Site::Ffn)
      ffn_forward(m_, s_, layer, pass_, keep_routing);
    else if (Block chosen = attention_forward(m_, s_, layer, pass_, select); chosen.bytes() > 0)
      selections.push_back(std::move(chosen));
    if (keep_mix != nullptr) keep_mix->push_back(std::move(a.front()));
  }

  // residual_site_backward: the site's inputs, the feed-forward recomputed for the combine (an
  // attention sublayer's backward writes its output itself), the combine's gradients, the
  // sublayer's backward (which recomputes it), the mHC coefficients' workspace; the input's
  // gradient replaces `dstreams`. `kept` (freed here): the recomputation's kept outputs of this
  // site (the feed-forward's y; attention_kept, after the attention's y with rebuild_ffn_inputs),
  // empty for none; `mix` (freed here): its kept
  // mHC mix, from which the coefficients come without the product; `routing` (freed in the
  // feed-forward's backward): a MoE's kept routing; `projections_kept`: `kept` holds a KDA layer's
  // input projections.
  void site_backward(const LayerShape& layer, Site site, Block& dstreams, Blocks kept, Blocks mix,
                     Blocks routing = {}, bool projections_kept = false) {
    const int64_t L = pass_.tokens, H = s_.streams, D = s_.hidden;
    Blocks a = site_activations(m_, s_, L, true, std::move(mix));
    const bool y_kept = !kept.empty() && (site == Site::Ffn || pass_.rebuild_ffn_inputs);
    if (!y_kept) {
      a.push_back(m_.activations(2 * L * D));  // y
    } else if (site == Site::Attention) {
      a.push_back(std::move(kept.front()));
      kept.erase(kept.begin());
    }
    if (site == Site::Ffn && kept.empty()) ffn_forward(m_, s_, layer, pass_);
    Block d_in = m_.activations(stream_bytes(s_, L));
    a.push_back(m_.activations(4 * L * H));      // d_post
    a.push_back(m_.activations(4 * L * H * H));  // d_comb
    a.push_back(m_.activations(4 * L * D));      // d_normed
    a.push_back(m_.activations(2 * L * D));      // dy
    if (site == Site::Ffn)
      ffn_backward(m_, s_, layer, pass_, std::move(routing));
    else
      attention_backward(m_, s_, layer, pass_, !kept.empty(), projections_kept);
    if (site == Site::Attention) kept.clear();  // the sublayer's backward took and freed them
    // hc_coefficients_backward_workspace: a row of whole float4s a token (w, corr, pre), then w^T split
    const int64_t mixes = (2 + H) * H, row = ((mixes + 3) / 4 * 4 + 1 + H + 3) / 4 * 4;
    a.push_back(m_.activations(4 * L * (row + mixes)));
    dstreams = std::move(d_in);
  }

 private:
  Ledger& m_;
  const Shapes& s_;
  Pass pass_;
};

// loss_and_gradients (model/cuda/model.cpp) over `pass.tokens` tokens, storing site inputs as
// `policy` says: KeepSites (the code as it is) stores both sites' inputs; KeepLayerInputs and
// OffloadLayerInputs store the attention site's (the layer's) input and rebuild the
// feed-forward site's input in the backward by running the attention site forward once more;
// OffloadLayerInputs keeps at most two layer inputs on the device (one in use, one in flight).
void replay_step(Ledger& m, const Shapes& s, const Pass& pass, ActivationPolicy policy) {
  const int64_t L = pass.tokens, S = stream_bytes(s, L);
  const size_t layers = s.layers.size();
  StepReplay step(m, s, pass);
  const bool offload = policy == ActivationPolicy::OffloadLayerInputs;
  const bool all_sites = policy == ActivationPolicy::KeepSites || policy == ActivationPolicy::Stream;

  Block token_ids = m.activations(4 * L);
  Block streams = m.activations(S);
  Block balance_stats = m.workspace(0);  // allocated (empty) even without the balance loss
  Blocks selections;
  std::vector<Block> stored(2 * layers);
  std::deque<size_t> on_device;  // offload: the layer inputs still on the device
  const auto store = [&](size_t index) {
    stored[index] = std::move(streams);
    if (!offload) return;
    on_device.push_back(index);
    if (on_device.size() > 2) {
      stored[on_device.front()] = Block();  // its copy to the pinned pool has landed
      on_device.pop_front();
    }
  };
  std::vector<Blocks> kept(2 * layers);   // Pass::keep_outputs: each site's, until its backward
  std::vector<Blocks> mixes(2 * layers);  // likewise, each site's mHC mix
  std::vector<Blocks> routings(layers);   // and each MoE's routing
  std::vector<Blocks> combines(layers);   // rebuild_ffn_inputs: each attention site's post and comb
  const std::vector<bool> projections =
      kda_layers_keeping_projections(s, pass.keep_outputs ? pass.kda_projections_kept : 0);
  for (size_t i = 0; i < layers; ++i) {
    const LayerShape& layer = s.layers[i];
    for (const Site site : {Site::Attention, Site::Ffn}) {
      const size_t index = 2 * i + static_cast<size_t>(site == Site::Ffn);
      Block next = m.activations(S);
      step.site_forward(layer, site, true, selections, pass.keep_outputs ? &mixes[index] : nullptr,
                        pass.keep_outputs && site == Site::Ffn ? &routings[i] : nullptr);
      if (pass.keep_outputs && (site == Site::Ffn || pass.rebuild_ffn_inputs))
        kept[index].push_back(m.activations(2 * L * s.hidden));  // y
      if (pass.keep_outputs && site == Site::Attention)
        for (Block& b : attention_kept(m, s, layer, pass, projections[i]))
          kept[index].push_back(std::move(b));
      if (pass.rebuild_ffn_inputs && site == Site::Attention) {
        combines[i].push_back(m.activations(4 * L * s.streams));
        combines[i].push_back(m.activations(4 * L * s.streams * s.streams));
      }
      if (site == Site::Attention || (all_sites && !pass.rebuild_ffn_inputs))
        store(index);
      else
        streams = Block();
      streams = std::move(next);
    }
  }

  // The exit and head: mean over streams, final norm, fused lm_head + loss and its backward.
  Blocks head;
  head.push_back(m.activations(2 * L * s.hidden));  // mean
  head.push_back(m.activations(2 * L * s.hidden));  // hidden
  streams = Block();
  head.push_back(m.activations(4 * L));             // targets
  head.push_back(m.activations(4 * L));             // log_prob
  head.push_back(m.activations(4));                 // loss
  head.push_back(m.activations(2 * L * s.hidden));  // dhidden
  head.push_back(m.activations(2 * L * s.hidden));  // dmean
  Block dstreams = m.activations(S);
  Block indexer_kl = m.workspace(3 * 8);  // the KL training's three sums

  for (size_t i = layers; i-- > 0;) {
    const LayerShape& layer = s.layers[i];
    if (offload) {  // this layer's input is back; the previous layer's is on its way
      if (stored[2 * i].bytes() == 0) stored[2 * i] = m.activations(S);
      if (i > 0 && stored[2 * i - 2].bytes() == 0) stored[2 * i - 2] = m.activations(S);
    }
    if (!all_sites) {  // rebuild the feed-forward site's input from the layer input
      stored[2 * i + 1] = m.activations(S);
      Blocks none;
      step.site_forward(layer, Site::Attention, false, none);
    }
    if (pass.rebuild_ffn_inputs) {  // residual_site_output
      stored[2 * i + 1] = m.activations(S);
      combines[i].clear();
    }
    step.site_backward(layer, Site::Ffn, dstreams, std::move(kept[2 * i + 1]), std::move(mixes[2 * i + 1]),
                       std::move(routings[i]));
    stored[2 * i + 1] = Block();
    step.site_backward(layer, Site::Attention, dstreams, std::move(kept[2 * i]), std::move(mixes[2 * i]), {},
                       projections[i]);
    stored[2 * i] = Block();
  }
}

}  // namespace

int64_t streaming_carry_bytes(const Shapes& s, int64_t tokens, int64_t chunk_tokens,
                              const StepOptions& options, bool kept_selections) {
  const int64_t chunks = (tokens + chunk_tokens - 1) / chunk_tokens;
  const int64_t state = 4 * s.kda_heads * s.kda_dim * s.kda_dim;
  const int64_t window = (s.conv_kernel - 1) * 3 * s.kda_width();
  const int64_t latent = tokens * (s.kv_rank + s.rope_dim);
  const int64_t pooled = tokens / s.kpool * s.index_dim;
  int64_t bytes = 0;
  for (const LayerShape& layer : s.layers) {
    if (layer.attention == AttentionKind::Kda) {
      bytes += (chunks - 1) * (state + 2 * window);  // forward carries at every later chunk start
      bytes += state + 4 * window;                   // the carry's gradient, one boundary at a time
    } else {
      bytes += 2 * latent + 4 * latent;
      if (layer.own_indexer) {
        // Keys and pool gates before pooling, bf16: the last chunk's alone where every chunk starts on
        // a pool and no KL training reads them back (model/cuda/modules.h, DsaCache).
        const bool chunk_rows = !options.indexer_kl && chunk_tokens % s.kpool == 0;
        const int64_t rows = 2 * 2 * (chunk_rows ? std::min(tokens, chunk_tokens) : tokens) * s.index_dim;
        // The KL's gradients: fp32 pooled keys, and the rows' over a chunk and one straddling pool.
        const int64_t window = 2 * 2 * std::min(tokens, chunk_tokens + s.kpool - 1) * s.index_dim;
        bytes += 2 * pooled + rows + (options.indexer_kl ? 4 * pooled + window : 0);
        // The selections as pool lists, of every chunk the forward pass takes: all but the last
        // (without the balance loss, the default; the last one's recomputation is its forward); 16
        // bits a pool in the chunks whose pools all fit (kernels/cuda/selection_pools.h), else 32.
        for (int64_t k = 0; kept_selections && k + 1 < chunks; ++k)
          bytes += ((k + 1) * chunk_tokens / s.kpool <= kPoolsIn16BitLists ? 2 : 4) * chunk_tokens *
                   s.selected_pools;
      }
    }
  }
  return bytes;
}

MemoryPrediction predict_memory(const Shapes& s, const StateBytes& state, int64_t tokens,
                                const Policy& policy, const StepOptions& options) {
  check(tokens >= 2, "the sequence length must be at least 2 tokens, got ", tokens);
  const bool streamed = policy.activations == ActivationPolicy::Stream;
  check(!streamed || (policy.chunk_tokens > 0 && policy.chunk_tokens <= tokens),
        "a streaming chunk must hold 1 to ", tokens, " tokens, got ", policy.chunk_tokens);
  const int64_t L = streamed ? policy.chunk_tokens : tokens;
  Ledger m;
  // Model state, then what grows on first use and stays: the head's and the permutation's workspaces.
  Block weights = m.take(state.weights, MemoryCategory::Weights);
  Block gradients = m.take(policy.gradients_to_host ? 2 * state.largest_layer_gradients : state.gradients,
                           MemoryCategory::Gradients);
  Block optimizer;
  if (!policy.optimizer_on_host) optimizer = m.take(state.optimizer, MemoryCategory::Optimizer);
  Block head = m.workspace(head_workspace_bytes(s, L));
  Block permutation = m.workspace(permutation_workspace_bytes(s, L));
  Block carries;
  if (streamed) carries = m.activations(streaming_carry_bytes(s, tokens, L, options, !policy.indexer_again));
  const bool keep_outputs = streamed && !policy.outputs_again;
  const bool keep_matrices = keep_outputs && !policy.kda_matrices_again;
  const Pass pass{L,
                  tokens,
                  streamed,
                  options.absorbed,
                  options.indexer_kl,
                  keep_outputs,
                  keep_matrices,
                  keep_matrices && policy.ffn_inputs_again,
                  keep_outputs ? policy.kda_projections_kept : 0};
  replay_step(m, s, pass, policy.activations);

  MemoryPrediction p;
  p.device = m.stats();
  if (policy.activations == ActivationPolicy::OffloadLayerInputs)
    p.pinned_pool = static_cast<int64_t>(s.layers.size()) * stream_bytes(s, tokens);
  const int64_t host_optimizer = !policy.optimizer_on_host  ? 0
                                 : policy.gradients_to_host ? state.host_optimizer_with_gradients
                                                            : state.host_optimizer;
  p.host = kProcessHostBytes + state.host_weights + p.pinned_pool + host_optimizer;
  return p;
}

}  // namespace spindle::plan
