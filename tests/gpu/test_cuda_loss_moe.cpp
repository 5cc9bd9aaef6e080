// The chunked lm_head loss and the MoE kernels against the CPU references on fresh random
// inputs (seed printed): inputs rounded to bf16 where the GPU stores bf16, the reference run
// in double on those values, relative error within bf16 (or fp32) bounds, outputs poisoned
// with NaN first so every element must be written.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "gpu_test_util.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/moe.h"
#include "kernels/cuda/lm_loss.h"
#include "kernels/cuda/moe_ops.h"

namespace spindle::cuda {
namespace {

// ---------------------------------------------------------------- lm_head + cross-entropy

struct LossCase {
  int64_t L, D, V, chunk, block;
};

TEST(CudaLossMoe, ChunkedLmHeadLossMatchesTheCpu) {
  // V not a multiple of the chunk, L not a multiple of the token block, one chunk / one block,
  // V below one chunk and not a multiple of 8; about 15% of the targets ignored.
  for (const LossCase& c :
       {LossCase{37, 64, 1000, 256, 16}, LossCase{300, 128, 5003, 1024, 128}, LossCase{5, 96, 77, 64, 8},
        LossCase{64, 64, 100, 128, 64}, LossCase{513, 256, 32000, 8192, 200}}) {
    const auto [L, D, V, chunk, block] = c;
    const auto h = rounded(random_floats(L * D)),
               w = rounded(random_floats(V * D, 2.0f / std::sqrt(float(D))));
    std::vector<int32_t> target(L);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(V - 1));
    std::uniform_real_distribution<double> u(0, 1);
    int64_t valid = 0;
    for (auto& t : target) {
      t = u(rng()) < 0.15 ? -1 : pick(rng());
      valid += t >= 0;
    }
    if (valid == 0) {
      target[0] = 0;
      valid = 1;
    }
    const float scale = 1.0f / static_cast<float>(valid);

    Stream stream;
    LmHeadLoss loss_op(chunk, block);
    auto dh = device(to_bf16(h)), dw = device(to_bf16(w), MemoryCategory::Weights);
    auto dt = device(target);
    auto logprob = poisoned<float>(L), lse = poisoned<float>(L), loss = poisoned<float>(1);
    auto dhidden = poisoned<bf16>(L * D), dhidden2 = poisoned<bf16>(L * D);
    DeviceBuffer<float> dweight(V * D, MemoryCategory::Gradients);
    SPINDLE_CUDA(cudaMemset(dweight.data(), 0, V * D * sizeof(float)));
    loss_op.forward(dh.data(), dw.data(), dt.data(), logprob.data(), lse.data(), loss.data(), L, D, V,
                    stream.get());
    // Training's pass: the forward's outputs again (the same products, so the same bits) and the
    // gradients; then without lse, loss and the weight gradient.
    auto logprob2 = poisoned<float>(L), lse2 = poisoned<float>(L), loss2 = poisoned<float>(1);
    loss_op.forward_backward(dh.data(), dw.data(), dt.data(), logprob2.data(), lse2.data(), loss2.data(),
                             scale, dhidden.data(), dweight.data(), L, D, V, stream.get());
    auto logprob3 = poisoned<float>(L);
    loss_op.forward_backward(dh.data(), dw.data(), dt.data(), logprob3.data(), nullptr, nullptr, scale,
                             dhidden2.data(), nullptr, L, D, V, stream.get());
    stream.synchronize();

    // Reference in double: the full logits, log-probs, (softmax - onehot) * scale, linear_backward.
    const auto hd = to_double(h), wd = to_double(w);
    std::vector<double> logits(L * V);
    cpu::linear(hd.data(), wd.data(), logits.data(), L, D, V);
    std::vector<int32_t> safe_target(target);
    for (auto& t : safe_target) t = std::max(t, 0);
    std::vector<double> lp_ref(L);
    cpu::target_log_probs(logits.data(), safe_target.data(), lp_ref.data(), L, V);
    double loss_ref = 0;
    for (int64_t r = 0; r < L; ++r) {
      if (target[r] < 0) lp_ref[r] = 0;
      loss_ref -= lp_ref[r] / static_cast<double>(valid);
    }
    cpu::target_log_probs_backward(logits.data(), safe_target.data(), L, V, static_cast<double>(scale));
    for (int64_t r = 0; r < L; ++r)
      if (target[r] < 0) std::fill(logits.begin() + r * V, logits.begin() + (r + 1) * V, 0.0);
    std::vector<double> dx_ref(L * D, 0.0), dw_ref(V * D, 0.0);
    cpu::linear_backward(hd.data(), wd.data(), logits.data(), dx_ref.data(), dw_ref.data(), L, D, V);

    const std::string where = "L=" + std::to_string(L) + " D=" + std::to_string(D) +
                              " V=" + std::to_string(V) + " chunk=" + std::to_string(chunk) +
                              " block=" + std::to_string(block);
    EXPECT_LT(relative_error(logprob.download(), lp_ref), 1e-4) << "log-probs, " << where;
    EXPECT_LT(relative_error(loss.download(), std::vector<double>{loss_ref}), 1e-4) << "loss, " << where;
    const auto lp_got = logprob.download();
    for (int64_t r = 0; r < L; ++r)
      if (target[r] < 0) {
        EXPECT_EQ(lp_got[r], 0.0f) << "ignored row " << r << ", " << where;
      }
    EXPECT_LT(relative_error(dhidden.download(), dx_ref), 8e-3) << "dhidden, " << where;
    EXPECT_LT(relative_error(dweight.download(), dw_ref), 8e-3) << "dweight, " << where;
    EXPECT_EQ(logprob2.download(), lp_got) << "forward_backward's log-probs, " << where;
    EXPECT_EQ(logprob3.download(), lp_got) << "forward_backward's log-probs without lse, " << where;
    EXPECT_EQ(lse2.download(), lse.download()) << "forward_backward's lse, " << where;
    EXPECT_EQ(loss2.download(), loss.download()) << "forward_backward's loss, " << where;
    const auto dhidden_once = dhidden.download(), dhidden_again = dhidden2.download();
    EXPECT_EQ(std::memcmp(dhidden_once.data(), dhidden_again.data(), dhidden_once.size() * sizeof(bf16)), 0)
        << "dhidden without lse and the weight gradient, " << where;
  }
}

// ---------------------------------------------------------------- clamped SwiGLU

// Gate and up as the halves of each row ([rows, 2 cols], as the MLPs and experts keep them): an odd
// width wider than a block's threads (one element a thread at a time), an expert's 576 (vectors of
// 8) and 580 (vectors of 4).
void check_clamped_swiglu_over_row_halves(int64_t cols) {
  SCOPED_TRACE("cols " + std::to_string(cols));
  const int64_t rows = 173, n = rows * cols;
  const float limit = 7.0f;
  // Wide enough that both clamps hold often; a few inputs exactly at the bounds (gradient passes there).
  auto gate = rounded(random_floats(n, 5.0f)), up = rounded(random_floats(n, 5.0f));
  const auto dout = rounded(random_floats(n));
  for (int64_t i = 0; i < n; i += 997) {
    gate[static_cast<size_t>(i)] = limit;
    up[static_cast<size_t>(i)] = (i / 997) % 2 ? limit : -limit;
  }
  std::vector<float> gate_up(static_cast<size_t>(2 * n));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      gate_up[static_cast<size_t>(r * 2 * cols + c)] = gate[static_cast<size_t>(r * cols + c)];
      gate_up[static_cast<size_t>(r * 2 * cols + cols + c)] = up[static_cast<size_t>(r * cols + c)];
    }
  Stream stream;
  auto dgu = device(to_bf16(gate_up)), dd = device(to_bf16(dout));
  auto out = poisoned<bf16>(n);
  clamped_swiglu_halves_forward(dgu.data(), out.data(), rows, cols, limit, stream.get());
  clamped_swiglu_halves_backward(dgu.data(), dd.data(), rows, cols, limit, stream.get());
  stream.synchronize();
  const auto gd = to_double(gate), ud = to_double(up), dod = to_double(dout);
  std::vector<double> out_ref(n), dgate_ref(n), dup_ref(n);
  cpu::clamped_swiglu(gd.data(), ud.data(), out_ref.data(), n, limit);
  cpu::clamped_swiglu_backward(gd.data(), ud.data(), dod.data(), dgate_ref.data(), dup_ref.data(), n, limit);
  const auto got = dgu.download();
  std::vector<bf16> dgate(static_cast<size_t>(n)), dup(static_cast<size_t>(n));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      dgate[static_cast<size_t>(r * cols + c)] = got[static_cast<size_t>(r * 2 * cols + c)];
      dup[static_cast<size_t>(r * cols + c)] = got[static_cast<size_t>(r * 2 * cols + cols + c)];
    }
  EXPECT_LT(relative_error(out.download(), out_ref), 8e-3);
  EXPECT_LT(relative_error(dgate, dgate_ref), 8e-3);
  EXPECT_LT(relative_error(dup, dup_ref), 8e-3);
  // Zero exactly where a clamp held the input.
  for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
    if (gate[i] > limit) {
      EXPECT_EQ(__bfloat162float(dgate[i]), 0.0f) << i;
    }
    if (up[i] < -limit || up[i] > limit) {
      EXPECT_EQ(__bfloat162float(dup[i]), 0.0f) << i;
    }
  }
}

