// DSA kernels on the GPU against the CPU references (kernels/cpu/dsa.h) on fresh random inputs:
// sparse attention forward and backward for several head widths (16/16, 192/128, 256/256) and
// selection widths (32, 64+15, 2048+15), selections built like the indexer's; MLA's absorbed form
// on the tensor cores (sparse_mla, its wgmma forward where it takes the shape, its backward on
// mma.sync and, for the latent of 512, on wgmma, on selections whose neighbours share pools and on
// ones that are not ordered) against the same reference with one shared latent; the indexer's
// pooling (relative error), tensor-core scores (per-score error bound) and selection (exact, on
// inputs built without near-ties, across the scorer's tiling edges); outputs
// poisoned with NaN before the launch; references in double on the bf16-rounded inputs.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "gpu_test_util.h"
#include "kernels/cpu/dsa.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/selection_pools.h"
#include "kernels/cuda/sparse_attention.h"
#include "kernels/cuda/sparse_mla.h"
#include "kernels/cuda/sparse_mla_backward_hopper.h"
#include "kernels/cuda/sparse_mla_hopper.h"

namespace spindle::cuda {
namespace {

// Selections like the indexer's: distinct indices <= t, -1 for unused slots. Rows vary: full
// (min(t + 1, width) indices), a single index (every 7th row), one row with none (t = 2), random
// counts; half the rows compact and ascending with -1 padding at the end (the indexer's layout),
// half scattered over the slots.
std::vector<int32_t> make_selection(int64_t L, int64_t width) {
  std::vector<int32_t> sel(static_cast<size_t>(L * width), -1);
  std::vector<int32_t> candidates, slots(static_cast<size_t>(width));
  for (int64_t t = 0; t < L; ++t) {
    const int64_t most = std::min<int64_t>(t + 1, width);
    int64_t n;
    if (t == 2)
      n = 0;
    else if (t % 7 == 3)
      n = 1;
    else if (t % 3 == 0)
      n = most;
    else
      n = std::uniform_int_distribution<int64_t>(1, most)(rng());
    candidates.resize(static_cast<size_t>(t + 1));
    std::iota(candidates.begin(), candidates.end(), 0);
    for (int64_t i = 0; i < n; ++i)
      std::swap(candidates[static_cast<size_t>(i)],
                candidates[static_cast<size_t>(std::uniform_int_distribution<int64_t>(i, t)(rng()))]);
    int32_t* row = sel.data() + t * width;
    if (t % 2 == 0) {
      std::sort(candidates.begin(), candidates.begin() + n);
      std::copy(candidates.begin(), candidates.begin() + n, row);
    } else {
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng());
      for (int64_t i = 0; i < n; ++i) row[slots[static_cast<size_t>(i)]] = candidates[static_cast<size_t>(i)];
    }
  }
  return sel;
}

// The indexer's layout (kernels/cuda/selection_pools.h): per query up to topk / kpool whole pools
// of kpool rows before its own, ascending, -1 past them, then the tail of its own pool. The wgmma
// forward moves such pools by TMA.
std::vector<int32_t> make_pool_selection(int64_t L, int64_t topk, int64_t kpool) {
  const int64_t width = topk + kpool - 1, pools = topk / kpool;
  std::vector<int32_t> sel(static_cast<size_t>(L * width), -1);
  std::vector<int32_t> candidates;
  for (int64_t t = 0; t < L; ++t) {
    const int64_t complete = (t + 1) / kpool, n = std::min(pools, complete), tail = (t + 1) % kpool;
    candidates.resize(static_cast<size_t>(complete));
    std::iota(candidates.begin(), candidates.end(), 0);
    std::shuffle(candidates.begin(), candidates.end(), rng());
    std::sort(candidates.begin(), candidates.begin() + n);
    int32_t* row = sel.data() + t * width;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < kpool; ++j)
        row[i * kpool + j] = static_cast<int32_t>(candidates[static_cast<size_t>(i)] * kpool + j);
    for (int64_t j = 0; j < tail; ++j) row[topk + j] = static_cast<int32_t>(t + 1 - tail + j);
  }
  return sel;
}

// The indexer's layout with neighbours that share: groups of `share` queries draw one set of pools
// (among those the group's first query sees), then each query swaps some of them (each other pool
// it sees taking a random slot with probability 1 / swap_one_in) for pools of its own, so that a
// pair of neighbours holds shared rows and rows of its own.
std::vector<int32_t> make_shared_pool_selection(int64_t L, int64_t topk, int64_t kpool, int64_t share,
                                                int swap_one_in) {
  const int64_t width = topk + kpool - 1, pools = topk / kpool;
  std::vector<int32_t> sel(static_cast<size_t>(L * width), -1);
  std::vector<int32_t> group, mine, others;
  for (int64_t t = 0; t < L; ++t) {
    const int64_t complete = (t + 1) / kpool, tail = (t + 1) % kpool;
    if (t % share == 0) {
      group.resize(static_cast<size_t>(complete));
      std::iota(group.begin(), group.end(), 0);
      std::shuffle(group.begin(), group.end(), rng());
      group.resize(static_cast<size_t>(std::min(pools, complete)));
    }
    mine = group;
    others.resize(static_cast<size_t>(complete));
    std::iota(others.begin(), others.end(), 0);
    std::shuffle(others.begin(), others.end(), rng());
    for (int32_t pool : others) {  // some swapped for pools this query does not hold yet
      if (mine.empty() || std::uniform_int_distribution<int>(0, swap_one_in - 1)(rng()) != 0) continue;
      if (std::find(mine.begin(), mine.end(), pool) != mine.end()) continue;
      mine[std::uniform_int_distribution<size_t>(0, mine.size() - 1)(rng())] = pool;
    }
    std::sort(mine.begin(), mine.end());
    mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
    int32_t* row = sel.data() + t * width;
    for (size_t i = 0; i < mine.size(); ++i)
      for (int64_t j = 0; j < kpool; ++j) row[i * kpool + j] = static_cast<int32_t>(mine[i] * kpool + j);
    for (int64_t j = 0; j < tail; ++j) row[topk + j] = static_cast<int32_t>(t + 1 - tail + j);
  }
  return sel;
}

