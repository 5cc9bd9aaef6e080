// The DSA indexer's training on the GPU against the CPU references (kernels/cpu/dsa.h) on fresh
// random inputs: the attention mass (head widths 32 to 576, 1 to 66 heads, selection widths 32 to
// 4096 + 3), the KL backward (up to 64 heads x 128, 128 pools of 16) and the pooling backward. Selections are
// made by cpu::indexer_select, then given -1 holes; written outputs are poisoned with NaN, accumulated ones
// pre-filled (their increments are compared); references in double on the bf16-rounded inputs.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "gpu_test_util.h"
#include "kernels/cpu/dsa.h"
#include "kernels/cuda/indexer_training.h"

namespace spindle::cuda {
namespace {

// Queries [L, H, d] (bf16-rounded) none of whose dots with the pool keys [P, d] is within 1e-3 of
// zero: each score is a ReLU of such a dot, whose sign fp32 (the GPU) and double (the CPU) may
// disagree on there, and one term that flips moves the pool keys' summed gradient by about 1e-3
// of its norm. A query head with a dot that close is drawn again.
std::vector<float> queries_off_the_kink(int64_t L, int64_t H, int64_t d,
                                        const std::vector<float>& pool_keys) {
  std::vector<float> q = rounded(random_floats(L * H * d));
  const int64_t P = static_cast<int64_t>(pool_keys.size()) / d;
  for (int64_t row = 0; row < L * H; ++row) {
    float* v = q.data() + row * d;
    const auto near_kink = [&] {
      for (int64_t p = 0; p < P; ++p) {
        double z = 0;
        for (int64_t i = 0; i < d; ++i) z += double(v[i]) * pool_keys[p * d + i];
        if (std::abs(z) < 1e-3) return true;
      }
      return false;
    };
    while (near_kink()) {
      const auto fresh = rounded(random_floats(d));
      std::copy(fresh.begin(), fresh.end(), v);
    }
  }
  return q;
}

// The indexer's selection for these inputs, then holes its contract allows beyond the trailing
// -1 it pads with: from t = 1 every 5th row loses one whole chosen run, from t = 2 one slot after
// a run's first, from t = 3 a run's first slot (the run then names no pool; its other slots stay).
std::vector<int32_t> select_with_holes(const cpu::IndexerShape& s, const std::vector<float>& q,
                                       const std::vector<float>& pool_keys,
                                       const std::vector<float>& weights) {
  const int64_t width = s.width(), kp = s.kpool;
  const auto qd = to_double(q), kd = to_double(pool_keys), wd = to_double(weights);
  std::vector<int32_t> sel(static_cast<size_t>(s.tokens * width));
  cpu::indexer_select<double>(s, qd.data(), kd.data(), wd.data(), sel.data());
  for (int64_t t = 0; t < s.tokens; ++t) {
    int32_t* row = sel.data() + t * width;
    int64_t used = 0;
    while ((used + 1) * kp <= s.topk && row[used * kp] >= 0) ++used;
    if (used == 0) continue;
    int32_t* run = row + std::uniform_int_distribution<int64_t>(0, used - 1)(rng()) * kp;
    if (t % 5 == 1)
      std::fill(run, run + kp, -1);
    else if (t % 5 == 2 && kp > 1)
      run[std::uniform_int_distribution<int64_t>(1, kp - 1)(rng())] = -1;
    else if (t % 5 == 3)
      run[0] = -1;
  }
  return sel;
}

TEST(CudaIndexerTraining, AttentionMassMatchesTheCpu) {
  struct Case {
    int64_t tokens, heads, qk_dim, v_dim, kpool, topk;
    bool tail;
    int64_t kv_heads = 0;  // 1: MLA's absorbed form, one shared latent per token
  };
  const Case cases[] = {
      {300, 4, 64, 32, 4, 32, true},      {300, 8, 64, 64, 4, 32, false},   {300, 66, 32, 16, 4, 32, true},
      {500, 3, 32, 32, 16, 64, true},     {200, 3, 576, 512, 4, 64, true},  {2100, 5, 64, 64, 4, 2048, true},
      {2100, 1, 576, 512, 4, 2048, true}, {4200, 3, 64, 16, 4, 4096, true},  // fewer warps per CTA
      {300, 8, 512, 512, 4, 64, true, 1},
  };
  for (const Case& c : cases) {
    const int64_t L = c.tokens, H = c.heads;
    // Selections from a small random indexer; the attention's own inputs are independent of it.
    const cpu::IndexerShape is{L, 2, 16, c.kpool, c.topk, c.tail};
    const auto sel = select_with_holes(is, rounded(random_floats(L * 2 * 16)),
                                       rounded(random_floats(is.complete_pools() * 16)),
                                       rounded(random_floats(L * 2, 0.5f)));
    const int64_t width = is.width();
    const cpu::SparseAttentionShape s{
        L, H, c.qk_dim, c.v_dim, width, 1.0 / std::sqrt(static_cast<double>(c.qk_dim)), c.kv_heads};
    const auto q = rounded(random_floats(L * H * c.qk_dim)),
               kv = rounded(random_floats(L * s.key_heads() * (c.qk_dim + c.v_dim)));

    Stream stream;
    auto dq = device(to_bf16(q)), dkv = device(to_bf16(kv));
    auto dsel = device(sel);
    auto mass = poisoned<float>(L * width);
    attention_mass(s, dq.data(), dkv.data(), dsel.data(), mass.data(), stream.get());
    stream.synchronize();

    const auto qd = to_double(q), kvd = to_double(kv);
    std::vector<double> ref(static_cast<size_t>(L * width));
    cpu::attention_mass<double>(s, qd.data(), kvd.data(), sel.data(), ref.data());
    // fp32 output: only fp32 dot products, exponentials and sums stand between it and the reference.
    EXPECT_LT(relative_error(mass.download(), ref), 1e-5)
        << "tokens " << L << " heads " << H << " qk_dim " << c.qk_dim << " width " << width;
  }
}

// Whole sequences, and chunks of queries (first_query > 0, as the streaming executor asks: the
// queries' rows from there on, every pool of the sequence) that start inside a pool.
TEST(CudaIndexerTraining, KlBackwardMatchesTheCpu) {
  struct Case {
    int64_t tokens, heads, head_dim, kpool, topk;
    bool tail;
    int64_t first;  // the first query
  };
  const Case cases[] = {{300, 4, 32, 4, 32, true, 0},         {300, 8, 64, 4, 32, false, 0},
                        {777, 3, 32, 16, 128, false, 0},      {600, 64, 128, 4, 256, true, 0},
                        {300, 4, 32, 4, 32, true, 101},       {777, 3, 32, 16, 128, false, 333},
                        {600, 64, 128, 4, 256, true, 450},       // shared memory past 48 KiB
                        {300, 5, 20, 4, 40, true, 0},            // heads, head_dim and runs off the tiles
                        {3000, 32, 128, 16, 2048, true, 1000}};  // the 4B config's indexer
  const float scale = 0.37f;
  for (const Case& c : cases) {
    const cpu::IndexerShape whole{c.tokens, c.heads, c.head_dim, c.kpool, c.topk, c.tail};
    const cpu::IndexerShape s{c.tokens, c.heads, c.head_dim, c.kpool, c.topk, c.tail, c.first};
    const int64_t L = c.tokens, H = c.heads, d = c.head_dim, P = s.complete_pools(), width = s.width();
    const int64_t f = c.first, Q = s.queries();
    const auto pool_keys = rounded(random_floats(P * d)),
               weights = rounded(random_floats(L * H, 1.0f / std::sqrt(static_cast<float>(H))));
    // Every relu closed (q = 0, z = 0 exactly) for t = 6 mod 13: counted, no gradient.
    auto q = queries_off_the_kink(L, H, d, pool_keys);
    for (int64_t t = 6; t < L; t += 13) std::fill(q.begin() + t * H * d, q.begin() + (t + 1) * H * d, 0.0f);
    const auto sel = select_with_holes(whole, q, pool_keys, weights);
    // Attention mass: zero on unused slots (as attention_mass writes it), on whole rows (t = 4
    // mod 11: nothing to learn) and on a row's first run (t = 5 mod 7: a chosen pool of target 0).
    std::vector<float> mass(static_cast<size_t>(L * width));
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    for (int64_t t = 0; t < L; ++t)
      for (int64_t i = 0; i < width; ++i) {
        const bool zero = sel[t * width + i] < 0 || t % 11 == 4 || (t % 7 == 5 && i < c.kpool);
        mass[t * width + i] = zero ? 0.0f : uniform(rng());
      }
    const auto dpool0 = random_floats(P * d, 0.01f);
    const std::vector<double> sums0 = {1.25, 3.0, 2.0};  // accumulated into

    // The device holds the whole sequence's rows and is given the chunk's from row f on.
    Stream stream;
    auto dq_in = device(to_bf16(q)), dk_in = device(to_bf16(pool_keys)), dw_in = device(to_bf16(weights));
    auto dsel = device(sel);
    auto dmass = device(mass);
    auto dq = poisoned<bf16>(Q * H * d), dhw = poisoned<bf16>(Q * H);
    auto dpool = device(dpool0, MemoryCategory::Gradients);
    auto sums = device(sums0, MemoryCategory::Gradients);
    indexer_kl_backward(s, dq_in.data() + f * H * d, dk_in.data(), dw_in.data() + f * H,
                        dsel.data() + f * width, dmass.data() + f * width, scale, dq.data(), dpool.data(),
                        dhw.data(), sums.data(), stream.get());
    stream.synchronize();
    const std::vector<double> sums_got = sums.download();

    // The CPU reference on the chunk's rows.
    const auto rows = [f](const auto& v, int64_t per_row) {
      return std::vector<std::decay_t<decltype(v[0])>>(v.begin() + f * per_row, v.end());
    };
    const auto qd = to_double(rows(q, H * d)), kd = to_double(pool_keys), wd = to_double(rows(weights, H)),
               md = to_double(rows(mass, width));
    const auto sel_rows = rows(sel, width);
    std::vector<double> dq_ref(static_cast<size_t>(Q * H * d)), dhw_ref(static_cast<size_t>(Q * H)),
        dpool_ref(static_cast<size_t>(P * d), 0.0);
    const cpu::IndexerKlSums ref =
        cpu::indexer_kl_backward<double>(s, qd.data(), kd.data(), wd.data(), sel_rows.data(), md.data(),
                                         scale, dq_ref.data(), dpool_ref.data(), dhw_ref.data());
    const auto dq_got = dq.download(), dhw_got = dhw.download();
    const auto dpool_got = dpool.download();
    std::vector<double> dpool_added(dpool_got.size());
    for (size_t i = 0; i < dpool_got.size(); ++i) dpool_added[i] = double(dpool_got[i]) - double(dpool0[i]);
    // Queries with nothing to learn get exact zeros.
    int64_t nonzero_rows = 0;
    for (int64_t t = 0; t < Q; ++t) {
      const auto zero = [](double x) { return x == 0.0; };
      if (!std::all_of(dq_ref.begin() + t * H * d, dq_ref.begin() + (t + 1) * H * d, zero) ||
          !std::all_of(dhw_ref.begin() + t * H, dhw_ref.begin() + (t + 1) * H, zero))
        continue;
      const auto bf16_zero = [](bf16 x) { return __bfloat162float(x) == 0.0f; };
      if (!std::all_of(dq_got.begin() + t * H * d, dq_got.begin() + (t + 1) * H * d, bf16_zero) ||
          !std::all_of(dhw_got.begin() + t * H, dhw_got.begin() + (t + 1) * H, bf16_zero))
        ++nonzero_rows;
    }
    const std::string what = "tokens " + std::to_string(L) + " heads " + std::to_string(H) + " head_dim " +
                             std::to_string(d) + " kpool " + std::to_string(c.kpool) + " topk " +
                             std::to_string(c.topk) + " tail " + std::to_string(c.tail) + " first query " +
                             std::to_string(f);
    ASSERT_GT(ref.kl, 0.0) << what;
    ASSERT_GT(ref.closed, 0) << what;
    // bf16 outputs: one rounding (~2^-9 relative) on top of fp32 arithmetic; dpool and the KL fp32.
    EXPECT_LT(relative_error(dq_got, dq_ref), 8e-3) << "dq, " << what;
    EXPECT_LT(relative_error(dhw_got, dhw_ref), 8e-3) << "dhead_weights, " << what;
    EXPECT_LT(relative_error(dpool_added, dpool_ref), 1e-4) << "dpool_keys, " << what;
    EXPECT_LT(std::abs((sums_got[0] - sums0[0]) - ref.kl) / ref.kl, 1e-5)
        << "kl " << sums_got[0] - sums0[0] << " vs " << ref.kl << ", " << what;
    EXPECT_EQ(sums_got[1] - sums0[1], static_cast<double>(ref.trained)) << "queries trained, " << what;
    EXPECT_EQ(sums_got[2] - sums0[2], static_cast<double>(ref.closed)) << "queries closed, " << what;
    EXPECT_EQ(nonzero_rows, 0) << "queries with nothing to learn, " << what;
  }
}

// kpool 1 is left out: its gate gradients are exactly zero on the CPU and rounding noise on the
// GPU, which a relative error cannot judge.
TEST(CudaIndexerTraining, PoolKeysBackwardMatchesTheCpu) {
  for (auto [L, d, kp] :
       {std::tuple<int64_t, int64_t, int64_t>{300, 64, 4}, {302, 32, 4}, {1027, 128, 16}, {3, 32, 4}}) {
    const cpu::IndexerShape s{L, 1, d, kp, 0, false};
    const int64_t P = s.complete_pools();
    const auto keys = rounded(random_floats(L * d)), gate = rounded(random_floats(L * d)),
               ape = rounded(random_floats(kp * d, 0.5f));
    const auto dpool = random_floats(P * d), dape0 = random_floats(kp * d, 0.1f);
    Stream stream;
    auto dk = device(to_bf16(keys)), dg = device(to_bf16(gate)), da = device(to_bf16(ape));
    auto dp = device(dpool, MemoryCategory::Gradients);
    auto dkeys = poisoned<bf16>(L * d), dgate = poisoned<bf16>(L * d);
    auto dape = device(dape0, MemoryCategory::Gradients);
    indexer_pool_keys_backward(s, dk.data(), dg.data(), da.data(), dp.data(), dkeys.data(), dgate.data(),
                               dape.data(), stream.get());
    stream.synchronize();

    const auto kd = to_double(keys), gd = to_double(gate), ad = to_double(ape), pd = to_double(dpool);
    std::vector<double> dkeys_ref(static_cast<size_t>(L * d)), dgate_ref(static_cast<size_t>(L * d)),
        dape_ref(static_cast<size_t>(kp * d), 0.0);
    cpu::indexer_pool_keys_backward<double>(s, kd.data(), gd.data(), ad.data(), pd.data(), dkeys_ref.data(),
                                            dgate_ref.data(), dape_ref.data());
    const auto dape_got = dape.download();
    std::vector<double> dape_added(dape_got.size());
    for (size_t i = 0; i < dape_got.size(); ++i) dape_added[i] = double(dape_got[i]) - double(dape0[i]);
    const std::string what =
        "tokens " + std::to_string(L) + " head_dim " + std::to_string(d) + " kpool " + std::to_string(kp);
    EXPECT_LT(relative_error(dkeys.download(), dkeys_ref), 8e-3) << "dkeys, " << what;
    EXPECT_LT(relative_error(dgate.download(), dgate_ref), 8e-3) << "dgate, " << what;
    EXPECT_LT(relative_error(dape_added, dape_ref), 1e-5) << "dape, " << what;
  }
}

}  // namespace
}  // namespace spindle::cuda