TEST(CudaLossMoe, ClampedSwigluOverRowHalvesMatchesTheCpu) {
  for (const int64_t cols : {577, 576, 580}) check_clamped_swiglu_over_row_halves(cols);
}

// ---------------------------------------------------------------- router

// Logits and bias with well-separated choices (score + bias), so that fp32 on the GPU and
// double on the CPU cannot order them differently: the choices of a token are a random
// permutation of levels 0.05 + 0.9 * (rank + j) / (E + 1), j uniform in [0, 0.5), so any two
// differ by at least 0.45 / (E + 1) (>= 1.5e-3 for E = 288); the bias is uniform in
// [-0.04, 0.04] and the score = choice - bias lies in (0.01, 0.99). A token whose group scores
// (sums of two choices) come within 1e-4 of each other at the cut between kept and dropped
// groups is drawn again, so no tie or near-tie can decide the result.
void separated_router_inputs(const cpu::RouterShape& s, std::vector<float>& logits,
                             std::vector<float>& bias) {
  const int64_t E = s.experts, G = s.groups, per_group = E / G;
  // A group is scored by its two best experts (the config requires at least two per group);
  // with one, every group would tie and the redraw below would never end.
  ASSERT_GE(per_group, 2) << "test shape with fewer than 2 experts per group";
  std::uniform_real_distribution<double> u(0, 1);
  bias.resize(E);
  for (auto& b : bias) b = static_cast<float>(-0.04 + 0.08 * u(rng()));
  logits.resize(s.tokens * E);
  std::vector<int64_t> rank(E);
  std::vector<double> choice(E), group(G);
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (bool good = false; !good;) {
      std::iota(rank.begin(), rank.end(), int64_t{0});
      std::shuffle(rank.begin(), rank.end(), rng());
      for (int64_t e = 0; e < E; ++e) {
        const double c =
            0.05 + 0.9 * (static_cast<double>(rank[e]) + 0.5 * u(rng())) / static_cast<double>(E + 1);
        const double score = c - bias[e];
        logits[t * E + e] = static_cast<float>(std::log(score / (1 - score)));
        // The choice as the stored (fp32) values give it.
        choice[e] = 1 / (1 + std::exp(-static_cast<double>(logits[t * E + e]))) + bias[e];
      }
      good = true;
      if (s.topk_groups < G) {
        for (int64_t g = 0; g < G; ++g) {
          std::vector<double> c(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
          std::sort(c.rbegin(), c.rend());
          group[g] = c[0] + (per_group > 1 ? c[1] : -INFINITY);
        }
        std::sort(group.rbegin(), group.rend());
        good = group[s.topk_groups - 1] - group[s.topk_groups] > 1e-4;
      }
    }
  }
}

