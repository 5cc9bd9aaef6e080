// The sparse attention over a chunk's union (kernels/cuda/union_attention.h) against the CPU's
// sparse attention with per-head keys (kernels/cpu/dsa.h), in double on the bf16-rounded inputs:
// the union and each query's bits against sorting, exactly; the forward's output and log-sum-exp,
// the backward's dq and dkv (scattered back to the tokens: every token outside the union must get
// none), on selections whose queries share most of their tokens, on spread ones, with unused slots,
// across query blocks, and a chunk that selects nothing.
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

// Selections of the chunk's queries (positions span - queries .. span - 1), each over tokens up to
// its own position: with `shared` the same base set for all (what a concentrated indexer picks)
// with one slot in `swap_one_in` swapped for a token of the query's own; else each its own. Slots
// past `used` are -1.
std::vector<int32_t> make_chunk_selection(int64_t span, int64_t queries, int64_t width, int64_t used,
                                          bool shared, int swap_one_in) {
  std::vector<int32_t> sel(static_cast<size_t>(queries * width), -1);
  const int64_t first = span - queries;
  std::vector<int32_t> base(static_cast<size_t>(first));
  std::iota(base.begin(), base.end(), 0);
  std::shuffle(base.begin(), base.end(), rng());
  base.resize(static_cast<size_t>(std::min(used, first)));
  for (int64_t r = 0; r < queries; ++r) {
    const int64_t t = first + r;
    std::vector<int32_t> mine = base;
    if (!shared) {
      mine.resize(static_cast<size_t>(t + 1));
      std::iota(mine.begin(), mine.end(), 0);
      std::shuffle(mine.begin(), mine.end(), rng());
      mine.resize(static_cast<size_t>(std::min<int64_t>(used, t + 1)));
    } else {
      std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(t));
      for (int32_t& x : mine)
        if (std::uniform_int_distribution<int>(0, swap_one_in - 1)(rng()) == 0) x = token(rng());
      std::sort(mine.begin(), mine.end());
      mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
    }
    std::copy(mine.begin(), mine.end(), sel.begin() + r * width);
  }
  return sel;
}

