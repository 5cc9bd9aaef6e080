// The feed-forward sublayers on the GPU: the dense SwiGLU MLP and the routed experts (router,
// expert-sorted permutation, one cuBLASLt product per expert over its contiguous rows, the experts
// spread over side streams (expert_lanes.h) while the shared expert runs on the main stream,
// weighted deterministic combine). CPU reference: model/mlp.cpp, model/moe.cpp.
#include <optional>
#include <string>

#include "core/error.h"
#include "kernels/cuda/balance_loss.h"
#include "kernels/cuda/convert.h"
#include "kernels/cuda/moe_dispatch.h"
#include "kernels/cuda/moe_ops.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/modules.h"

namespace spindle::cuda {

namespace {

// The first half of every SwiGLU MLP here (the dense one, the shared expert, each routed expert):
// [gate | up] = x W_gate_up^T in one product ([rows, 2I] into gate_up), hidden = the swiglu of each
// row's halves ([rows, I]).
void gate_up_swiglu(Gemm& gemm, const bf16* x, const bf16* w_gate_up, bf16* gate_up, bf16* hidden,
                    int64_t rows, int64_t D, int64_t I, float limit, cudaStream_t s) {
  gemm.linear(x, w_gate_up, gate_up, rows, D, 2 * I, s);
  clamped_swiglu_halves_forward(gate_up, hidden, rows, I, limit, s);
}

}  // namespace

// The dense MLP and the shared expert as the routed experts run theirs: gate_up_swiglu, then the
// down projection.
void mlp_forward(Context& ctx, const MlpWeights& w, double swiglu_limit, const bf16* x, int64_t L, bf16* y,
                 DeviceBuffer<bf16>* keep_gate_up) {
  const int64_t D = w.down_proj.dim(0), I = w.down_proj.dim(1);
  const cudaStream_t s = ctx.stream();
  DeviceBuffer<bf16> gate_up = activations(L * 2 * I), hidden = activations(L * I);
  gate_up_swiglu(ctx.gemm, x, bf16_data(w.gate_up), gate_up.data(), hidden.data(), L, D, I,
                 static_cast<float>(swiglu_limit), s);
  ctx.gemm.linear(hidden.data(), bf16_data(w.down_proj), y, L, I, D, s);
  if (keep_gate_up != nullptr) *keep_gate_up = std::move(gate_up);
  ctx.record.note("mlp/swiglu", "cublaslt bf16 + cuda clamped swiglu");
}

void mlp_backward(Context& ctx, const MlpWeights& w, double swiglu_limit, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, MlpWeights& grad, DeviceBuffer<bf16>* kept_gate_up) {
  const int64_t D = w.down_proj.dim(0), I = w.down_proj.dim(1);
  const cudaStream_t s = ctx.stream();
  const auto limit = static_cast<float>(swiglu_limit);
  Gemm& gemm = ctx.gemm;
  const bool kept = kept_gate_up != nullptr && kept_gate_up->size() != 0;
  check(!kept || kept_gate_up->size() == static_cast<size_t>(L * 2 * I), "MLP backward: a kept product of ",
        kept ? kept_gate_up->size() : 0, " values for ", L, " rows");
  DeviceBuffer<bf16> gate_up = kept ? std::move(*kept_gate_up) : activations(L * 2 * I),
                     hidden = activations(L * I);
  if (kept)
    clamped_swiglu_halves_forward(gate_up.data(), hidden.data(), L, I, limit, s);
  else
    gate_up_swiglu(gemm, x, bf16_data(w.gate_up), gate_up.data(), hidden.data(), L, D, I, limit, s);
  DeviceBuffer<bf16>& dhidden = hidden;  // written after its last read below
  gemm.linear_backward_weight(dy, hidden.data(), f32_data(grad.down_proj), L, I, D, s);
  gemm.linear_backward_input(dy, bf16_data(w.down_proj), dhidden.data(), L, I, D, s);
  // Gate's and up's gradients over their halves of gate_up: against the stacked weights they give
  // the input gradient in one product, which writes dx.
  clamped_swiglu_halves_backward(gate_up.data(), dhidden.data(), L, I, limit, s);
  gemm.linear_backward_input(gate_up.data(), bf16_data(w.gate_up), dx, L, D, 2 * I, 0.0f, s);
  gemm.linear_backward_weight(gate_up.data(), x, f32_data(grad.gate_up), L, D, 2 * I, s);
}

namespace {

cpu::RouterShape router_shape(const ModelConfig& c, int64_t L) {
  return {L,
          c.n_routed_experts,
          c.n_group,
          c.topk_group,
          c.num_experts_per_tok,
          c.norm_topk_prob,
          c.routed_scaling_factor};
}

// Routing and the expert-sorted rows: what both passes start from. host_offsets and lane: once the
// caller has them (wait_for_offsets), or at once where a kept routing was taken.
struct Routing : MoeRouting {
  std::vector<int> lane;    // [experts]: the side stream of each expert's products
  DeviceBuffer<bf16> rows;  // [assignments, hidden]: the gathered inputs
};

Routing route(Context& ctx, const ModelConfig& c, const MoeWeights& w, const bf16* x, int64_t L) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, k = c.num_experts_per_tok, n = L * k;
  const cudaStream_t s = ctx.stream();
  Routing r;
  r.logits = activations_f32(L * E);
  r.weight = activations_f32(n);
  const auto ints = [](int64_t count) {
    return DeviceBuffer<int32_t>(static_cast<size_t>(count), MemoryCategory::Activations);
  };
  r.expert = ints(n);
  r.permutation = ints(n);
  r.inverse = ints(n);
  ctx.gemm.linear(x, bf16_data(w.router), r.logits.data(), L, D, E, s);
  route_tokens(router_shape(c, L), r.logits.data(), f32_data(w.correction_bias), r.expert.data(),
               r.weight.data(), s);
  // The offsets reach the host before the gather: for_each_expert waits for them.
  ctx.permutation.build(r.expert.data(), n, E, r.permutation.data(), r.inverse.data(), s);
  r.rows = activations(n * D);
  gather_expert_rows(x, r.inverse.data(), L, k, D, r.rows.data(), s);
  ctx.record.note("moe/experts", "cublaslt per expert over sorted rows, on " +
                                     std::to_string(ctx.lanes.count()) + " streams");
  return r;
}

// The forward's routing of the same x (moe_backward's `kept`): the rows gathered again, nothing to
// wait for.
Routing take_routing(Context& ctx, const ModelConfig& c, MoeRouting& kept, const bf16* x, int64_t L) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, k = c.num_experts_per_tok, n = L * k;
  check(
      kept.weight.size() == static_cast<size_t>(n) && kept.host_offsets.size() == static_cast<size_t>(E + 1),
      "MoE backward: a kept routing of ", kept.weight.size(), " assignments for ", n);
  Routing r;
  static_cast<MoeRouting&>(r) = std::move(kept);
  kept = MoeRouting();
  r.lane = ctx.lanes.assign(r.host_offsets);
  r.rows = activations(n * D);
  gather_expert_rows(x, r.inverse.data(), L, k, D, r.rows.data(), ctx.stream());
  return r;
}