TEST(CudaSparseAttention, ForwardAndBackwardMatchTheCpu) {
  struct Case {
    int64_t dqk, dv, width, tokens, heads, kv_heads;  // kv_heads 0: one key/value head per query head
  };
  const Case cases[] = {
      {16, 16, 32, 300, 3, 0},
      {16, 16, 79, 300, 5, 0},
      {16, 16, 2063, 2100, 2, 0},
      {192, 128, 32, 200, 3, 0},
      {192, 128, 79, 300, 2, 0},
      {192, 128, 2063, 2100, 1, 0},
      {256, 256, 32, 200, 2, 0},
      {256, 256, 79, 200, 2, 0},
      {256, 256, 2063, 2080, 1, 0},
      // MLA's absorbed form: every head reads one shared latent (GLM-5.3-Flash 512, DeepSeek 576),
      // and a grouped case.
      {512, 512, 79, 300, 8, 1},
      {576, 512, 257, 400, 4, 1},
      {16, 16, 32, 300, 4, 2},
  };
  for (const Case& c : cases) {
    const int64_t L = c.tokens, H = c.heads;
    const cpu::SparseAttentionShape s{
        L, H, c.dqk, c.dv, c.width, 1.0 / std::sqrt(static_cast<double>(c.dqk)), c.kv_heads};
    const int64_t KH = s.key_heads();
    const auto q = rounded(random_floats(L * H * c.dqk)),
               kv = rounded(random_floats(L * KH * (c.dqk + c.dv)));
    const auto dout = rounded(random_floats(L * H * c.dv));
    const auto dkv0 = random_floats(L * KH * (c.dqk + c.dv), 0.1f);  // dkv accumulates onto this
    const auto sel = make_selection(L, c.width);

    Stream stream;
    auto dq_in = device(to_bf16(q)), dkv_in = device(to_bf16(kv)), ddout = device(to_bf16(dout));
    auto dsel = device(sel);
    auto out = poisoned<bf16>(L * H * c.dv), dq = poisoned<bf16>(L * H * c.dqk);
    auto dkv = device(dkv0, MemoryCategory::Gradients);
    sparse_attention_forward(s, dq_in.data(), dkv_in.data(), dsel.data(), out.data(), stream.get());
    sparse_attention_backward(s, dq_in.data(), dkv_in.data(), dsel.data(), ddout.data(), dq.data(),
                              dkv.data(), stream.get());
    stream.synchronize();

    const auto qd = to_double(q), kvd = to_double(kv), doutd = to_double(dout);
    std::vector<double> out_ref(static_cast<size_t>(L * H * c.dv)),
        dq_ref(static_cast<size_t>(L * H * c.dqk));
    std::vector<double> dkv_ref = to_double(dkv0);
    cpu::sparse_attention<double>(s, qd.data(), kvd.data(), sel.data(), out_ref.data());
    cpu::sparse_attention_backward<double>(s, qd.data(), kvd.data(), sel.data(), doutd.data(), dq_ref.data(),
                                           dkv_ref.data());
    const std::string what = "dqk " + std::to_string(c.dqk) + " dv " + std::to_string(c.dv) + " width " +
                             std::to_string(c.width) + " tokens " + std::to_string(L) + " heads " +
                             std::to_string(H) + " kv heads " + std::to_string(KH);
    // bf16 outputs: one rounding (~2^-9 relative) on top of fp32 arithmetic; dkv stays fp32.
    EXPECT_LT(relative_error(out.download(), out_ref), 8e-3) << "out, " << what;
    EXPECT_LT(relative_error(dq.download(), dq_ref), 8e-3) << "dq, " << what;
    EXPECT_LT(relative_error(dkv.download(), dkv_ref), 1e-4) << "dkv, " << what;
  }
}

