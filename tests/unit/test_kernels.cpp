// Each CPU kernel against a straightforward statement of its formula, in double, on random inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/random.h"
#include "kernels/cpu/dsa.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/mhc.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/norms.h"

namespace spindle::cpu {
namespace {

std::vector<double> random_vector(size_t n, uint64_t seed, double scale = 1.0) {
  Random rng(seed);
  std::vector<double> v(n);
  for (double& x : v) x = rng.normal() * scale;
  return v;
}

double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(Kernels, LinearMatchesTripleLoop) {
  const int64_t M = 37, K = 19, N = 70;
  auto x = random_vector(M * K, 1), w = random_vector(N * K, 2);
  std::vector<double> y(M * N);
  linear(x.data(), w.data(), y.data(), M, K, N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double ref = 0;
      for (int64_t k = 0; k < K; ++k) ref += x[i * K + k] * w[j * K + k];
      EXPECT_NEAR(y[i * N + j], ref, 1e-12);
    }
}

TEST(Kernels, NormsMatchFormulas) {
  const int64_t R = 5, D = 12;
  auto x = random_vector(R * D, 3), w = random_vector(D, 4), b = random_vector(D, 5),
       g = random_vector(R * D, 6);
  std::vector<double> rms(R * D), ln(R * D), gated(R * D), l2 = x;
  rms_norm(x.data(), w.data(), rms.data(), R, D, 1e-5);
  layer_norm(x.data(), w.data(), b.data(), ln.data(), R, D, 1e-6);
  gated_rms_norm(x.data(), w.data(), g.data(), gated.data(), R, D, 1e-5);
  l2_normalize(l2.data(), R, D, 1e-6);
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0, mean = 0;
    for (int64_t i = 0; i < D; ++i) ss += x[r * D + i] * x[r * D + i], mean += x[r * D + i] / D;
    double var = 0;
    for (int64_t i = 0; i < D; ++i) var += (x[r * D + i] - mean) * (x[r * D + i] - mean) / D;
    for (int64_t i = 0; i < D; ++i) {
      const double xi = x[r * D + i];
      EXPECT_NEAR(rms[r * D + i], w[i] * xi / std::sqrt(ss / D + 1e-5), 1e-12);
      EXPECT_NEAR(ln[r * D + i], (xi - mean) / std::sqrt(var + 1e-6) * w[i] + b[i], 1e-12);
      EXPECT_NEAR(gated[r * D + i], w[i] * xi / std::sqrt(ss / D + 1e-5) * sig(g[r * D + i]), 1e-12);
      EXPECT_NEAR(l2[r * D + i], xi / std::sqrt(ss + 1e-6), 1e-12);
    }
  }
}

TEST(Kernels, HyperConnectionCoefficients) {
  const int64_t T = 3, H = 4, D = 6, mix = (2 + H) * H;
  const HcShape s{T, H, D, 1e-5, 1e-6, 20};
  auto streams = random_vector(T * H * D, 7), fn = random_vector(mix * H * D, 8, 0.3),
       base = random_vector(mix, 9);
  std::vector<double> scale = {0.7, 1.3, 0.9};
  std::vector<double> pre(T * H), post(T * H), comb(T * H * H), collapsed(T * D);
  hc_coefficients(s, streams.data(), fn.data(), base.data(), scale.data(), pre.data(), post.data(),
                  comb.data(), collapsed.data());
  for (int64_t t = 0; t < T; ++t) {
    const double* x = streams.data() + t * H * D;
    double ss = 0;
    for (int64_t i = 0; i < H * D; ++i) ss += x[i] * x[i];
    const double inv = 1.0 / std::sqrt(ss / (H * D) + 1e-5);
    std::vector<double> m(mix, 0.0);
    for (int64_t o = 0; o < mix; ++o)
      for (int64_t i = 0; i < H * D; ++i) m[o] += x[i] * inv * fn[o * H * D + i];
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_NEAR(pre[t * H + h], sig(m[h] * scale[0] + base[h]) + 1e-6, 1e-12);
      EXPECT_NEAR(post[t * H + h], 2 * sig(m[H + h] * scale[1] + base[H + h]), 1e-12);
    }
    // After 20 Sinkhorn passes the mixer is doubly stochastic to within the eps terms.
    for (int64_t i = 0; i < H; ++i) {
      double row = 0, col = 0;
      for (int64_t j = 0; j < H; ++j) row += comb[t * H * H + i * H + j], col += comb[t * H * H + j * H + i];
      EXPECT_NEAR(row, 1.0, 1e-3);  // Sinkhorn converges, it does not finish
      EXPECT_NEAR(col, 1.0, 1e-5);
    }
    for (int64_t d = 0; d < D; ++d) {
      double ref = 0;
      for (int64_t h = 0; h < H; ++h) ref += pre[t * H + h] * x[h * D + d];
      EXPECT_NEAR(collapsed[t * D + d], ref, 1e-12);
    }
  }
  // A single iteration is exactly: row softmax + eps, then one column normalisation.
  const HcShape one{1, H, D, 1e-5, 1e-6, 1};
  std::vector<double> comb1(H * H);
  hc_coefficients(one, streams.data(), fn.data(), base.data(), scale.data(), pre.data(), post.data(),
                  comb1.data(), collapsed.data());
  std::vector<double> ref(H * H);
  {
    const double* x = streams.data();
    double ss = 0;
    for (int64_t i = 0; i < H * D; ++i) ss += x[i] * x[i];
    const double inv = 1.0 / std::sqrt(ss / (H * D) + 1e-5);
    for (int64_t i = 0; i < H; ++i) {
      double z = 0;
      for (int64_t j = 0; j < H; ++j) {
        double m = 0;
        for (int64_t k = 0; k < H * D; ++k) m += x[k] * inv * fn[(2 * H + i * H + j) * H * D + k];
        ref[i * H + j] = std::exp(m * scale[2] + base[2 * H + i * H + j]);
        z += ref[i * H + j];
      }
      for (int64_t j = 0; j < H; ++j) ref[i * H + j] = ref[i * H + j] / z + 1e-6;
    }
    for (int64_t j = 0; j < H; ++j) {
      double col = 0;
      for (int64_t i = 0; i < H; ++i) col += ref[i * H + j];
      for (int64_t i = 0; i < H; ++i) ref[i * H + j] /= col + 1e-6;
    }
  }
  for (int64_t i = 0; i < H * H; ++i) EXPECT_NEAR(comb1[i], ref[i], 1e-12);