// The per-expert products need the row offsets on the host: route() had the GPU write them before
// the gather, so that the caller can queue work that does not need them (the shared expert) before
// it waits here, and the GPU runs the gather and that work while the host queues the products.
void wait_for_offsets(Context& ctx, Routing& r) {
  r.host_offsets = ctx.permutation.host_offsets();
  r.lane = ctx.lanes.assign(r.host_offsets);
}

// Calls f(expert, first row, rows, stream) for every expert with at least one row, with its lane's
// stream (between ctx.lanes.fork and join).
template <class F>
void for_each_expert(Context& ctx, const Routing& r, F f) {
  for (size_t e = 0; e + 1 < r.host_offsets.size(); ++e) {
    const int64_t first = r.host_offsets[e], rows = r.host_offsets[e + 1] - first;
    const int lane = r.lane[e];
    if (rows > 0) f(static_cast<int64_t>(e), first, rows, ctx.lanes.stream(lane));
  }
}

// Queues each expert's forward on its lane (after fork; the caller joins): [gate | up] = x
// W_gate_up^T in one product ([rows, 2I]: gate and up are each row's halves), hidden =
// swiglu(gate, up), out = hidden W_down^T.
void queue_experts(Context& ctx, const ModelConfig& c, const MoeWeights& w, const Routing& r, bf16* gate_up,
                   bf16* hidden, bf16* out) {
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
  const auto limit = static_cast<float>(c.swiglu_limit);
  Gemm& gemm = ctx.gemm;
  for_each_expert(ctx, r, [&](int64_t e, int64_t first, int64_t rows, cudaStream_t s) {
    bf16 *gu = gate_up + first * 2 * I, *h = hidden + first * I;
    gate_up_swiglu(gemm, r.rows.data() + first * D, bf16_data(w.experts_gate_up) + e * 2 * I * D, gu, h, rows,
                   D, I, limit, s);
    if (out != nullptr) gemm.linear(h, bf16_data(w.experts_down) + e * D * I, out + first * D, rows, I, D, s);
  });
}

}  // namespace