// The host's expert-sorted assignments (as ExpertPermutation builds them): each expert's first
// row, the stable sort of the assignments by expert and its inverse.
struct SortedAssignments {
  std::vector<int32_t> offsets, permutation, inverse;
};

SortedAssignments sorted_assignments(const std::vector<int32_t>& expert, int64_t E) {
  SortedAssignments s;
  s.offsets.assign(E + 1, 0);
  for (int32_t e : expert) ++s.offsets[e + 1];
  for (int64_t e = 0; e < E; ++e) s.offsets[e + 1] += s.offsets[e];
  s.permutation.resize(expert.size());
  std::iota(s.permutation.begin(), s.permutation.end(), 0);
  std::stable_sort(s.permutation.begin(), s.permutation.end(),
                   [&](int32_t a, int32_t b) { return expert[a] < expert[b]; });
  s.inverse.resize(expert.size());
  for (size_t r = 0; r < expert.size(); ++r) s.inverse[s.permutation[r]] = static_cast<int32_t>(r);
  return s;
}

TEST(CudaLossMoe, RouterMatchesTheCpuExactly) {
  // tokens, experts, groups, topk_groups, topk, normalize, scaling
  for (const cpu::RouterShape& s :
       {cpu::RouterShape{100, 8, 1, 1, 2, true, 1.0}, cpu::RouterShape{257, 64, 8, 4, 6, true, 2.5},
        cpu::RouterShape{130, 288, 1, 1, 8, true, 2.5}, cpu::RouterShape{77, 256, 8, 4, 8, true, 1.8},
        cpu::RouterShape{50, 288, 16, 3, 8, false, 1.5}, cpu::RouterShape{33, 32, 16, 4, 4, true, 1.0},
        cpu::RouterShape{1000, 128, 4, 2, 3, true, 2.0}}) {
    const std::string where = "tokens " + std::to_string(s.tokens) + " experts " + std::to_string(s.experts) +
                              " groups " + std::to_string(s.groups) + "/" + std::to_string(s.topk_groups) +
                              " topk " + std::to_string(s.topk);
    const int64_t T = s.tokens, E = s.experts, K = s.topk;
    std::vector<float> logits, bias;
    separated_router_inputs(s, logits, bias);
    Stream stream;
    auto dl = device(logits), db = device(bias);
    auto expert = poisoned<int32_t>(T * K);
    auto weight = poisoned<float>(T * K);
    route_tokens(s, dl.data(), db.data(), expert.data(), weight.data(), stream.get());
    auto perm = poisoned<int32_t>(T * K), inverse = poisoned<int32_t>(T * K);
    ExpertPermutation permutation;
    permutation.build(expert.data(), T * K, E, perm.data(), inverse.data(), stream.get());
    const std::vector<int32_t> offsets = permutation.host_offsets();
    stream.synchronize();

    const auto ld = to_double(logits), bd = to_double(bias);
    std::vector<int32_t> expert_ref(T * K);
    std::vector<double> weight_ref(T * K);
    cpu::route_tokens(s, ld.data(), bd.data(), expert_ref.data(), weight_ref.data());
    const auto expert_got = expert.download();
    EXPECT_EQ(expert_got, expert_ref) << "expert indices, " << where;
    EXPECT_LT(relative_error(weight.download(), weight_ref), 1e-5) << "weights, " << where;

    // Offsets, the stable expert-sorted permutation and its inverse, from the reference choice.
    const SortedAssignments ref = sorted_assignments(expert_ref, E);
    EXPECT_EQ(offsets, ref.offsets) << "offsets, " << where;
    EXPECT_EQ(perm.download(), ref.permutation) << "permutation, " << where;
    EXPECT_EQ(inverse.download(), ref.inverse) << "inverse, " << where;

    // Weight backward on fresh logits (any values: the choice is given) and upstream gradients.
    const auto logits2 = random_floats(T * E, 2.0f), dweight = random_floats(T * K);
    auto dl2 = device(logits2), ddw = device(dweight);
    auto dexp = device(expert_ref);
    auto dlogits = poisoned<float>(T * E);
    route_weights_backward(s, dl2.data(), dexp.data(), ddw.data(), dlogits.data(), stream.get());
    stream.synchronize();
    const auto l2d = to_double(logits2), dwd = to_double(dweight);
    std::vector<double> dlogits_ref(T * E);
    cpu::route_weights_backward(s, l2d.data(), expert_ref.data(), dwd.data(), dlogits_ref.data());
    EXPECT_LT(relative_error(dlogits.download(), dlogits_ref), 1e-5) << "route_weights_backward, " << where;
  }
}

