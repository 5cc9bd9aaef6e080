// MLA's sparse attention over a chunk's union and tails (kernels/cuda/union_attention.h) against
// the CPU's sparse attention with per-head keys and values (kernels/cpu/dsa.h) made from the
// latent by kv_b_proj, in double on the bf16-rounded inputs: the union and each query's bits
// against sorting, exactly; the forward's output and log-sum-exp; the backward's dq, the latent's
// gradient (the reference's key and value gradient back through kv_b_proj) and kv_b_proj's. On the
// indexer's layout (pools, then the query's own incomplete pool), pools shared by the chunk's
// queries or each its own, across the fused kernels' blocks of queries and groups of blocks, with a
// chunk at the sequence's start (queries with fewer pools, the first with none).
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "gpu_test_util.h"
#include "kernels/cpu/dsa.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/union_attention.h"

namespace spindle::cuda {
namespace {

// The indexer's layout for the chunk's queries (positions span - queries ..): `pools` complete pools
// of `kpool` tokens (fewer where fewer are complete; -1 after), with `shared` the same draw for all
// queries with one pool in four swapped for another, else each its own draw; then the query's own
// incomplete pool's tokens.
std::vector<int32_t> make_chunk_selection(int64_t span, int64_t queries, int64_t kpool, int64_t pools,
                                          bool shared) {
  const int64_t width = pools * kpool + kpool - 1, first = span - queries;
  std::vector<int32_t> sel(static_cast<size_t>(queries * width), -1);
  const auto draw = [&](int64_t complete) {
    std::vector<int32_t> all(static_cast<size_t>(complete));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng());
    all.resize(static_cast<size_t>(std::min(pools, complete)));
    return all;
  };
  const std::vector<int32_t> base = draw((first + 1) / kpool);
  for (int64_t r = 0; r < queries; ++r) {
    const int64_t t = first + r, complete = (t + 1) / kpool;
    std::vector<int32_t> mine = shared ? base : draw(complete);
    if (shared) {
      for (int32_t& p : mine)
        if (std::uniform_int_distribution<int>(0, 3)(rng()) == 0)
          p = std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(complete - 1))(rng());
      std::sort(mine.begin(), mine.end());
      mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
    }
    std::sort(mine.begin(), mine.end());
    int32_t* row = sel.data() + r * width;
    for (size_t i = 0; i < mine.size(); ++i)
      for (int64_t j = 0; j < kpool; ++j) row[i * kpool + j] = static_cast<int32_t>(mine[i] * kpool + j);
    const int64_t tail = (t + 1) % kpool;
    for (int64_t j = 0; j < tail; ++j) row[pools * kpool + j] = static_cast<int32_t>(t + 1 - tail + j);
  }
  return sel;
}