TEST(CudaSparseMla, ForwardAndBackwardMatchTheCpu) {
  struct Case {
    int64_t dk, dv, width, tokens, heads, stride_extra;
    int64_t kpool = 0;    // > 0: the indexer's pools, topk = width - kpool + 1 (else make_selection)
    int64_t share = 0;    // > 0: pools shared by groups of this many neighbours (make_shared_pool_selection)
    int swap_one_in = 4;  // and how rarely each query swaps one of them for its own
  };
  const Case cases[] = {
      {512, 512, 79, 300, 32, 0},     // GLM-5.3-Flash-4b: two m16 tiles of heads
      {256, 256, 2063, 2100, 16, 0},  // the full selection width, one m16 tile
      {128, 128, 32, 200, 16, 0},
      {16, 16, 40, 100, 2, 0},       // the tiny test models' latent: one 16-column unit
      {48, 32, 79, 150, 4, 16},      // units on some warps only, a last k16 step
      {256, 128, 150, 257, 20, 8},   // padded head rows, values narrower than keys, a wider stride
      {128, 128, 64, 130, 40, 512},  // two head groups (32 + 8), the latent inside [c | c] rows
      // The model's shape: pools of 16 by TMA (some -1 early on, tails by cp.async), [c | rope] rows.
      {512, 512, 271, 450, 32, 64, 16},
      {256, 256, 527, 640, 16, 8, 16},
      // Neighbours that share pools (rows the L2 holds for several queries), an odd query count,
      // 16 heads (a query's second m16 tile empty), two head groups.
      {512, 512, 271, 451, 32, 64, 16, 2},
      {512, 512, 527, 700, 16, 0, 16, 4},
      {512, 512, 143, 333, 40, 0, 16, 8},
      // Few swaps: most pairs' unions within 5/4 of a selection, with rows of either query alone (the
      // forward's pairs then share their tiles, each warpgroup masking the other's rows).
      {512, 512, 527, 900, 32, 0, 16, 8, 64},
      // Groups of 3: pairs within a group walk their union with the heads as M, pairs across two
      // groups (past the first 1,000 tokens their union over 3/2 of a selection) a warpgroup per
      // query, in one launch.
      {512, 512, 527, 1500, 16, 0, 16, 3, 64},
      // The same below the latent of 512 (the forward's warpgroup per query, not the pair's heads as M).
      {256, 256, 527, 700, 16, 0, 16, 4, 64},
      {256, 128, 271, 451, 40, 8, 16, 2},
  };
  for (const Case& c : cases) {
    const int64_t L = c.tokens, H = c.heads, stride = c.dk + c.stride_extra;
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
    const SparseMlaShape s{L, H, c.dk, c.dv, c.width, stride, static_cast<float>(scale)};
    ASSERT_EQ(sparse_mla_unsupported(s), "");
    const auto q = rounded(random_floats(L * H * c.dk)), latent = rounded(random_floats(L * stride));
    const auto dout = rounded(random_floats(L * H * c.dv));
    const auto sel =
        c.share > 0   ? make_shared_pool_selection(L, c.width - c.kpool + 1, c.kpool, c.share, c.swap_one_in)
        : c.kpool > 0 ? make_pool_selection(L, c.width - c.kpool + 1, c.kpool)
                      : make_selection(L, c.width);

    Stream stream;
    auto dq_in = device(to_bf16(q)), dlat = device(to_bf16(latent)), ddout = device(to_bf16(dout));
    auto dsel = device(sel);
    auto out = poisoned<bf16>(L * H * c.dv), dq = poisoned<bf16>(L * H * c.dk);
    auto lse = poisoned<float>(L * H);
    DeviceBuffer<float> d_latent(static_cast<size_t>(L * stride), MemoryCategory::Gradients);
    DeviceBuffer<float> mass(static_cast<size_t>(L * c.width), MemoryCategory::Activations);
    sparse_mla_forward(s, dq_in.data(), dlat.data(), dsel.data(), out.data(), lse.data(), stream.get());
    // The backward on mma.sync, then where its kernel takes the shape on wgmma.
    enum Kernel { kMma, kWgmma, kKernels };
    const char* kernel_names[kKernels] = {"mma.sync", "wgmma"};
    const bool runs[kKernels] = {true, sparse_mla_backward_hopper_takes(s)};
    std::vector<bf16> dq_got[kKernels];
    std::vector<float> d_latent_got[kKernels], mass_got[kKernels];
    for (int k = 0; k < kKernels; ++k) {
      if (!runs[k]) continue;
      SPINDLE_CUDA(cudaMemset(d_latent.data(), 0, d_latent.size() * sizeof(float)));
      SPINDLE_CUDA(cudaMemset(mass.data(), 0, mass.size() * sizeof(float)));
      SPINDLE_CUDA(cudaMemset(dq.data(), 0xff, dq.size() * sizeof(bf16)));  // NaN until written
      SPINDLE_CUDA(cudaDeviceSynchronize());
      if (k == kMma)
        sparse_mla_backward_mma(s, dq_in.data(), dlat.data(), dsel.data(), out.data(), lse.data(),
                                ddout.data(), dq.data(), d_latent.data(), mass.data(), stream.get());
      else
        sparse_mla_backward(s, dq_in.data(), dlat.data(), dsel.data(), out.data(), lse.data(), ddout.data(),
                            dq.data(), d_latent.data(), mass.data(), stream.get());
      stream.synchronize();
      dq_got[k] = dq.download();
      d_latent_got[k] = d_latent.download();
      mass_got[k] = mass.download();
    }

    // The reference: one key head whose key is the latent's first dk values and value its first dv.
    const cpu::SparseAttentionShape ref_shape{L, H, c.dk, c.dv, c.width, scale, 1};
    std::vector<double> kv(static_cast<size_t>(L * (c.dk + c.dv)));
    for (int64_t t = 0; t < L; ++t) {
      for (int64_t i = 0; i < c.dk; ++i) kv[t * (c.dk + c.dv) + i] = latent[t * stride + i];
      for (int64_t i = 0; i < c.dv; ++i) kv[t * (c.dk + c.dv) + c.dk + i] = latent[t * stride + i];
    }
    const auto qd = to_double(q), doutd = to_double(dout);
    std::vector<double> out_ref(static_cast<size_t>(L * H * c.dv)), dq_ref(static_cast<size_t>(L * H * c.dk)),
        dkv_ref(kv.size(), 0.0), lse_ref(static_cast<size_t>(L * H)),
        d_latent_ref(static_cast<size_t>(L * stride), 0.0), mass_ref(static_cast<size_t>(L * c.width));
    cpu::sparse_attention<double>(ref_shape, qd.data(), kv.data(), sel.data(), out_ref.data());
    cpu::attention_mass<double>(ref_shape, qd.data(), kv.data(), sel.data(), mass_ref.data());
    cpu::sparse_attention_backward<double>(ref_shape, qd.data(), kv.data(), sel.data(), doutd.data(),
                                           dq_ref.data(), dkv_ref.data());
    for (int64_t t = 0; t < L; ++t) {
      for (int64_t i = 0; i < c.dk; ++i)
        d_latent_ref[t * stride + i] =
            dkv_ref[t * (c.dk + c.dv) + i] + (i < c.dv ? dkv_ref[t * (c.dk + c.dv) + c.dk + i] : 0.0);
      for (int64_t h = 0; h < H; ++h) {
        double mx = -INFINITY, sum = 0;
        std::vector<double> scores;
        for (int64_t slot = 0; slot < c.width; ++slot) {
          const int32_t j = sel[t * c.width + slot];
          if (j < 0) continue;
          double dot = 0;
          for (int64_t i = 0; i < c.dk; ++i) dot += qd[(t * H + h) * c.dk + i] * kv[j * (c.dk + c.dv) + i];
          scores.push_back(dot * scale);
          mx = std::max(mx, dot * scale);
        }
        for (double x : scores) sum += std::exp(x - mx);
        lse_ref[t * H + h] = scores.empty() ? INFINITY : mx + std::log(sum);
      }
    }
    const std::string what = "dk " + std::to_string(c.dk) + " dv " + std::to_string(c.dv) + " width " +
                             std::to_string(c.width) + " tokens " + std::to_string(L) + " heads " +
                             std::to_string(H) + " kpool " + std::to_string(c.kpool) + " share " +
                             std::to_string(c.share);
    // The probabilities and dS enter the tensor cores as bf16 (~2^-9 relative each), on top of the
    // bf16 outputs' own rounding; the latent's gradient stays fp32 but sums bf16 products.
    EXPECT_LT(relative_error(out.download(), out_ref), 1.5e-2) << "out, " << what;
    for (int k = 0; k < kKernels; ++k) {
      if (!runs[k]) continue;
      const std::string kernel = std::string(", ") + kernel_names[k];
      EXPECT_LT(relative_error(dq_got[k], dq_ref), 2e-2) << "dq, " << what << kernel;
      EXPECT_LT(relative_error(d_latent_got[k], d_latent_ref), 2e-2) << "d_latent, " << what << kernel;
      // The mass sums the fp32 probabilities (not their bf16 copies) from fp32 scores and the forward's lse.
      EXPECT_LT(relative_error(mass_got[k], mass_ref), 2e-3) << "mass, " << what << kernel;
    }
    // The wgmma backward took the shapes it is for (GLM's latent of 512).
    EXPECT_EQ(runs[kWgmma], c.dk == 512 && c.dv == 512) << what;
    const auto lse_got = lse.download();
    double worst = 0;
    for (size_t i = 0; i < lse_got.size(); ++i) {
      if (std::isinf(lse_ref[i])) {
        EXPECT_TRUE(std::isinf(lse_got[i]) && lse_got[i] > 0) << "lse of a query with no key, " << what;
        continue;
      }
      worst = std::max(worst, std::abs(lse_got[i] - lse_ref[i]));
    }
    EXPECT_LT(worst, 1e-2) << "lse, " << what;
  }
}

