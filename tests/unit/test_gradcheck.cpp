// Finite-difference checks (double) of every backward pass: each kernel, then the whole model.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <vector>

#include "core/random.h"
#include "kernels/cpu/dsa.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/mhc.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/norms.h"
#include "model/backward.h"
#include "model/forward.h"
#include "model/init.h"

namespace spindle {
namespace {

using Vec = std::vector<double>;

Vec random_vec(size_t n, uint64_t seed, double scale = 1.0) {
  Random rng(seed);
  Vec v(n);
  for (double& x : v) x = rng.normal() * scale;
  return v;
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Compares `analytic` (d objective / d input) with central differences of `objective` over
// every element of `input` (or a strided sample of large ones).
void expect_gradient(const char* what, Vec& input, const Vec& analytic,
                     const std::function<double()>& objective, double tolerance = 1e-6) {
  ASSERT_EQ(input.size(), analytic.size()) << what;
  const size_t stride = input.size() > 400 ? input.size() / 200 : 1;
  for (size_t i = 0; i < input.size(); i += stride) {
    const double saved = input[i], h = 1e-6 * std::max(1.0, std::abs(saved));
    input[i] = saved + h;
    const double up = objective();
    input[i] = saved - h;
    const double down = objective();
    input[i] = saved;
    const double numeric = (up - down) / (2 * h);
    EXPECT_NEAR(analytic[i], numeric, tolerance * std::max(1.0, std::abs(numeric)))
        << what << " element " << i;
  }
}

TEST(GradCheck, Linear) {
  const int64_t M = 5, K = 7, N = 4;
  Vec x = random_vec(M * K, 1), w = random_vec(N * K, 2), r = random_vec(M * N, 3);
  Vec dx(M * K, 0.0), dw(N * K, 0.0);
  cpu::linear_backward(x.data(), w.data(), r.data(), dx.data(), dw.data(), M, K, N);
  auto f = [&] {
    Vec y(M * N);
    cpu::linear(x.data(), w.data(), y.data(), M, K, N);
    return dot(y, r);
  };
  expect_gradient("linear dx", x, dx, f);
  expect_gradient("linear dw", w, dw, f);
}

TEST(GradCheck, Norms) {
  const int64_t R = 3, D = 6;
  Vec x = random_vec(R * D, 4), w = random_vec(D, 5), gate = random_vec(R * D, 6), r = random_vec(R * D, 7);
  {
    Vec dx(R * D), dw(D, 0.0);
    cpu::rms_norm_backward(x.data(), w.data(), r.data(), dx.data(), dw.data(), R, D, 1e-5);
    auto f = [&] {
      Vec y(R * D);
      cpu::rms_norm(x.data(), w.data(), y.data(), R, D, 1e-5);
      return dot(y, r);
    };
    expect_gradient("rms_norm dx", x, dx, f);
    expect_gradient("rms_norm dw", w, dw, f);
  }
  {
    Vec dx(R * D), dgate(R * D), dw(D, 0.0);
    cpu::gated_rms_norm_backward(x.data(), w.data(), gate.data(), r.data(), dx.data(), dgate.data(),
                                 dw.data(), R, D, 1e-5);
    auto f = [&] {
      Vec y(R * D);
      cpu::gated_rms_norm(x.data(), w.data(), gate.data(), y.data(), R, D, 1e-5);
      return dot(y, r);
    };
    expect_gradient("gated dx", x, dx, f);
    expect_gradient("gated dgate", gate, dgate, f);
    expect_gradient("gated dw", w, dw, f);
  }
  {
    Vec dx(R * D);
    cpu::l2_normalize_backward(x.data(), r.data(), dx.data(), R, D, 1e-6);
    auto f = [&] {
      Vec y = x;
      cpu::l2_normalize(y.data(), R, D, 1e-6);
      return dot(y, r);
    };
    expect_gradient("l2 dx", x, dx, f);
  }
}

TEST(GradCheck, HyperConnection) {
  const int64_t T = 3, H = 4, D = 5, mix = (2 + H) * H;
  const cpu::HcShape s{T, H, D, 1e-5, 1e-6, 6};
  Vec streams = random_vec(T * H * D, 8), fn = random_vec(mix * H * D, 9, 0.3),
      base = random_vec(mix, 10, 0.5);
  Vec scale = {0.8, 1.2, 0.9}, y = random_vec(T * D, 11);
  Vec r_out = random_vec(T * H * D, 12), r_collapsed = random_vec(T * D, 13);
  // Objective: r_out . combine(streams, y, post, comb) + r_collapsed . collapsed.
  auto f = [&] {
    Vec pre(T * H), post(T * H), comb(T * H * H), collapsed(T * D), out(T * H * D);
    cpu::hc_coefficients(s, streams.data(), fn.data(), base.data(), scale.data(), pre.data(), post.data(),
                         comb.data(), collapsed.data());
    cpu::hc_combine(s, streams.data(), y.data(), post.data(), comb.data(), out.data());
    return dot(out, r_out) + dot(collapsed, r_collapsed);
  };
  Vec pre(T * H), post(T * H), comb(T * H * H), collapsed(T * D);
  cpu::hc_coefficients(s, streams.data(), fn.data(), base.data(), scale.data(), pre.data(), post.data(),
                       comb.data(), collapsed.data());
  Vec dstreams(T * H * D, 0.0), dy(T * D), d_post(T * H), d_comb(T * H * H), d_pre(T * H, 0.0);
  cpu::hc_combine_backward(s, streams.data(), y.data(), post.data(), comb.data(), r_out.data(),
                           dstreams.data(), dy.data(), d_post.data(), d_comb.data());
  Vec dfn(mix * H * D, 0.0), dbase(mix, 0.0), dscale(3, 0.0);
  cpu::hc_coefficients_backward(s, streams.data(), fn.data(), base.data(), scale.data(), d_pre.data(),
                                d_post.data(), d_comb.data(), r_collapsed.data(), dstreams.data(), dfn.data(),
                                dbase.data(), dscale.data());
  expect_gradient("hc streams", streams, dstreams, f);
  expect_gradient("hc y", y, dy, f);
  expect_gradient("hc fn", fn, dfn, f);
  expect_gradient("hc base", base, dbase, f);
  expect_gradient("hc scale", scale, dscale, f);
}

TEST(GradCheck, ConvAndDeltaRule) {
  const int64_t L = 11, C = 4, K = 4;
  Vec x = random_vec(L * C, 14), w = random_vec(C * K, 15), r = random_vec(L * C, 16);
  Vec dx(L * C), dw(C * K, 0.0);
  cpu::causal_conv_silu_backward(x.data(), w.data(), r.data(), dx.data(), dw.data(), L, C, K);
  auto conv = [&] {
    Vec y(L * C);
    cpu::causal_conv_silu(x.data(), w.data(), y.data(), L, C, K);
    return dot(y, r);
  };
  expect_gradient("conv dx", x, dx, conv);
  expect_gradient("conv dw", w, dw, conv);

  const int64_t T = 13, H = 2, dk = 3, dv = 4;
  Vec q = random_vec(T * H * dk, 17, 0.5), k = random_vec(T * H * dk, 18, 0.5),
      v = random_vec(T * H * dv, 19);
  Vec g = random_vec(T * H * dk, 20, 0.3), beta = random_vec(T * H, 21), ro = random_vec(T * H * dv, 22);
  for (double& b : beta) b = 1 / (1 + std::exp(-b));
  auto rule = [&] {
    Vec out(T * H * dv), state(H * dk * dv, 0.0);
    cpu::kda_recurrence<double>({T, H, dk, dv}, q.data(), k.data(), v.data(), g.data(), beta.data(),
                                out.data(), state.data());
    return dot(out, ro);
  };
  for (int64_t checkpoint : {1, 4, 64}) {
    Vec dq(q.size()), dkk(k.size()), dvv(v.size()), dg(g.size()), db(beta.size());
    cpu::kda_recurrence_backward<double>({T, H, dk, dv}, q.data(), k.data(), v.data(), g.data(), beta.data(),
                                         ro.data(), dq.data(), dkk.data(), dvv.data(), dg.data(), db.data(),
                                         checkpoint);
    expect_gradient("kda dq", q, dq, rule);
    expect_gradient("kda dk", k, dkk, rule);
    expect_gradient("kda dv", v, dvv, rule);
    expect_gradient("kda dg", g, dg, rule);
    expect_gradient("kda dbeta", beta, db, rule);
  }
}

TEST(GradCheck, SparseAttention) {
  const int64_t L = 9, H = 2, dq = 3, dv = 2, width = 4;
  Vec q = random_vec(L * H * dq, 23), kv = random_vec(L * H * (dq + dv), 24), r = random_vec(L * H * dv, 25);
  std::vector<int32_t> sel(L * width, -1);
  for (int64_t t = 0; t < L; ++t)
    for (int64_t i = 0; i <= std::min<int64_t>(t, width - 1); ++i) sel[t * width + i] = int32_t(t - i);
  const cpu::SparseAttentionShape s{L, H, dq, dv, width, 0.6};
  Vec dqv(q.size()), dkv(kv.size(), 0.0);
  cpu::sparse_attention_backward<double>(s, q.data(), kv.data(), sel.data(), r.data(), dqv.data(),
                                         dkv.data());
  auto f = [&] {
    Vec out(L * H * dv);
    cpu::sparse_attention<double>(s, q.data(), kv.data(), sel.data(), out.data());
    return dot(out, r);
  };
  expect_gradient("attention dq", q, dqv, f);
  expect_gradient("attention dkv", kv, dkv, f);
}

TEST(GradCheck, SwigluRouterAndLoss) {
  const int64_t n = 40;
  Vec gate = random_vec(n, 26), up = random_vec(n, 27), r = random_vec(n, 28);
  Vec dgate(n), dup(n);
  cpu::clamped_swiglu_backward(gate.data(), up.data(), r.data(), dgate.data(), dup.data(), n, 0.7);
  auto sw = [&] {
    Vec out(n);
    cpu::clamped_swiglu(gate.data(), up.data(), out.data(), n, 0.7);
    return dot(out, r);
  };
  expect_gradient("swiglu gate", gate, dgate, sw);
  expect_gradient("swiglu up", up, dup, sw);

  const int64_t T = 6, E = 8, K = 3;
  Vec logits = random_vec(T * E, 29), bias = random_vec(E, 30, 0.1), rw = random_vec(T * K, 31);
  for (bool normalize : {true, false}) {
    const cpu::RouterShape s{T, E, 4, 2, K, normalize, 2.5};
    std::vector<int32_t> expert(T * K);
    Vec weight(T * K), dlogits(T * E);
    cpu::route_tokens<double>(s, logits.data(), bias.data(), expert.data(), weight.data());
    cpu::route_weights_backward<double>(s, logits.data(), expert.data(), rw.data(), dlogits.data());
    auto f = [&] {
      std::vector<int32_t> e(T * K);
      Vec wt(T * K);
      cpu::route_tokens<double>(s, logits.data(), bias.data(), e.data(), wt.data());
      return dot(wt, rw);
    };
    expect_gradient("router logits", logits, dlogits, f);
  }

  const int64_t R = 4, V = 7;
  Vec lg = random_vec(R * V, 32);
  std::vector<int32_t> target = {1, 6, 0, 3};
  Vec grad = lg;
  cpu::target_log_probs_backward(grad.data(), target.data(), R, V, 0.5);
  auto loss = [&] {
    Vec lp(R);
    cpu::target_log_probs(lg.data(), target.data(), lp.data(), R, V);
    double s = 0;
    for (double v : lp) s -= 0.5 * v;
    return s;
  };
  expect_gradient("loss logits", lg, grad, loss);
}

// A model from `json` with every parameter moved off its init, and random tokens, in double.
struct RandomModel {
  ModelConfig config;
  ModelWeights weights;
  std::vector<int32_t> tokens;
};

RandomModel random_model(const nlohmann::json& json, uint64_t seed, int64_t length) {
  RandomModel m{parse_model_config(json, "gradcheck"), {}, {}};
  m.weights = allocate_weights(m.config, DType::F64);
  init_weights(m.config, m.weights, seed);
  Random rng(seed + 1);
  for (Param& p : parameter_table(m.config, m.weights)) {
    double* v = p.tensor.data<double>();
    for (int64_t i = 0; i < p.tensor.numel(); ++i) v[i] += 0.1 * rng.normal();
  }
  m.tokens.resize(static_cast<size_t>(length));
  for (int32_t& t : m.tokens) t = static_cast<int32_t>(rng.next() % 16);
  return m;
}

// The whole model: every parameter tensor, sampled, against central differences of the loss.
TEST(GradCheck, WholeModel) {
  nlohmann::json j;
  std::ifstream(std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json") >> j;
  j["linear_lower_bound"] = nullptr;  // exercise the softplus gate too
  j["swiglu_limit"] = 0.5;            // and the clamps
  j["index_topk_pattern"] = "FFFS";
  j["layer_types"] = {"linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                      "linear_attention"};
  j["n_group"] = 2;
  j["topk_group"] = 1;
  RandomModel m = random_model(j, 5, 37);
  const ModelConfig& c = m.config;
  ModelWeights& w = m.weights;
  const std::vector<int32_t>& tokens = m.tokens;
  ModelWeights g = zero_gradients(c, DType::F64);
  const double loss = loss_and_gradients<double>(c, w, tokens, g).loss;
  const auto lp = sequence_log_probs<double>(c, w, tokens);
  double mean = 0;
  for (double v : lp) mean -= v / static_cast<double>(lp.size());
  EXPECT_NEAR(loss, mean, 1e-12);

  auto objective = [&] {
    const auto values = sequence_log_probs<double>(c, w, tokens);
    double s = 0;
    for (double v : values) s -= v / static_cast<double>(values.size());
    return s;
  };
  auto params = parameter_table(c, w);
  auto grads = parameter_table(c, g);
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].role == ParamRole::RouterBias) continue;
    const bool indexer = params[i].name.find(".indexer.") != std::string::npos;
    double* v = params[i].tensor.data<double>();
    const double* d = grads[i].tensor.data<double>();
    const int64_t n = params[i].tensor.numel();
    for (int64_t k = 0; k < n; k += std::max<int64_t>(1, n / 3)) {
      const double saved = v[k], h = 1e-6;
      v[k] = saved + h;
      const double up = objective();
      v[k] = saved - h;
      const double down = objective();
      v[k] = saved;
      // The indexer only chooses (no gradient): its finite difference is zero unless a choice flips.
      const double numeric = indexer ? 0.0 : (up - down) / (2 * h);
      EXPECT_NEAR(d[k], numeric, 1e-6 * std::max(1.0, std::abs(numeric)))
          << params[i].name << "[" << k << "]";
    }
  }
}

// The indexer's KL loss reaches only the indexer; the balance loss reaches the router (and,
// through the routing weights, nothing else): both against central differences.
TEST(GradCheck, IndexerAndBalanceLosses) {
  nlohmann::json j;
  std::ifstream(std::string(SPINDLE_TEST_DATA) + "/configs/tiny.json") >> j;
  j["index_topk"] = 16;  // 2 pools of 8 per query: a real choice and a real distribution
  RandomModel m = random_model(j, 7, 45);
  const ModelConfig& c = m.config;
  ModelWeights& w = m.weights;
  const std::vector<int32_t>& tokens = m.tokens;
  LossOptions options;
  options.indexer_kl_coef = 1.0;
  options.aux_loss_coef = 0.5;
  ModelWeights g = zero_gradients(c, DType::F64);
  const LossResult result = loss_and_gradients<double>(c, w, tokens, g, options);
  EXPECT_GT(result.indexer_kl, 0.0);
  EXPECT_GT(result.aux_loss, 0.0);
  auto evaluate = [&] {
    ModelWeights scratch = zero_gradients(c, DType::F64);
    return loss_and_gradients<double>(c, w, tokens, scratch, options);
  };
  auto params = parameter_table(c, w);
  auto grads = parameter_table(c, g);
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].name;
    const bool indexer = name.find(".indexer.") != std::string::npos;
    if (!indexer && name.find(".mlp.gate.weight") == std::string::npos &&
        name.find("norm.weight") == std::string::npos)
      continue;
    double* v = params[i].tensor.data<double>();
    const double* d = grads[i].tensor.data<double>();
    const int64_t n = params[i].tensor.numel();
    for (int64_t k = 0; k < n; k += std::max<int64_t>(1, n / 4)) {
      const double saved = v[k], h = 1e-6;
      v[k] = saved + h;
      const LossResult up = evaluate();
      v[k] = saved - h;
      const LossResult down = evaluate();
      v[k] = saved;
      const double numeric = indexer
                                 ? (up.indexer_kl - down.indexer_kl) / (2 * h)
                                 : (up.loss + 0.5 * up.aux_loss - down.loss - 0.5 * down.aux_loss) / (2 * h);
      EXPECT_NEAR(d[k], numeric, 1e-6 * std::max(1.0, std::abs(numeric))) << name << "[" << k << "]";
    }
  }
}

}  // namespace
}  // namespace spindle