  std::vector<double> y = random_vector(T * D, 10), out(T * H * D);
  hc_combine(s, streams.data(), y.data(), post.data(), comb.data(), out.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        double ref_v = post[t * H + h] * y[t * D + d];
        for (int64_t j = 0; j < H; ++j) ref_v += comb[t * H * H + j * H + h] * streams[(t * H + j) * D + d];
        EXPECT_NEAR(out[(t * H + h) * D + d], ref_v, 1e-12);
      }
}

TEST(Kernels, CausalConvMatchesFormula) {
  const int64_t L = 9, C = 5, K = 4;
  auto x = random_vector(L * C, 11), w = random_vector(C * K, 12);
  std::vector<double> y(L * C);
  causal_conv_silu(x.data(), w.data(), y.data(), L, C, K);
  for (int64_t t = 0; t < L; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int64_t lag = 0; lag < K; ++lag)  // weight K-1 multiplies the current token
        if (t - lag >= 0) acc += w[c * K + (K - 1 - lag)] * x[(t - lag) * C + c];
      EXPECT_NEAR(y[t * C + c], acc * sig(acc), 1e-12);
    }
}

// The chunked form of the gated delta rule (intra-chunk triangular solve, inter-chunk state),
// written independently of the kernel, must give the kernel's token-by-token result.
TEST(Kernels, KdaRecurrenceMatchesChunkedForm) {
  const int64_t L = 21, H = 2, dk = 4, dv = 3, C = 8;
  auto q = random_vector(L * H * dk, 13, 0.5), k = random_vector(L * H * dk, 14),
       v = random_vector(L * H * dv, 15);
  auto g = random_vector(L * H * dk, 16, 0.3), beta = random_vector(L * H, 17);
  for (double& x : g) x = -std::abs(x);
  for (double& b : beta) b = sig(b);
  l2_normalize(k.data(), L * H, dk, 1e-6);
  std::vector<double> out(L * H * dv), state(H * dk * dv, 0.0);
  kda_recurrence<double>({L, H, dk, dv}, q.data(), k.data(), v.data(), g.data(), beta.data(), out.data(),
                         state.data());

  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> S(dk * dv, 0.0);
    for (int64_t c0 = 0; c0 < L; c0 += C) {
      const int64_t n = std::min(C, L - c0);
      auto at = [&](const std::vector<double>& a, int64_t t, int64_t i, int64_t width) {
        return a[((c0 + t) * H + h) * width + i];
      };
      // Cumulative log decay within the chunk, per key channel.
      std::vector<double> G(n * dk);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < dk; ++i) G[t * dk + i] = (t ? G[(t - 1) * dk + i] : 0.0) + at(g, t, i, dk);
      // Solve for the deltas u_t = beta_t (v_t - S_{t-1}^T k_t) with S_{t-1} written through the
      // chunk-start state and earlier deltas: a unit lower-triangular system.
      std::vector<double> u(n * dv);
      for (int64_t t = 0; t < n; ++t) {
        const double b = beta[(c0 + t) * H + h];
        for (int64_t j = 0; j < dv; ++j) {
          double pred = 0;
          for (int64_t i = 0; i < dk; ++i) pred += std::exp(G[t * dk + i]) * at(k, t, i, dk) * S[i * dv + j];
          for (int64_t s = 0; s < t; ++s) {
            double a = 0;
            for (int64_t i = 0; i < dk; ++i)
              a += at(k, t, i, dk) * std::exp(G[t * dk + i] - G[s * dk + i]) * at(k, s, i, dk);
            pred += a * u[s * dv + j];
          }
          u[t * dv + j] = b * (at(v, t, j, dv) - pred);
        }
      }
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < dv; ++j) {
          double o = 0;
          for (int64_t i = 0; i < dk; ++i) o += std::exp(G[t * dk + i]) * at(q, t, i, dk) * S[i * dv + j];
          for (int64_t s = 0; s <= t; ++s) {
            double a = 0;
            for (int64_t i = 0; i < dk; ++i)
              a += at(q, t, i, dk) * std::exp(G[t * dk + i] - G[s * dk + i]) * at(k, s, i, dk);
            o += a * u[s * dv + j];
          }
          EXPECT_NEAR(out[((c0 + t) * H + h) * dv + j], o, 1e-10) << "t=" << c0 + t << " h=" << h;
        }
      std::vector<double> next(dk * dv);
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) {
          double s_new = std::exp(G[(n - 1) * dk + i]) * S[i * dv + j];
          for (int64_t s = 0; s < n; ++s)
            s_new += std::exp(G[(n - 1) * dk + i] - G[s * dk + i]) * at(k, s, i, dk) * u[s * dv + j];
          next[i * dv + j] = s_new;
        }
      S = next;
    }
    for (int64_t i = 0; i < dk * dv; ++i) EXPECT_NEAR(state[h * dk * dv + i], S[i], 1e-10);
  }
}