TEST(CudaUnionAttention, ForwardAndBackwardMatchTheCpu) {
  struct Case {
    int64_t span, queries, heads, dqk, dv, rank, stride, kpool, pools;
    bool shared;
  };
  const Case cases[] = {
      {700, 200, 4, 128, 128, 64, 64, 16, 4, true},     // shared pools, blocks of 64 (one partial)
      {900, 300, 3, 128, 128, 96, 100, 8, 8, false},    // each its own, latent rows apart, pools of 8
      {40, 40, 2, 128, 128, 64, 64, 16, 4, true},       // the sequence's start: few pools, none first
      {5000, 4300, 2, 128, 128, 64, 64, 16, 4, false},  // the fused kernels' groups, a large union
  };
  for (const Case& c : cases) {
    const int64_t T = c.span, C = c.queries, H = c.heads, first = T - C, kv_row = H * (c.dqk + c.dv);
    const int64_t width = c.pools * c.kpool + c.kpool - 1;
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dqk));
    const UnionAttentionShape s{
        C, H, c.dqk, c.dv, width, c.pools * c.kpool, first, static_cast<float>(scale)};
    const std::string what = "span " + std::to_string(T) + " queries " + std::to_string(C) + " heads " +
                             std::to_string(H) + " dqk " + std::to_string(c.dqk) + " pools " +
                             std::to_string(c.pools) + (c.shared ? " shared" : " apart");
    const auto sel = make_chunk_selection(T, C, c.kpool, c.pools, c.shared);
    const auto q = rounded(random_floats(C * H * c.dqk)), latent = rounded(random_floats(T * c.stride));
    const auto wkv = rounded(random_floats(kv_row * c.rank, 0.125f)),
               dout = rounded(random_floats(C * H * c.dv));

    Stream stream;
    Gemm gemm;
    auto dsel = device(sel);
    auto dlatent = device(to_bf16(latent)), dwkv = device(to_bf16(wkv));
    const ChunkUnion u = chunk_union(s, dsel.data(), stream.get());
    stream.synchronize();

    // The union of the pool slots and the bits, against sorting.
    std::vector<int32_t> want_keys;
    for (int64_t r = 0; r < C; ++r)
      for (int64_t i = 0; i < s.pooled; ++i)
        if (sel[r * width + i] >= 0) want_keys.push_back(sel[r * width + i]);
    std::sort(want_keys.begin(), want_keys.end());
    want_keys.erase(std::unique(want_keys.begin(), want_keys.end()), want_keys.end());
    ASSERT_EQ(u.count, static_cast<int64_t>(want_keys.size())) << what;
    const int64_t n = u.count;
    if (n > 0) {  // over a limit: the count alone
      const ChunkUnion over = chunk_union(s, dsel.data(), stream.get(), n - 1);
      EXPECT_EQ(over.count, n) << what;
      EXPECT_EQ(over.keys.size() + over.masks.size(), 0u) << what;
    }
    if (n > 0) {
      std::vector<int32_t> keys = u.keys.download();
      keys.resize(static_cast<size_t>(n));
      EXPECT_EQ(keys, want_keys) << what;
      const auto masks = u.masks.download();
      int64_t wrong = 0;
      for (int64_t r = 0; r < C; ++r) {
        std::vector<bool> chose(static_cast<size_t>(n), false);
        for (int64_t i = 0; i < s.pooled; ++i) {
          const int32_t t = sel[r * width + i];
          if (t >= 0) chose[std::lower_bound(keys.begin(), keys.end(), t) - keys.begin()] = true;
        }
        for (int64_t j = 0; j < n; ++j)
          wrong += chose[j] != (((masks[r * u.words + j / 32] >> (j % 32)) & 1u) != 0);
      }
      EXPECT_EQ(wrong, 0) << "mask bits, " << what;
    }

    auto dq_in = device(to_bf16(q)), ddout = device(to_bf16(dout));
    auto out = poisoned<bf16>(C * H * c.dv), dq = poisoned<bf16>(C * H * c.dqk);
    auto lse = poisoned<float>(C * H), mass = poisoned<float>(C * width);
    auto d_latent = device(std::vector<float>(static_cast<size_t>(T * c.stride), 0.0f));
    auto d_wkv = device(std::vector<float>(static_cast<size_t>(kv_row * c.rank), 0.0f));
    const UnionLatent lat{dlatent.data(), c.stride, c.rank, dwkv.data()};
    union_attention_forward(gemm, s, u, lat, dsel.data(), dq_in.data(), out.data(), lse.data(), stream.get());
    union_attention_backward(gemm, s, u, lat, dsel.data(), dq_in.data(), out.data(), lse.data(), ddout.data(),
                             dq.data(), d_latent.data(), d_wkv.data(), mass.data(), stream.get());
    stream.synchronize();

    // The reference: every token's keys and values from its latent, the chunk's queries at their
    // positions (the others select none), then the key and value gradient back through kv_b_proj.
    std::vector<double> kv(static_cast<size_t>(T * kv_row), 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < kv_row; ++j) {
        double sum = 0;
        for (int64_t i = 0; i < c.rank; ++i) sum += wkv[j * c.rank + i] * latent[t * c.stride + i];
        kv[t * kv_row + j] = sum;
      }
    const cpu::SparseAttentionShape ref{T, H, c.dqk, c.dv, width, scale};
    std::vector<double> q_all(static_cast<size_t>(T * H * c.dqk), 0.0),
        dout_all(static_cast<size_t>(T * H * c.dv), 0.0);
    std::vector<int32_t> sel_all(static_cast<size_t>(T * width), -1);
    std::copy(q.begin(), q.end(), q_all.begin() + first * H * c.dqk);
    std::copy(dout.begin(), dout.end(), dout_all.begin() + first * H * c.dv);
    std::copy(sel.begin(), sel.end(), sel_all.begin() + first * width);
    std::vector<double> out_all(static_cast<size_t>(T * H * c.dv)), dq_all(q_all.size()), dkv(kv.size(), 0.0),
        mass_all(static_cast<size_t>(T * width));
    cpu::sparse_attention<double>(ref, q_all.data(), kv.data(), sel_all.data(), out_all.data());
    cpu::sparse_attention_backward<double>(ref, q_all.data(), kv.data(), sel_all.data(), dout_all.data(),
                                           dq_all.data(), dkv.data());
    cpu::attention_mass<double>(ref, q_all.data(), kv.data(), sel_all.data(), mass_all.data());
    std::vector<double> d_latent_ref(static_cast<size_t>(T * c.stride), 0.0),
        d_wkv_ref(static_cast<size_t>(kv_row * c.rank), 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < kv_row; ++j) {
        const double g = dkv[t * kv_row + j];
        if (g == 0.0) continue;
        for (int64_t i = 0; i < c.rank; ++i) {
          d_latent_ref[t * c.stride + i] += g * wkv[j * c.rank + i];
          d_wkv_ref[j * c.rank + i] += g * latent[t * c.stride + i];
        }
      }
    const std::vector<double> out_ref(out_all.begin() + first * H * c.dv, out_all.end()),
        dq_ref(dq_all.begin() + first * H * c.dqk, dq_all.end()),
        mass_ref(mass_all.begin() + first * width, mass_all.end());
    EXPECT_LT(relative_error(out.download(), out_ref), 1.5e-2) << "out, " << what;
    EXPECT_LT(relative_error(dq.download(), dq_ref), 2e-2) << "dq, " << what;
    EXPECT_LT(relative_error(d_latent.download(), d_latent_ref), 2e-2) << "d_latent, " << what;
    EXPECT_LT(relative_error(d_wkv.download(), d_wkv_ref), 2e-2) << "d_kv_b_proj, " << what;
    EXPECT_LT(relative_error(mass.download(), mass_ref), 1e-2) << "attention mass, " << what;
    // The log-sum-exp of each query head over its selected keys (+inf for none).
    const auto lse_got = lse.download();
    double worst = 0;
    for (int64_t r = 0; r < C; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        double mx = -INFINITY, sum = 0;
        std::vector<double> scores;
        for (int64_t i = 0; i < width; ++i) {
          const int32_t t = sel[r * width + i];
          if (t < 0) continue;
          double dot = 0;
          for (int64_t d = 0; d < c.dqk; ++d)
            dot += q[(r * H + h) * c.dqk + d] * kv[t * kv_row + h * (c.dqk + c.dv) + d];
          scores.push_back(dot * scale);
          mx = std::max(mx, dot * scale);
        }
        for (double x : scores) sum += std::exp(x - mx);
        const float got = lse_got[r * H + h];
        if (scores.empty()) {
          EXPECT_TRUE(std::isinf(got) && got > 0) << "lse of a query head with no key, " << what;
          continue;
        }
        worst = std::max(worst, std::abs(got - (mx + std::log(sum))));
      }
    }
    EXPECT_LT(worst, 1e-2) << "lse, " << what;
  }
}

}  // namespace
}  // namespace spindle::cuda