void moe_forward(Context& ctx, const ModelConfig& c, const MoeWeights& w, const bf16* x, int64_t L, bf16* y,
                 std::vector<int64_t>* load, float* router_logits, MoeRouting* keep) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, I = c.moe_intermediate_size,
                k = c.num_experts_per_tok, n = L * k;
  const cudaStream_t s = ctx.stream();
  const bool keep_products = keep != nullptr && keep->keep_products;
  std::optional<TimedScope> part(std::in_place, ctx.timer, "moe.route", s);
  Routing r = route(ctx, c, w, x, L);
  // Every buffer the lanes use exists before they fork: the allocator knows no streams, so a block
  // the main stream frees meanwhile (the shared expert's) must not reach them.
  DeviceBuffer<bf16> gate_up = activations(n * 2 * I), hidden = activations(n * I), out = activations(n * D),
                     shared = activations(L * D);
  ctx.lanes.fork(s);
  part.emplace(ctx.timer, "moe.shared", s);
  DeviceBuffer<bf16> shared_gate_up;
  mlp_forward(ctx, w.shared, c.swiglu_limit, x, L, shared.data(),  // while the host waits for the offsets
              keep_products ? &shared_gate_up : nullptr);
  // From the shared expert's end to the last lane's: the routed products, and any wait for the host.
  part.emplace(ctx.timer, "moe.experts", s);
  wait_for_offsets(ctx, r);
  queue_experts(ctx, c, w, r, gate_up.data(), hidden.data(), out.data());
  ctx.lanes.join(s);
  part.emplace(ctx.timer, "moe.combine", s);
  if (load != nullptr) {
    load->assign(static_cast<size_t>(E), 0);
    for (int64_t e = 0; e < E; ++e)
      (*load)[static_cast<size_t>(e)] =
          r.host_offsets[static_cast<size_t>(e + 1)] - r.host_offsets[static_cast<size_t>(e)];
  }
  if (router_logits != nullptr)
    SPINDLE_CUDA(
        cudaMemcpyAsync(router_logits, r.logits.data(), L * E * sizeof(float), cudaMemcpyDeviceToDevice, s));
  combine_expert_rows(out.data(), r.inverse.data(), r.weight.data(), shared.data(), L, k, D, y, s);
  if (keep != nullptr) *keep = std::move(static_cast<MoeRouting&>(r));
  if (keep_products) {
    keep->gate_up = std::move(gate_up);
    keep->shared_gate_up = std::move(shared_gate_up);
  }
}