TEST(Kernels, IndexerSelectsTopPoolsAndTail) {
  const int64_t L = 45, H = 3, d = 5, kp = 4, topk = 12;
  const IndexerShape s{L, H, d, kp, topk, true};
  auto keys = random_vector(L * d, 18), gate = random_vector(L * d, 19), ape = random_vector(kp * d, 20);
  auto q = random_vector(L * H * d, 21), w = random_vector(L * H, 22);
  const int64_t P = s.complete_pools();
  ASSERT_EQ(P, 11);
  std::vector<double> pk(P * d);
  indexer_pool_keys(s, keys.data(), gate.data(), ape.data(), pk.data());
  for (int64_t p = 0; p < P; ++p)
    for (int64_t c = 0; c < d; ++c) {
      double z = 0, acc = 0;
      for (int64_t j = 0; j < kp; ++j) z += std::exp(gate[(p * kp + j) * d + c] + ape[j * d + c]);
      for (int64_t j = 0; j < kp; ++j)
        acc += std::exp(gate[(p * kp + j) * d + c] + ape[j * d + c]) / z * keys[(p * kp + j) * d + c];
      EXPECT_NEAR(pk[p * d + c], acc, 1e-12);
    }
  std::vector<int32_t> sel(L * s.width());
  indexer_select(s, q.data(), pk.data(), w.data(), sel.data());
  for (int64_t t = 0; t < L; ++t) {
    // Brute force: score every visible pool, keep the best topk/kp, add the tail.
    std::vector<std::pair<double, int64_t>> scores;
    for (int64_t p = 0; p < P && p * kp + kp - 1 <= t; ++p) {
      double sc = 0;
      for (int64_t h = 0; h < H; ++h) {
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += q[(t * H + h) * d + c] * pk[p * d + c];
        sc += w[t * H + h] * std::max(0.0, dot / std::sqrt(double(d)));
      }
      scores.push_back({-sc, p});
    }
    std::sort(scores.begin(), scores.end());
    std::vector<int32_t> want;
    for (size_t i = 0; i < scores.size() && i < size_t(topk / kp); ++i)
      for (int64_t j = 0; j < kp; ++j) want.push_back(int32_t(scores[i].second * kp + j));
    for (int64_t j = t + 1 - (t + 1) % kp; j <= t; ++j) want.push_back(int32_t(j));
    std::vector<int32_t> got;
    for (int64_t i = 0; i < s.width(); ++i)
      if (sel[t * s.width() + i] >= 0) got.push_back(sel[t * s.width() + i]);
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, want) << "query " << t;
    for (int32_t i : got) EXPECT_LE(i, t);
  }
}