TEST(CudaIndexer, PoolKeysMatchTheCpu) {
  for (auto [L, d, kp] : {std::tuple<int64_t, int64_t, int64_t>{1000, 64, 4}, {1027, 128, 16}, {37, 32, 1}}) {
    const cpu::IndexerShape s{L, 1, d, kp, 0, false};
    const auto keys = rounded(random_floats(L * d)), gate = rounded(random_floats(L * d)),
               ape = rounded(random_floats(kp * d, 0.5f));
    Stream stream;
    auto dk = device(to_bf16(keys)), dg = device(to_bf16(gate)), da = device(to_bf16(ape));
    auto pooled = poisoned<bf16>(s.complete_pools() * d);
    indexer_pool_keys(s, dk.data(), dg.data(), da.data(), pooled.data(), stream.get());
    stream.synchronize();
    const auto kd = to_double(keys), gd = to_double(gate), ad = to_double(ape);
    std::vector<double> ref(static_cast<size_t>(s.complete_pools() * d));
    cpu::indexer_pool_keys<double>(s, kd.data(), gd.data(), ad.data(), ref.data());
    EXPECT_LT(relative_error(pooled.download(), ref), 8e-3) << "L " << L << " d " << d << " kpool " << kp;
  }
}

// Selection must match the CPU exactly, so the inputs have no near-ties by construction: every
// pooled key is a_p * v with v[c] in {+-1, +-0.5, +-0.25} and a_p = bf16(2^u), u uniform in [-3, 3]
// (so a_p * v is exact in bf16), every head weight is positive, and each query head has
// |q_h . v| >= 0.5 (all heads positive but the last, which is negative and so cut by the relu).
// Then score_p = a_p * C_t with C_t > 0 in exact arithmetic: distinct a_p differ by at least one
// bf16 step (2^-8 relative), far above fp32 rounding of the dot products (~1e-5 here), and
// equal a_p give bit-identical rows and scores on both sides: exact ties (there are many among
// ~768 distinct values), which test the ties-to-the-lower-pool rule.
TEST(CudaIndexer, SelectionMatchesTheCpuExactly) {
  struct Case {
    int64_t tokens, heads, head_dim, kpool, topk;
    bool tail;
    int64_t query_block;  // workspace rows: several launches per call
    bool ties = false;    // every pool but each 97th with the same key: equal scores, ties to the lower pool
  };
  // The scorer's tiles: 256 rows of q (groups of 8 queries x all heads: 64 queries at heads 3-4,
  // 16 at heads 16, 8 at heads 32; heads 5 and 24 leave padding rows) by 128 pools, K in steps of
  // 16 (head_dim 8 is padded). Query blocks that end inside a query tile, pool counts that end
  // inside a pool tile, a single pool tile, tokens < kpool (no pools at all).
  const Case cases[] = {{1500, 4, 64, 4, 64, true, 300},
                        {4099, 4, 64, 4, 2048, true, 1000},
                        {777, 3, 32, 16, 128, false, 100},
                        {500, 2, 64, 1, 32, true, 64},
                        {50, 2, 32, 4, 64, true, 7},
                        {1000, 16, 64, 16, 256, true, 333},
                        {2500, 32, 128, 4, 512, false, 700},
                        {3000, 32, 64, 8, 512, true, 1000},
                        {2000, 16, 128, 16, 1024, false, 2000},
                        {1300, 24, 48, 4, 256, true, 1300},
                        {900, 5, 16, 2, 300, true, 250},
                        {600, 16, 8, 8, 64, true, 600},
                        {300, 1, 32, 4, 40, false, 100},
                        {10, 4, 64, 16, 2048, true, 10},
                        {12, 32, 128, 16, 2048, false, 12},
                        {4096, 32, 128, 16, 2048, true, 1024},
                        // a last query block of rows longer than 16,384 pools with 32 tiles of 64 pools
                        // or more for 16 chosen: the top-k from the tile maxima (the mma.sync scorer's
                        // scores, then the maxima kernel), with ties at the threshold among the bf16
                        // pool keys' magnitudes; with most keys equal (below tau: more than 16 of the
                        // other keys are larger)
                        {16900, 2, 8, 1, 16, false, 2000},
                        {16900, 2, 8, 1, 16, false, 2000, true},
                        // the threshold's bin held in shared memory with a thousand equal keys in it,
                        // and with more than it holds (the full radix select)
                        {1500, 2, 16, 1, 64, false, 1500, true},
                        {6000, 2, 16, 1, 512, false, 2000, true}};
  for (const Case& c : cases) {
    const cpu::IndexerShape s{c.tokens, c.heads, c.head_dim, c.kpool, c.topk, c.tail};
    const int64_t L = c.tokens, H = c.heads, d = c.head_dim, P = s.complete_pools();
    std::vector<float> v(static_cast<size_t>(d));
    const float magnitudes[] = {1.0f, 0.5f, 0.25f};
    for (float& x : v)
      x = magnitudes[std::uniform_int_distribution<int>(0, 2)(rng())] *
          (std::uniform_int_distribution<int>(0, 1)(rng()) ? 1.0f : -1.0f);
    std::vector<float> pool_keys(static_cast<size_t>(P * d));
    std::uniform_real_distribution<float> exponent(-3.0f, 3.0f);
    for (int64_t p = 0; p < P; ++p) {
      const float drawn = __bfloat162float(__float2bfloat16(std::exp2(exponent(rng()))));
      const float a = c.ties && p % 97 != 0 ? 1.0f : drawn;
      for (int64_t ch = 0; ch < d; ++ch) pool_keys[p * d + ch] = a * v[ch];
    }
    std::vector<float> q(static_cast<size_t>(L * H * d)), w(static_cast<size_t>(L * H));
    for (int64_t t = 0; t < L; ++t)
      for (int64_t h = 0; h < H; ++h) {
        float* qh = q.data() + (t * H + h) * d;
        double dot = 0;
        do {
          const auto r = rounded(random_floats(d));
          std::copy(r.begin(), r.end(), qh);
          dot = 0;
          for (int64_t ch = 0; ch < d; ++ch) dot += double(qh[ch]) * v[ch];
        } while (std::abs(dot) < 0.5);
        if ((dot < 0) != (h == H - 1))
          for (int64_t ch = 0; ch < d; ++ch) qh[ch] = -qh[ch];
        w[t * H + h] = __bfloat162float(__float2bfloat16(std::abs(random_floats(1)[0]) + 0.1f));
      }
    Stream stream;
    auto dq = device(to_bf16(q)), dk = device(to_bf16(pool_keys)), dw = device(to_bf16(w));
    auto sel = poisoned<int32_t>(L * s.width());
    const size_t workspace_bytes = indexer_select_workspace_bytes(s, c.query_block);
    DeviceBuffer<float> workspace(std::max<size_t>(workspace_bytes / sizeof(float), 1),
                                  MemoryCategory::Workspace);
    indexer_select(s, dq.data(), dk.data(), dw.data(), sel.data(), workspace.data(), workspace_bytes,
                   stream.get());
    stream.synchronize();
    const auto qd = to_double(q), kd = to_double(pool_keys), wd = to_double(w);
    std::vector<int32_t> ref(static_cast<size_t>(L * s.width()));
    cpu::indexer_select<double>(s, qd.data(), kd.data(), wd.data(), ref.data());
    const auto got = sel.download();
    int64_t mismatched_rows = 0, first = -1;
    for (int64_t t = 0; t < L; ++t)
      if (!std::equal(got.begin() + t * s.width(), got.begin() + (t + 1) * s.width(),
                      ref.begin() + t * s.width())) {
        if (first < 0) first = t;
        ++mismatched_rows;
      }
    EXPECT_EQ(mismatched_rows, 0) << "tokens " << L << " heads " << H << " head_dim " << d << " kpool "
                                  << c.kpool << " topk " << c.topk << " tail " << c.tail << " query block "
                                  << c.query_block << ": first mismatched query " << first;

    // A chunk of the queries (first_query, as the streaming executor asks; it starts inside a pool
    // when kpool > 1): rows of q and head weights from there on, every pool of the sequence; its
    // selection is the whole sequence's from that row on.
    const int64_t f = L / 3 + 1;
    cpu::IndexerShape chunk = s;
    chunk.first_query = f;
    auto chunk_sel = poisoned<int32_t>((L - f) * s.width());
    indexer_select(chunk, dq.data() + f * H * d, dk.data(), dw.data() + f * H, chunk_sel.data(),
                   workspace.data(), workspace_bytes, stream.get());
    stream.synchronize();
    const auto chunk_got = chunk_sel.download();
    EXPECT_TRUE(std::equal(chunk_got.begin(), chunk_got.end(), ref.begin() + f * s.width()))
        << "a chunk from query " << f << " of tokens " << L << " heads " << H << " head_dim " << d
        << " kpool " << c.kpool << " topk " << c.topk << " tail " << c.tail << " query block "
        << c.query_block;

    // The CPU's selection as pool lists and back (what the streaming executor keeps), for the
    // whole sequence and for the chunk: the CPU's pool lists, and the same selection back.
    for (const cpu::IndexerShape& part : {s, chunk}) {
      const int64_t rows = part.queries(), per_query = selection_pools_per_query(part);
      const std::vector<int32_t> want(ref.begin() + part.first_query * s.width(), ref.end());
      auto selected = device(want);
      // Filled with 0x7f7f7f7f, not poisoned's -1, which is a valid slot here.
      const auto filled = [&](int64_t n) {
        DeviceBuffer<int32_t> b(static_cast<size_t>(std::max<int64_t>(1, n)), MemoryCategory::Activations);
        SPINDLE_CUDA(cudaMemsetAsync(b.data(), 0x7f, b.size() * sizeof(int32_t), stream.get()));
        return b;
      };
      auto pools = filled(rows * per_query), back = filled(rows * s.width());
      selection_to_pools(part, selected.data(), pools.data(), stream.get());
      pools_to_selection(part, pools.data(), back.data(), stream.get());
      stream.synchronize();
      std::vector<int32_t> want_pools(static_cast<size_t>(rows * per_query));
      cpu::selection_to_pools(part, want.data(), want_pools.data());
      auto kept = pools.download();
      kept.resize(want_pools.size());  // the buffer holds at least one value
      EXPECT_EQ(kept, want_pools) << "pool lists from query " << part.first_query << " of tokens " << L;
      EXPECT_EQ(back.download(), want)
          << "selection from pool lists, from query " << part.first_query << " of tokens " << L << " kpool "
          << c.kpool << " topk " << c.topk << " tail " << c.tail;
      // Their 16-bit form, as the streaming executor keeps them where every pool fits.
      ASSERT_TRUE(pool_lists_fit_16_bits(part));
      DeviceBuffer<uint16_t> narrow(static_cast<size_t>(std::max<int64_t>(1, rows * per_query)),
                                    MemoryCategory::Activations);
      SPINDLE_CUDA(cudaMemsetAsync(narrow.data(), 0x7f, narrow.size() * sizeof(uint16_t), stream.get()));
      auto narrow_back = filled(rows * s.width());
      selection_to_pools(part, selected.data(), narrow.data(), stream.get());
      pools_to_selection(part, narrow.data(), narrow_back.data(), stream.get());
      stream.synchronize();
      auto narrow_kept = narrow.download();
      narrow_kept.resize(want_pools.size());
      std::vector<int32_t> widened(narrow_kept.size());
      for (size_t i = 0; i < widened.size(); ++i)
        widened[i] = narrow_kept[i] == 0xffff ? -1 : static_cast<int32_t>(narrow_kept[i]);
      EXPECT_EQ(widened, want_pools) << "16-bit pool lists from query " << part.first_query;
      EXPECT_EQ(narrow_back.download(), want)
          << "selection from 16-bit pool lists, from query " << part.first_query;
    }
  }
}