void moe_backward(Context& ctx, const ModelConfig& c, const MoeWeights& w, const bf16* x, int64_t L,
                  const bf16* dy, float* dx, MoeWeights& grad, const BalanceLoss* balance, MoeRouting* kept) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, I = c.moe_intermediate_size,
                k = c.num_experts_per_tok, n = L * k;
  const cudaStream_t s = ctx.stream();
  const auto limit = static_cast<float>(c.swiglu_limit);
  Gemm& gemm = ctx.gemm;
  std::optional<TimedScope> part(std::in_place, ctx.timer, "moe.route", s);
  const bool taken = kept != nullptr && !kept->empty();
  Routing r = taken ? take_routing(ctx, c, *kept, x, L) : route(ctx, c, w, x, L);
  const bool products = r.gate_up.size() != 0;
  check(!products || r.gate_up.size() == static_cast<size_t>(n * 2 * I), "MoE backward: kept products of ",
        r.gate_up.size(), " values for ", n, " rows");
  // Every buffer the lanes use exists before they fork: the allocator knows no streams, so a block
  // the main stream frees meanwhile (the shared expert's) must not reach them.
  DeviceBuffer<bf16> gate_up = products ? std::move(r.gate_up) : activations(n * 2 * I),
                     hidden = activations(n * I), dy_rows = activations(n * D), dhidden = activations(n * I);
  DeviceBuffer<float> dweight = activations_f32(n);
  gather_expert_rows(dy, r.inverse.data(), L, k, D, dy_rows.data(), s);
  if (products) clamped_swiglu_halves_forward(gate_up.data(), hidden.data(), n, I, limit, s);
  ctx.lanes.fork(s);
  part.emplace(ctx.timer, "moe.shared_backward", s);
  // The shared expert's backward writes dx first; the experts' scatter and the router's add to it.
  mlp_backward(ctx, w.shared, c.swiglu_limit, x, L, dy, dx, grad.shared, &r.shared_gate_up);
  part.emplace(ctx.timer, "moe.experts_backward", s);
  if (!taken) wait_for_offsets(ctx, r);
  // The experts' gate and up again (unless kept), not their output: dy . out, the weights'
  // gradient, is (dy W_down) . hidden, and g = dy W_down is the product the hidden's gradient
  // needs anyway.
  if (!products) queue_experts(ctx, c, w, r, gate_up.data(), hidden.data(), nullptr);
  DeviceBuffer<bf16>& drows = r.rows;  // each expert's rows, overwritten after their last read
  for_each_expert(ctx, r, [&](int64_t e, int64_t first, int64_t rows, cudaStream_t ls) {
    const bf16 *x_rows = r.rows.data() + first * D, *dy_e = dy_rows.data() + first * D;
    bf16 *gu = gate_up.data() + first * 2 * I, *h = hidden.data() + first * I,
         *dh = dhidden.data() + first * I;
    // y[t] += weight * out with out = hidden W_down^T: from g, dweight = g . hidden, the hidden's
    // gradient weight * g, the down weight's dy^T (weight * hidden).
    gemm.linear_backward_input(dy_e, bf16_data(w.experts_down) + e * D * I, dh, rows, I, D, ls);
    expert_down_backward(r.permutation.data() + first, r.weight.data(), rows, I, dh, h, dweight.data(), ls);
    gemm.linear_backward_weight(dy_e, h, f32_data(grad.experts_down) + e * D * I, rows, I, D, ls);
    // Gate's and up's gradients are the halves of gu's rows: against the expert's stacked [2I, D]
    // weights they give the rows' input gradient in one product, summed in fp32 and rounded once.
    clamped_swiglu_halves_backward(gu, dh, rows, I, limit, ls);
    gemm.linear_backward_weight(gu, x_rows, f32_data(grad.experts_gate_up) + e * 2 * I * D, rows, D, 2 * I,
                                ls);
    gemm.linear_backward_input(gu, bf16_data(w.experts_gate_up) + e * 2 * I * D, drows.data() + first * D,
                               rows, D, 2 * I, ls);
  });
  ctx.lanes.join(s);
  part.emplace(ctx.timer, "moe.router_backward", s);
  scatter_expert_rows_backward(drows.data(), r.inverse.data(), L, k, D, dx, s);

  // The router: through the routing weights, plus the balance loss.
  DeviceBuffer<float> dlogits = activations_f32(L * E);
  route_weights_backward(router_shape(c, L), r.logits.data(), r.expert.data(), dweight.data(), dlogits.data(),
                         s);
  if (balance != nullptr && balance->coef > 0)
    balance_loss_backward(r.logits.data(), balance->counts, L, E, balance->rows, balance->coef,
                          dlogits.data(), s);
  DeviceBuffer<bf16> dlogits16 = activations(L * E);
  f32_to_bf16(dlogits.data(), dlogits16.data(), L * E, s);
  gemm.linear_backward_input(dlogits16.data(), bf16_data(w.router), dx, L, D, E, 1.0f, s);
  gemm.linear_backward_weight(dlogits16.data(), x, f32_data(grad.router), L, D, E, s);
}

}  // namespace spindle::cuda