// The selections as pool lists give them back exactly, for the whole sequence and for a chunk of
// queries starting inside a pool; with and without the tail, topk a multiple of kpool or not.
TEST(Kernels, SelectionsAsPoolListsComeBackExactly) {
  struct Case {
    int64_t tokens, kpool, topk;
    bool tail;
  };
  for (const Case& c : {Case{45, 4, 12, true}, Case{45, 4, 14, false}, Case{70, 16, 32, true},
                        Case{30, 1, 8, true}, Case{9, 4, 64, true}}) {
    const int64_t H = 2, d = 3;
    IndexerShape s{c.tokens, H, d, c.kpool, c.topk, c.tail};
    const auto q = random_vector(c.tokens * H * d, 40), w = random_vector(c.tokens * H, 41);
    const auto pk = random_vector(std::max<int64_t>(1, s.complete_pools()) * d, 42);
    std::vector<int32_t> whole(c.tokens * s.width());
    indexer_select(s, q.data(), pk.data(), w.data(), whole.data());
    for (const int64_t first : {int64_t{0}, c.tokens / 3 + 1}) {
      s.first_query = first;
      const std::vector<int32_t> want(whole.begin() + first * s.width(), whole.end());
      const int64_t per_query = c.topk / c.kpool;
      std::vector<int32_t> pools(s.queries() * per_query, 7), back(want.size(), 7);
      selection_to_pools(s, want.data(), pools.data());
      pools_to_selection(s, pools.data(), back.data());
      EXPECT_EQ(back, want) << "tokens " << c.tokens << " kpool " << c.kpool << " topk " << c.topk
                            << " from query " << first;
      for (int64_t r = 0; r < s.queries(); ++r)
        for (int64_t i = 0; i < per_query; ++i) {
          const int32_t token = want[r * s.width() + i * c.kpool];
          EXPECT_EQ(pools[r * per_query + i], token < 0 ? -1 : token / c.kpool) << "query " << first + r;
        }
    }
  }
}