TEST(CudaLossMoe, ExpertPermutationOnUnevenLoads) {
  // Skewed loads (the busiest expert several times the mean) and experts with no tokens; one
  // ExpertPermutation for all cases, its workspace grown on the way: a last tile in part, the
  // model's 16k chunk (32 whole tiles), over 48 KB of shared memory a block (2,048 experts), one
  // assignment; then none.
  struct Case {
    int64_t T, K, E;
  };
  ExpertPermutation permutation;
  Stream stream;
  for (const Case& c : {Case{5000, 8, 288}, Case{16384, 4, 16}, Case{3000, 2, 2048}, Case{1, 1, 4}}) {
    const auto [T, K, E] = c;
    const std::string where =
        "T=" + std::to_string(T) + " K=" + std::to_string(K) + " E=" + std::to_string(E);
    std::vector<int32_t> expert(T * K);
    std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(E - 1)),
        hot(0, static_cast<int32_t>(std::min<int64_t>(E, 8) - 1));
    std::uniform_real_distribution<double> u(0, 1);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> row;
      while (static_cast<int64_t>(row.size()) < K) {
        const int32_t e = u(rng()) < 0.5 ? hot(rng()) : any(rng()) / 2 * 2;  // odd experts past 8 get none
        if (std::find(row.begin(), row.end(), e) == row.end()) row.push_back(e);
      }
      std::copy(row.begin(), row.end(), expert.begin() + t * K);
    }
    auto dexp = device(expert);
    auto perm = poisoned<int32_t>(T * K), inverse = poisoned<int32_t>(T * K);
    permutation.build(dexp.data(), T * K, E, perm.data(), inverse.data(), stream.get());
    const std::vector<int32_t> offsets = permutation.host_offsets();
    stream.synchronize();
    const SortedAssignments ref = sorted_assignments(expert, E);
    EXPECT_EQ(offsets, ref.offsets) << where;
    EXPECT_EQ(perm.download(), ref.permutation) << where;
    EXPECT_EQ(inverse.download(), ref.inverse) << where;
  }
  // No assignments (one-element buffers, not to be touched): every offset zero.
  auto dexp = device(std::vector<int32_t>{3});
  auto perm = poisoned<int32_t>(1), inverse = poisoned<int32_t>(1);
  permutation.build(dexp.data(), 0, 64, perm.data(), inverse.data(), stream.get());
  EXPECT_EQ(permutation.host_offsets(), std::vector<int32_t>(65, 0));
  stream.synchronize();
  EXPECT_EQ(perm.download(), std::vector<int32_t>{-1});
  EXPECT_EQ(inverse.download(), std::vector<int32_t>{-1});
}

}  // namespace
}  // namespace spindle::cuda