// 16-bit pool lists hold pools 0 .. 65534 (65535 stands for none): sequences of up to 65,535 complete
// pools, 1,048,560 tokens at kpool 16 (the 1M step's kept chunks, all but the last, have 64,512).
TEST(CudaIndexer, PoolListsFit16BitsUpTo65535Pools) {
  cpu::IndexerShape s{65535 * 16, 32, 128, 16, 2048, true};
  EXPECT_TRUE(pool_lists_fit_16_bits(s));
  s.tokens += 15;
  EXPECT_TRUE(pool_lists_fit_16_bits(s));
  s.tokens += 1;
  EXPECT_FALSE(pool_lists_fit_16_bits(s));
  s.tokens = 1048576 - 16384;
  s.first_query = s.tokens - 16384;
  EXPECT_TRUE(pool_lists_fit_16_bits(s));
}

// The top-k alone (indexer_topk) on scores made here, against the selection rule written out: per
// query the top min(topk / kpool, visible) pools by score, ties to the lower pool, in pool order,
// expanded to tokens, then the tail. Rows of up to 300,000 pools (past what the kernel keeps in
// shared memory), rows shorter than k, and score kinds that reach each path of the radix select:
// distinct values, exact zeros with few positives (the threshold is 0, ties among the zeros), four
// values 2^-20 apart (every key in one first-pass bin: more than the kernel holds, the re-read path),
// one value everywhere, and -inf (masked) pools, in rows with fewer finite scores than k. Scores past
// a row's visible pools are NaN and must not count; the output starts as 0x7f7f7f7f, so every slot
// must be written. Each case twice: the radix select alone, and with the tile maxima (from
// indexer_tile_maxima), where the long rows' candidates are few (distinct), tie at tau (1M tiers),
// or are more than it holds (zeros, four values, constant, mostly -inf), or tie at the threshold more
// than it ranks (many tiers, 300,000-pool tiers).
TEST(CudaIndexer, TopKMatchesTheRule) {
  enum class Kind { distinct, zeros, four_values, constant, masked, tiers, many_tiers };
  struct Case {
    int64_t tokens, kpool, topk;
    bool tail;
    int64_t first, rows;
    Kind kind;
  };
  const int64_t M = int64_t{1} << 20;
  const Case cases[] = {// 1M tokens, GLM's k-pool 16 and top 2048: rows of 65,536 pools
                        {M, 16, 2048, true, M - 40, 40, Kind::distinct},
                        {M, 16, 2048, true, M - 24, 24, Kind::zeros},
                        {M, 16, 2048, false, M - 24, 24, Kind::four_values},
                        {M, 16, 2048, true, M - 24, 24, Kind::masked},
                        {M, 16, 2048, true, M - 8, 8, Kind::constant},
                        // the chosen-th score exactly at tau, tied across tiles and within them: the
                        // ties ranked in shared memory, and more of them than it ranks
                        {M, 16, 2048, true, M - 24, 24, Kind::tiers},
                        {M, 16, 2048, false, M - 24, 24, Kind::many_tiers},
                        // 200,000 pools and 2048 of them chosen
                        {200000, 1, 2048, false, 199990, 10, Kind::distinct},
                        {200000, 1, 2048, true, 199992, 8, Kind::four_values},
                        // more than 262,144 pools: a mark for every two groups of a thread's four pools
                        {300000, 1, 64, false, 299996, 4, Kind::distinct},
                        {300000, 1, 64, false, 299996, 4, Kind::four_values},
                        {300000, 1, 64, false, 299996, 4, Kind::tiers},
                        // rows of about 48,000 and 50,000 pools, about what the kernel keeps
                        {48000, 1, 256, true, 47900, 100, Kind::distinct},
                        {50000, 1, 256, true, 49900, 100, Kind::distinct},
                        // rows on both sides of 512 tiles (256 chosen): the radix select and the top-k
                        // from the tile maxima in one launch
                        {33000, 1, 256, true, 32000, 1000, Kind::distinct},
                        // 8192 pools a row: all of a four-value row in one bin
                        {int64_t{1} << 17, 16, 2048, true, (int64_t{1} << 17) - 64, 64, Kind::four_values},
                        // from the first query: rows with no pools and rows shorter than k, in one launch
                        // with rows longer than k
                        {4200, 1, 2048, false, 0, 4200, Kind::distinct},
                        {4200, 1, 2048, false, 0, 4200, Kind::masked},
                        {20000, 4, 512, true, 0, 2000, Kind::zeros},
                        // short rows (about 2,000 pools, a 32k sequence's)
                        {32768, 16, 2048, true, 30000, 300, Kind::distinct},
                        {32768, 16, 2048, true, 30000, 300, Kind::zeros},
                        {32768, 16, 2048, true, 30000, 300, Kind::four_values},
                        {32768, 16, 2048, true, 30000, 300, Kind::constant},
                        {32768, 16, 2048, true, 30000, 300, Kind::masked}};
  for (const Case& c : cases) {
    cpu::IndexerShape s{c.tokens, 1, 16, c.kpool, c.topk, c.tail};
    s.first_query = c.first;
    const int64_t P = s.complete_pools(), width = s.width();
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> die(0, 1023);
    std::vector<float> scores(static_cast<size_t>(c.rows * P), NAN);
    for (int64_t r = 0; r < c.rows; ++r) {
      const int64_t visible = std::min(P, (c.first + r + 1) / c.kpool);
      for (int64_t p = 0; p < visible; ++p) {
        float& x = scores[static_cast<size_t>(r * P + p)];
        switch (c.kind) {
          case Kind::distinct:
            x = normal(rng());
            break;
          case Kind::zeros:
            x = die(rng()) == 0 ? std::abs(normal(rng())) : 0.0f;
            break;
          case Kind::four_values:
            x = 1.0f + static_cast<float>(die(rng()) % 4) * 0x1p-20f;
            break;
          case Kind::constant:
            x = 0.75f;
            break;
          case Kind::masked:
            x = die(rng()) < 2 ? normal(rng()) : -INFINITY;
            break;
          case Kind::tiers:
          case Kind::many_tiers: {
            // Two peaks a tile of 64 over small scores: 3 (few: fewer tiles than chosen), else 2
            // (about 200 a 1M row's 2,048 peaks; half of them with many_tiers), else 1.
            const int d = die(rng()), twos = c.kind == Kind::tiers ? 150 : 562;
            x = p % 32 != 0 ? 0.1f * normal(rng()) : d < 50 ? 3.0f : d < twos ? 2.0f : 1.0f;
            break;
          }
        }
      }
    }
    std::vector<int32_t> want(static_cast<size_t>(c.rows * width), -1);
    std::vector<int64_t> order;
    for (int64_t r = 0; r < c.rows; ++r) {
      const int64_t t = c.first + r, visible = std::min(P, (t + 1) / c.kpool);
      const int64_t chosen = std::min(c.topk / c.kpool, visible);
      const float* row = scores.data() + r * P;
      order.resize(static_cast<size_t>(visible));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + chosen, order.end(), [row](int64_t a, int64_t b) {
        return row[a] > row[b] || (row[a] == row[b] && a < b);
      });
      std::sort(order.begin(), order.begin() + chosen);
      int32_t* out = want.data() + r * width;
      for (int64_t i = 0; i < chosen; ++i)
        for (int64_t j = 0; j < c.kpool; ++j)
          out[i * c.kpool + j] = static_cast<int32_t>(order[i] * c.kpool + j);
      if (c.tail && c.kpool > 1) {
        const int64_t tail = (t + 1) % c.kpool;
        for (int64_t j = 0; j < tail; ++j) out[c.topk + j] = static_cast<int32_t>(t + 1 - tail + j);
      }
    }
    Stream stream;
    auto dscores = device(scores);
    auto maxima = poisoned<unsigned>(static_cast<size_t>(std::max<int64_t>(1, c.rows * indexer_tiles(s))));
    indexer_tile_maxima(s, dscores.data(), c.first, c.rows, maxima.data(), stream.get());
    // The radix select alone, then from the tile maxima (in launches of rows longer than 16,384
    // pools, the rows with two tiles or more per chosen pool).
    for (const unsigned* m :
         {static_cast<const unsigned*>(nullptr), static_cast<const unsigned*>(maxima.data())}) {
      DeviceBuffer<int32_t> sel = fresh_buffer<int32_t>(want.size(), MemoryCategory::Activations);
      SPINDLE_CUDA(cudaMemsetAsync(sel.data(), 0x7f, want.size() * sizeof(int32_t), stream.get()));
      indexer_topk(s, dscores.data(), m, c.first, c.rows, sel.data(), stream.get());
      stream.synchronize();
      const auto got = sel.download();
      int64_t mismatched_rows = 0, first = -1;
      for (int64_t r = 0; r < c.rows; ++r)
        if (!std::equal(got.begin() + r * width, got.begin() + (r + 1) * width, want.begin() + r * width)) {
          if (first < 0) first = c.first + r;
          ++mismatched_rows;
        }
      EXPECT_EQ(mismatched_rows, 0) << (m ? "from the tile maxima" : "radix select") << ": tokens "
                                    << c.tokens << " kpool " << c.kpool << " topk " << c.topk << " tail "
                                    << c.tail << " queries " << c.first << " + " << c.rows << " kind "
                                    << static_cast<int>(c.kind) << ": first mismatched query " << first;
    }
  }
}