TEST(Kernels, SparseAttentionMatchesMaskedDenseAttention) {
  const int64_t L = 13, H = 2, dq = 4, dv = 3, width = 5;
  auto q = random_vector(L * H * dq, 23), kv = random_vector(L * H * (dq + dv), 24);
  Random rng(25);
  std::vector<int32_t> sel(L * width, -1);
  for (int64_t t = 0; t < L; ++t)
    for (int64_t i = 0; i < width; ++i)
      if (rng.uniform() < 0.7 || i == 0) sel[t * width + i] = int32_t(rng.next() % uint64_t(t + 1));
  // Distinct indices per row, as the indexer produces.
  for (int64_t t = 0; t < L; ++t) {
    std::vector<int32_t> seen;
    for (int64_t i = 0; i < width; ++i) {
      int32_t& x = sel[t * width + i];
      if (x >= 0 && std::find(seen.begin(), seen.end(), x) != seen.end()) x = -1;
      if (x >= 0) seen.push_back(x);
    }
  }
  std::vector<double> out(L * H * dv);
  sparse_attention<double>({L, H, dq, dv, width, 0.5}, q.data(), kv.data(), sel.data(), out.data());
  for (int64_t t = 0; t < L; ++t)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> logits(L, -INFINITY);
      for (int64_t i = 0; i < width; ++i) {
        const int32_t s = sel[t * width + i];
        if (s < 0) continue;
        double dot = 0;
        for (int64_t c = 0; c < dq; ++c) dot += q[(t * H + h) * dq + c] * kv[(s * H + h) * (dq + dv) + c];
        logits[s] = dot * 0.5;
      }
      const double mx = *std::max_element(logits.begin(), logits.end());
      double z = 0;
      for (double l : logits) z += std::exp(l - mx);
      for (int64_t c = 0; c < dv; ++c) {
        double ref = 0;
        for (int64_t s = 0; s < L; ++s)
          ref += std::exp(logits[s] - mx) / z * kv[(s * H + h) * (dq + dv) + dq + c];
        EXPECT_NEAR(out[(t * H + h) * dv + c], ref, 1e-12);
      }
    }
}

// Shared keys/values (MLA's absorbed form, kv_heads = 1) are the per-head form with the one
// latent copied into every head: same outputs, same dq, and the shared dkv is the heads' sum.
TEST(Kernels, SparseAttentionWithSharedKeysEqualsReplicatedHeads) {
  const int64_t L = 11, H = 3, dq = 5, dv = 4, width = 6;
  const auto q = random_vector(L * H * dq, 31), latent = random_vector(L * (dq + dv), 32);
  const auto dout = random_vector(L * H * dv, 33);
  std::vector<int32_t> sel(L * width, -1);
  for (int64_t t = 0; t < L; ++t)
    for (int64_t i = 0; i <= std::min<int64_t>(t, width - 1); ++i) sel[t * width + i] = int32_t(t - i);
  std::vector<double> replicated(L * H * (dq + dv));
  for (int64_t t = 0; t < L; ++t)
    for (int64_t h = 0; h < H; ++h)
      std::copy(latent.begin() + t * (dq + dv), latent.begin() + (t + 1) * (dq + dv),
                replicated.begin() + (t * H + h) * (dq + dv));
  const SparseAttentionShape shared{L, H, dq, dv, width, 0.4, 1}, per_head{L, H, dq, dv, width, 0.4};
  std::vector<double> out1(L * H * dv), out2(L * H * dv), dq1(L * H * dq), dq2(L * H * dq);
  std::vector<double> dkv1(L * (dq + dv), 0.0), dkv2(L * H * (dq + dv), 0.0), mass1(L * width),
      mass2(L * width);
  sparse_attention<double>(shared, q.data(), latent.data(), sel.data(), out1.data());
  sparse_attention<double>(per_head, q.data(), replicated.data(), sel.data(), out2.data());
  sparse_attention_backward<double>(shared, q.data(), latent.data(), sel.data(), dout.data(), dq1.data(),
                                    dkv1.data());
  sparse_attention_backward<double>(per_head, q.data(), replicated.data(), sel.data(), dout.data(),
                                    dq2.data(), dkv2.data());
  attention_mass<double>(shared, q.data(), latent.data(), sel.data(), mass1.data());
  attention_mass<double>(per_head, q.data(), replicated.data(), sel.data(), mass2.data());
  for (size_t i = 0; i < out1.size(); ++i) EXPECT_NEAR(out1[i], out2[i], 1e-12);
  for (size_t i = 0; i < dq1.size(); ++i) EXPECT_NEAR(dq1[i], dq2[i], 1e-12);
  for (size_t i = 0; i < mass1.size(); ++i) EXPECT_NEAR(mass1[i], mass2[i], 1e-12);
  for (int64_t t = 0; t < L; ++t)
    for (int64_t c = 0; c < dq + dv; ++c) {
      double sum = 0;
      for (int64_t h = 0; h < H; ++h) sum += dkv2[(t * H + h) * (dq + dv) + c];
      EXPECT_NEAR(dkv1[t * (dq + dv) + c], sum, 1e-12);
    }
}