TEST(CudaUnionAttention, ForwardAndBackwardMatchTheCpu) {
  struct Case {
    int64_t span, queries, heads, dqk, dv, width, used;
    bool shared;
    int64_t block;
  };
  const Case cases[] = {
      {700, 200, 4, 128, 128, 79, 64, true, 64},     // concentrated, blocks of 64 (one partial)
      {900, 300, 8, 128, 128, 143, 143, true, 300},  // every slot used, one block
      {600, 150, 3, 64, 32, 40, 31, false, 50},      // spread selections, unused slots, narrow heads
      {300, 100, 2, 192, 128, 16, 0, true, 64},      // nothing selected: zero output, lse +inf
  };
  for (const Case& c : cases) {
    const int64_t T = c.span, C = c.queries, H = c.heads, first = T - C, kv_row = H * (c.dqk + c.dv);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dqk));
    const UnionAttentionShape s{C, H, c.dqk, c.dv, c.width, T, static_cast<float>(scale)};
    const std::string what = "span " + std::to_string(T) + " queries " + std::to_string(C) + " heads " +
                             std::to_string(H) + " dqk " + std::to_string(c.dqk) + " width " +
                             std::to_string(c.width) + " used " + std::to_string(c.used);
    const auto sel = make_chunk_selection(T, C, c.width, c.used, c.shared, 16);
    const auto q = rounded(random_floats(C * H * c.dqk)), kv = rounded(random_floats(T * kv_row));
    const auto dout = rounded(random_floats(C * H * c.dv));

    Stream stream;
    Gemm gemm;
    auto dsel = device(sel);
    const ChunkUnion u = chunk_union(s, dsel.data(), stream.get());
    stream.synchronize();

    // The union and the bits, against sorting.
    std::vector<int32_t> want_keys;
    for (int32_t t : sel)
      if (t >= 0) want_keys.push_back(t);
    std::sort(want_keys.begin(), want_keys.end());
    want_keys.erase(std::unique(want_keys.begin(), want_keys.end()), want_keys.end());
    ASSERT_EQ(u.count, static_cast<int64_t>(want_keys.size())) << what;
    const int64_t n = u.count;
    std::vector<int32_t> keys;
    if (n > 0) {
      keys = u.keys.download();
      keys.resize(static_cast<size_t>(n));
      EXPECT_EQ(keys, want_keys) << what;
      const auto masks = u.masks.download();
      int64_t wrong = 0;
      for (int64_t r = 0; r < C; ++r) {
        std::vector<bool> chose(static_cast<size_t>(n), false);
        for (int64_t i = 0; i < c.width; ++i) {
          const int32_t t = sel[r * c.width + i];
          if (t >= 0) chose[std::lower_bound(keys.begin(), keys.end(), t) - keys.begin()] = true;
        }
        for (int64_t j = 0; j < n; ++j)
          wrong += chose[j] != (((masks[r * u.words + j / 32] >> (j % 32)) & 1u) != 0);
      }
      EXPECT_EQ(wrong, 0) << "mask bits, " << what;
    }

    // The union's keys and values, as the layer would make them from the latent.
    std::vector<float> kv_u(static_cast<size_t>(std::max<int64_t>(n, 1) * kv_row), 0.0f);
    for (int64_t j = 0; j < n; ++j)
      std::copy(kv.begin() + keys[j] * kv_row, kv.begin() + (keys[j] + 1) * kv_row,
                kv_u.begin() + j * kv_row);
    auto dq_in = device(to_bf16(q)), dkv_in = device(to_bf16(kv_u)), ddout = device(to_bf16(dout));
    auto out = poisoned<bf16>(C * H * c.dv), dq = poisoned<bf16>(C * H * c.dqk);
    auto lse = poisoned<float>(C * H);
    auto dkv = poisoned<float>(std::max<int64_t>(n, 1) * kv_row);
    union_attention_forward(gemm, s, u, dq_in.data(), dkv_in.data(), out.data(), lse.data(), c.block,
                            stream.get());
    union_attention_backward(gemm, s, u, dq_in.data(), dkv_in.data(), out.data(), lse.data(), ddout.data(),
                             dq.data(), dkv.data(), c.block, stream.get());
    stream.synchronize();

    // The reference over every token, the chunk's queries at their positions (the others select none).
    const cpu::SparseAttentionShape ref{T, H, c.dqk, c.dv, c.width, scale};
    std::vector<double> q_all(static_cast<size_t>(T * H * c.dqk), 0.0),
        dout_all(static_cast<size_t>(T * H * c.dv), 0.0);
    std::vector<int32_t> sel_all(static_cast<size_t>(T * c.width), -1);
    std::copy(q.begin(), q.end(), q_all.begin() + first * H * c.dqk);
    std::copy(dout.begin(), dout.end(), dout_all.begin() + first * H * c.dv);
    std::copy(sel.begin(), sel.end(), sel_all.begin() + first * c.width);
    const auto kvd = to_double(kv);
    std::vector<double> out_all(static_cast<size_t>(T * H * c.dv)), dq_all(q_all.size()),
        dkv_all(kvd.size(), 0.0);
    cpu::sparse_attention<double>(ref, q_all.data(), kvd.data(), sel_all.data(), out_all.data());
    cpu::sparse_attention_backward<double>(ref, q_all.data(), kvd.data(), sel_all.data(), dout_all.data(),
                                           dq_all.data(), dkv_all.data());
    const std::vector<double> out_ref(out_all.begin() + first * H * c.dv, out_all.end()),
        dq_ref(dq_all.begin() + first * H * c.dqk, dq_all.end());
    EXPECT_LT(relative_error(out.download(), out_ref), 1.5e-2) << "out, " << what;
    if (n > 0) {
      EXPECT_LT(relative_error(dq.download(), dq_ref), 2e-2) << "dq, " << what;
      // dkv back at the union's tokens; zero elsewhere.
      const auto dkv_u = dkv.download();
      std::vector<float> dkv_got(kvd.size(), 0.0f);
      for (int64_t j = 0; j < n; ++j)
        std::copy(dkv_u.begin() + j * kv_row, dkv_u.begin() + (j + 1) * kv_row,
                  dkv_got.begin() + keys[j] * kv_row);
      EXPECT_LT(relative_error(dkv_got, dkv_all), 2e-2) << "dkv, " << what;
    } else {
      const auto got = dq.download();
      EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](bf16 x) { return __bfloat162float(x) == 0.0f; }))
          << "dq of a chunk that selects nothing, " << what;
    }
    // The log-sum-exp of each query head over its selected keys (+inf for none).
    const auto lse_got = lse.download();
    double worst = 0;
    for (int64_t r = 0; r < C; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        double mx = -INFINITY, sum = 0;
        std::vector<double> scores;
        for (int64_t i = 0; i < c.width; ++i) {
          const int32_t t = sel[r * c.width + i];
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