// The tensor-core scores themselves on unconstrained random inputs (signed head weights): every
// visible score within 1e-4 of its magnitude sum_h |w_h| sum_c |q_hc k_c| / sqrt(d), the bound of
// fp32 accumulation of exact bf16 products (2^-24 per addition, 128 + 32 additions, with room for
// the tensor cores' own rounding); an indexing slip is off by O(1) of it. The row past the last is
// poisoned and must stay so. Both scorers where the wgmma one takes the shape (17 to 32 heads,
// head_dim a multiple of 16): its 16-query, 64-pool tiles end inside the rows and pools here. The
// tile maxima of the scores written (the maxima kernel's, and indexer_scores' own) equal them
// computed here.
TEST(CudaIndexer, ScoresMatchTheCpu) {
  struct Case {
    int64_t tokens, heads, head_dim, kpool, first, rows;
  };
  const Case cases[] = {
      {1000, 32, 128, 4, 0, 1000},
      {700, 16, 64, 16, 200, 333},
      {2000, 3, 48, 1, 1500, 100},
      {530, 24, 8, 2, 17, 500},
      {300, 1, 16, 4, 0, 300},
      {4096, 32, 128, 16, 2048, 2048},
      {1500, 20, 48, 2, 100, 1201},
      {3000, 32, 64, 1, 2000, 999},
      {40, 32, 128, 1, 0, 40},
      // 25 CTAs of up to 18 tiles: on 132 multiprocessors the wgmma scorer splits them 5 ways, unevenly.
      {8192, 32, 32, 4, 4096, 400}};
  for (const Case& c : cases) {
    const cpu::IndexerShape s{c.tokens, c.heads, c.head_dim, c.kpool, 2048, false};
    const int64_t H = c.heads, d = c.head_dim, P = s.complete_pools();
    const auto q = rounded(random_floats(c.tokens * H * d)), k = rounded(random_floats(P * d)),
               w = rounded(random_floats(c.tokens * H));
    // The reference and its magnitude for every visible score; -1 magnitude past the visible.
    std::vector<double> want(static_cast<size_t>(c.rows * P)), magnitude(want.size(), -1.0);
    const double scale = 1.0 / std::sqrt(double(d));
    for (int64_t r = 0; r < c.rows; ++r) {
      const int64_t t = c.first + r, visible = std::min(P, (t + 1) / c.kpool);
      for (int64_t p = 0; p < visible; ++p) {
        double score = 0, size_sum = 0;
        for (int64_t h = 0; h < H; ++h) {
          double dot = 0, size = 0;
          for (int64_t ch = 0; ch < d; ++ch) {
            const double x = double(q[(t * H + h) * d + ch]) * k[p * d + ch];
            dot += x;
            size += std::abs(x);
          }
          score += w[t * H + h] * std::max(0.0, dot * scale);
          size_sum += std::abs(w[t * H + h]) * size * scale;
        }
        want[r * P + p] = score;
        magnitude[r * P + p] = std::max(size_sum, 1e-30);
      }
    }
    Stream stream;
    auto dq = device(to_bf16(q)), dk = device(to_bf16(k)), dw = device(to_bf16(w));
    const bool both = std::string(indexer_scorer(s)) != "mma.sync";
    for (const bool mma : {false, true}) {
      if (mma && !both) continue;  // the first pass ran it
      auto scores = poisoned<float>((c.rows + 1) * P);
      const int64_t tiles = indexer_tiles(s);
      auto maxima = poisoned<unsigned>(c.rows * tiles), from_scores = poisoned<unsigned>(c.rows * tiles);
      if (mma)
        indexer_scores_mma(s, dq.data(), dk.data(), dw.data(), c.first, c.rows, scores.data(), stream.get());
      else
        indexer_scores(s, dq.data(), dk.data(), dw.data(), c.first, c.rows, scores.data(), maxima.data(),
                       stream.get());
      indexer_tile_maxima(s, scores.data(), c.first, c.rows, from_scores.data(), stream.get());
      stream.synchronize();
      const auto got = scores.download();
      // The tile maxima of the scores written, as keys (0 for a tile without visible pools): from the
      // maxima kernel, and from indexer_scores (its scorer's own), bit for bit.
      std::vector<unsigned> want_maxima(static_cast<size_t>(c.rows * tiles), 0u);
      for (int64_t r = 0; r < c.rows; ++r)
        for (int64_t p = 0; p < std::min(P, (c.first + r + 1) / c.kpool); ++p) {
          unsigned u = 0;
          std::memcpy(&u, &got[r * P + p], sizeof(u));
          u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
          unsigned& m = want_maxima[r * tiles + p / kIndexerTilePools];
          m = std::max(m, u);
        }
      const char* scorer = mma ? "mma.sync" : indexer_scorer(s);
      EXPECT_EQ(from_scores.download(), want_maxima) << "tile maxima from the " << scorer << " scores";
      if (!mma) {
        EXPECT_EQ(maxima.download(), want_maxima) << "tile maxima of the " << scorer << " scorer";
      }
      int64_t bad = 0, checked = 0;
      double worst = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        if (magnitude[i] < 0) continue;
        const double error = std::abs(got[i] - want[i]) / magnitude[i];
        if (!(error <= 1e-4)) ++bad;  // NaN (unwritten) counts as bad
        worst = std::max(worst, std::isnan(error) ? INFINITY : error);
        ++checked;
      }
      int64_t touched = 0;
      for (int64_t p = 0; p < P; ++p) touched += std::isnan(got[c.rows * P + p]) ? 0 : 1;
      EXPECT_EQ(bad, 0) << scorer << " scorer: of " << checked << " scores; worst error " << worst
                        << "; tokens " << c.tokens << " heads " << H << " head_dim " << d << " kpool "
                        << c.kpool << " queries " << c.first << " + " << c.rows;
      EXPECT_EQ(touched, 0) << scorer << " scorer: scores written past the last row";
    }
  }
}

}  // namespace
}  // namespace spindle::cuda