TEST(Kernels, RouterMatchesBruteForceGroupLimitedTopK) {
  const int64_t T = 40, E = 12, G = 4, TG = 2, K = 3;
  auto logits = random_vector(T * E, 26), bias = random_vector(E, 27, 0.1);
  for (bool normalize : {true, false}) {
    std::vector<int32_t> expert(T * K);
    std::vector<double> weight(T * K);
    route_tokens<double>({T, E, G, TG, K, normalize, 2.5}, logits.data(), bias.data(), expert.data(),
                         weight.data());
    for (int64_t t = 0; t < T; ++t) {
      // Try every pair of groups; the chosen pair has the largest sum of per-group top-2 scores.
      std::vector<double> choice(E), score(E);
      for (int64_t e = 0; e < E; ++e) score[e] = sig(logits[t * E + e]), choice[e] = score[e] + bias[e];
      std::vector<double> gs(G);
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> v(choice.begin() + g * 3, choice.begin() + g * 3 + 3);
        std::sort(v.rbegin(), v.rend());
        gs[g] = v[0] + v[1];
      }
      std::vector<int64_t> order(G);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return gs[a] > gs[b]; });
      std::vector<std::pair<double, int64_t>> cand;
      for (int64_t i = 0; i < TG; ++i)
        for (int64_t e = order[i] * 3; e < order[i] * 3 + 3; ++e) cand.push_back({-choice[e], e});
      std::sort(cand.begin(), cand.end());
      double sum = 0;
      for (int64_t i = 0; i < K; ++i) sum += score[cand[i].second];
      for (int64_t i = 0; i < K; ++i) {
        EXPECT_EQ(expert[t * K + i], cand[i].second);
        const double w = score[cand[i].second] / (normalize ? sum + 1e-20 : 1.0) * 2.5;
        EXPECT_NEAR(weight[t * K + i], w, 1e-12);
      }
    }
  }
}

TEST(Kernels, ClampedSwigluAndLogProbs) {
  std::vector<double> gate = {-3, -0.5, 0.2, 0.9, 4}, up = {-2, 0.3, -0.1, 0.7, 3}, out(5);
  clamped_swiglu(gate.data(), up.data(), out.data(), 5, 0.5);
  for (size_t i = 0; i < 5; ++i) {
    const double g = std::min(gate[i], 0.5), u = std::clamp(up[i], -0.5, 0.5);
    EXPECT_NEAR(out[i], g * sig(g) * u, 1e-15);
  }
  const int64_t R = 4, V = 9;
  auto logits = random_vector(R * V, 28, 5.0);
  std::vector<int32_t> target = {0, 8, 3, 5};
  std::vector<double> lp(R);
  target_log_probs(logits.data(), target.data(), lp.data(), R, V);
  for (int64_t r = 0; r < R; ++r) {
    double z = 0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(logits[r * V + v]);
    EXPECT_NEAR(lp[r], logits[r * V + target[r]] - std::log(z), 1e-12);
  }
}

}  // namespace
}  // namespace spindle::cpu

namespace spindle::cpu {
namespace {

// The delta rule's backward in chunks, last chunk first: each chunk starts from the forward's
// state at its boundary, receives the state gradient of the chunk after it and hands its own
// initial state's gradient to the chunk before. Equal to the backward over the whole sequence.
TEST(Kernels, KdaRecurrenceBackwardInChunksEqualsTheWholeSequence) {
  const int64_t L = 150, H = 2, dk = 4, dv = 3;
  const KdaShape whole{L, H, dk, dv};
  auto q = random_vector(L * H * dk, 41), k = random_vector(L * H * dk, 42),
       v = random_vector(L * H * dv, 43);
  auto g = random_vector(L * H * dk, 44, 0.1), beta = random_vector(L * H, 45),
       dout = random_vector(L * H * dv, 46);
  for (double& x : g) x = -std::abs(x);
  for (double& b : beta) b = 1.0 / (1.0 + std::exp(-b));
  for (size_t i = 0; i < k.size(); i += dk) {  // l2-normalised keys, as the model feeds them
    double n = 0;
    for (int64_t c = 0; c < dk; ++c) n += k[i + c] * k[i + c];
    for (int64_t c = 0; c < dk; ++c) k[i + c] /= std::sqrt(n);
  }
  std::vector<double> dq(q.size()), dk_(k.size()), dv_(v.size()), dg(g.size()), db(beta.size());
  kda_recurrence_backward<double>(whole, q.data(), k.data(), v.data(), g.data(), beta.data(), dout.data(),
                                  dq.data(), dk_.data(), dv_.data(), dg.data(), db.data(), 16);
  for (const std::vector<int64_t>& bounds : {std::vector<int64_t>{0, 70, 150}, {0, 1, 33, 64, 149, 150}}) {
    // States at the chunk boundaries, from the forward.
    const int64_t SS = H * dk * dv;
    std::vector<std::vector<double>> starts;
    std::vector<double> state(SS, 0.0), scratch(L * H * dv);
    for (size_t c = 0; c + 1 < bounds.size(); ++c) {
      starts.push_back(state);
      const int64_t t0 = bounds[c], n = bounds[c + 1] - t0;
      kda_recurrence<double>({n, H, dk, dv}, q.data() + t0 * H * dk, k.data() + t0 * H * dk,
                             v.data() + t0 * H * dv, g.data() + t0 * H * dk, beta.data() + t0 * H,
                             scratch.data(), state.data());
    }
    std::vector<double> cq(q.size()), ck(k.size()), cv(v.size()), cg(g.size()), cb(beta.size());
    std::vector<double> d_next(SS, 0.0), d_here(SS);
    for (size_t c = bounds.size() - 1; c-- > 0;) {
      const int64_t t0 = bounds[c], n = bounds[c + 1] - t0;
      const KdaChunkStates<double> chunk{starts[c].data(), d_next.data(), d_here.data()};
      kda_recurrence_backward<double>({n, H, dk, dv}, q.data() + t0 * H * dk, k.data() + t0 * H * dk,
                                      v.data() + t0 * H * dv, g.data() + t0 * H * dk, beta.data() + t0 * H,
                                      dout.data() + t0 * H * dv, cq.data() + t0 * H * dk,
                                      ck.data() + t0 * H * dk, cv.data() + t0 * H * dv,
                                      cg.data() + t0 * H * dk, cb.data() + t0 * H, 16, chunk);
      d_next = d_here;
    }
    const auto worst = [](const std::vector<double>& a, const std::vector<double>& b) {
      double m = 0, scale = 0;
      for (size_t i = 0; i < a.size(); ++i)
        m = std::max(m, std::abs(a[i] - b[i])), scale = std::max(scale, std::abs(b[i]));
      return m / std::max(scale, 1e-300);
    };
    const std::string where = "chunks ending at " + std::to_string(bounds[1]) + ".., " +
                              std::to_string(bounds.size() - 1) + " chunks";
    EXPECT_LT(worst(cq, dq), 1e-12) << where;
    EXPECT_LT(worst(ck, dk_), 1e-12) << where;
    EXPECT_LT(worst(cv, dv_), 1e-12) << where;
    EXPECT_LT(worst(cg, dg), 1e-12) << where;
    EXPECT_LT(worst(cb, db), 1e-12) << where;
  }
}

}  // namespace
}  // namespace spindle::cpu
