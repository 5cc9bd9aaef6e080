// The chunked KDA kernels against the CPU token-by-token reference (double, on the same
// bf16-rounded inputs), on fresh random inputs; every output and workspace is NaN-poisoned first.
// Bounds: the bf16 output 1e-2 (one bf16 rounding is ~3e-3 relative; fp32 math adds far less);
// the fp32 chunk states and gradients 1e-3: both sides see the same rounded inputs, so only fp32
// arithmetic differs (expected ~1e-6 .. 1e-5: the log decays in [-0.5, 0] make the recurrence
// contract, so rounding does not build up over the 4096-token case). The intra-chunk products
// (the preps' A, Aq, W, U0, P, Z) run on the tensor cores as 3xTF32 (kKdaSplitTf32 in
// kernels/cuda/kda_chunk.cuh), fp32-level like the rest; plain TF32 (~3e-4 relative per product,
// then through the solve and the state recurrence) may not stay within 1e-3.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "gpu_test_util.h"
#include "kernels/cpu/kda.h"
#include "kernels/cuda/kda.h"

namespace spindle::cuda {
namespace {

constexpr double kBf16Bound = 1e-2;
constexpr double kFp32Bound = 1e-3;

// dg's error relative to the size of the terms it sums, q . dq and k . dk per token (dg_t collects
// q_r dq_r - k_r dk_r over r >= t, plus the carried state's share): they cancel to exactly zero
// where nothing decays a state, as for one token from a zero state, and fp32 leaves ~1e-7 of them.
double dg_error(const std::vector<float>& got, const std::vector<double>& want, const std::vector<float>& q,
                const std::vector<double>& dq, const std::vector<float>& k, const std::vector<double>& dk) {
  double diff = 0, norm = 0, qdq = 0, kdk = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
    qdq += (q[i] * dq[i]) * (q[i] * dq[i]);
    kdk += (k[i] * dk[i]) * (k[i] * dk[i]);
  }
  const double scale = std::max(std::sqrt(norm), std::sqrt(qdq) + std::sqrt(kdk));
  return std::sqrt(diff) / std::max(scale, 1e-300);
}

// Rows of `width` scaled to norm `scale`.
void normalise_rows(std::vector<float>& x, int64_t width, float scale) {
  for (size_t r = 0; r < x.size() / static_cast<size_t>(width); ++r) {
    double norm = 0;
    for (int64_t i = 0; i < width; ++i) norm += double(x[r * width + i]) * x[r * width + i];
    const float f = scale / static_cast<float>(std::sqrt(norm) + 1e-6);
    for (int64_t i = 0; i < width; ++i) x[r * width + i] *= f;
  }
}

// One output against the same output of another run: relative, as relative_error.
template <class T>
double close(const DeviceBuffer<T>& got, const DeviceBuffer<T>& want) {
  const auto w = want.download();
  std::vector<double> wanted(w.size());
  for (size_t i = 0; i < w.size(); ++i) wanted[i] = static_cast<double>(w[i]);
  return relative_error(got.download(), wanted);
}

// One case: (tokens, heads, dk, dv) and whether the sequence continues a streamed one (an initial
// state in, the final state's gradient in, the initial state's gradient out).
// Returns the log decays it drew.
std::vector<float> check_against_recurrence(int64_t T, int64_t H, int64_t dk, int64_t dv, bool carried,
                                            float g_min = -0.5f) {
  auto qf = random_floats(T * H * dk), kf = random_floats(T * H * dk);
  normalise_rows(qf, dk, 1.0f / std::sqrt(static_cast<float>(dk)));
  normalise_rows(kf, dk, 1.0f);
  const auto q = rounded(qf), k = rounded(kf), v = rounded(random_floats(T * H * dv));
  const auto dout = rounded(random_floats(T * H * dv));
  const auto g = random_uniform(T * H * dk, g_min, 0.0f);
  const auto beta = random_uniform(T * H, 1e-3f, 1.0f - 1e-3f);
  const int64_t chunks = kda_chunks(T), SS = dk * dv;
  const auto initial = carried ? random_floats(H * SS, 0.3f) : std::vector<float>(H * SS, 0.0f);
  const auto d_final = carried ? random_floats(H * SS) : std::vector<float>(H * SS, 0.0f);

  Stream stream;
  auto qb = device(to_bf16(q)), kb = device(to_bf16(k)), vb = device(to_bf16(v)), dob = device(to_bf16(dout));
  auto gb = device(g), bb = device(beta), initial_b = device(initial), d_final_b = device(d_final);

  const auto qd = to_double(q), kd = to_double(k), vd = to_double(v), gd = to_double(g), bd = to_double(beta),
             dod = to_double(dout), initial_d = to_double(initial), d_final_d = to_double(d_final);
  // The reference chunk by chunk (tokens are the outer dimension), keeping each entry state.
  std::vector<double> out_ref(T * H * dv), state = initial_d, states_ref;
  for (int64_t c = 0; c < chunks; ++c) {
    states_ref.insert(states_ref.end(), state.begin(), state.end());
    const int64_t t0 = c * kKdaChunk, n = std::min(kKdaChunk, T - t0);
    cpu::kda_recurrence<double>({n, H, dk, dv}, qd.data() + t0 * H * dk, kd.data() + t0 * H * dk,
                                vd.data() + t0 * H * dv, gd.data() + t0 * H * dk, bd.data() + t0 * H,
                                out_ref.data() + t0 * H * dv, state.data());
  }
  states_ref.insert(states_ref.end(), state.begin(), state.end());
  std::vector<double> dq_ref(T * H * dk), dk_ref(T * H * dk), dv_ref(T * H * dv), dg_ref(T * H * dk),
      dbeta_ref(T * H), d_initial_ref(H * SS);
  cpu::KdaChunkStates<double> carry;
  if (carried) carry = {initial_d.data(), d_final_d.data(), d_initial_ref.data()};
  cpu::kda_recurrence_backward<double>({T, H, dk, dv}, qd.data(), kd.data(), vd.data(), gd.data(), bd.data(),
                                       dod.data(), dq_ref.data(), dk_ref.data(), dv_ref.data(), dg_ref.data(),
                                       dbeta_ref.data(), 64, carry);

  // Both paths of the backward: computing the chunks' matrices and u again, and taking them from
  // the forward (kept_matrices, as the streaming executor does).
  for (const bool kept : {false, true}) {
    auto out = poisoned<bf16>(T * H * dv);
    auto states = poisoned<float>((chunks + 1) * H * SS);
    auto dq = poisoned<bf16>(T * H * dk), dk_ = poisoned<bf16>(T * H * dk), dv_ = poisoned<bf16>(T * H * dv);
    auto dg = poisoned<float>(T * H * dk), dbeta = poisoned<float>(T * H),
         d_initial = poisoned<float>(H * SS);
    auto workspace = poisoned<float>(kda_forward_workspace_floats(T, H));
    auto matrices = poisoned<float>(kept ? kda_kept_matrices_floats(T, H) : 0);
    kda_chunked_forward(qb.data(), kb.data(), vb.data(), gb.data(), bb.data(), out.data(), states.data(),
                        workspace.data(), T, H, dk, dv, stream.get(), carried ? initial_b.data() : nullptr,
                        kept ? matrices.data() : nullptr);
    auto bwd_workspace = poisoned<float>(kda_backward_workspace_floats(T, H, dk, dv, kept));
    kda_chunked_backward(qb.data(), kb.data(), vb.data(), gb.data(), bb.data(), dob.data(), states.data(),
                         dq.data(), dk_.data(), dv_.data(), dg.data(), dbeta.data(), bwd_workspace.data(), T,
                         H, dk, dv, stream.get(), carried ? d_final_b.data() : nullptr,
                         carried ? d_initial.data() : nullptr, kept ? matrices.data() : nullptr);
    stream.synchronize();
    const auto where = [&] {
      return testing::Message() << " T=" << T << " H=" << H << " dk=" << dk << " dv=" << dv
                                << " g_min=" << g_min << (carried ? " carried" : "") << (kept ? " kept" : "");
    };
    if (T > 0) {
      EXPECT_LT(relative_error(out.download(), out_ref), kBf16Bound) << "out" << where();
      EXPECT_LT(relative_error(dq.download(), dq_ref), kBf16Bound) << "dq" << where();
      EXPECT_LT(relative_error(dk_.download(), dk_ref), kBf16Bound) << "dk" << where();
      EXPECT_LT(relative_error(dv_.download(), dv_ref), kBf16Bound) << "dv" << where();
      EXPECT_LT(dg_error(dg.download(), dg_ref, q, dq_ref, k, dk_ref), kFp32Bound) << "dg" << where();
      EXPECT_LT(relative_error(dbeta.download(), dbeta_ref), kFp32Bound) << "dbeta" << where();
    }
    EXPECT_LT(relative_error(states.download(), states_ref), kFp32Bound) << "chunk states" << where();
    if (carried) {
      EXPECT_LT(relative_error(d_initial.download(), d_initial_ref), kFp32Bound) << "d_initial" << where();
    }
  }
  return g;
}

// Chunk-heads of g [T, H, dk] (natural log decays) whose G falls by more than kKdaHalfDecayBound
// (log2 domain) over half of one of its sub-chunks, as the grad kernel measures it (G stays at the
// last token's past the chunk): those take its diagonal blocks element by element.
int64_t chunks_past_the_decay_bound(const std::vector<float>& g, int64_t T, int64_t H, int64_t dk) {
  int64_t past = 0;
  for (int64_t t0 = 0; t0 < T; t0 += kKdaChunk)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t n = std::min(kKdaChunk, T - t0);
      bool beyond = false;
      for (int64_t i = 0; i < dk; ++i) {
        std::vector<double> G(n);
        double sum = 0.0;
        for (int64_t t = 0; t < n; ++t) G[t] = sum += g[((t0 + t) * H + h) * dk + i] * 1.4426950408889634;
        const auto at = [&](int64_t t) { return G[std::min(t, n - 1)]; };
        for (int64_t a = 0; a < kKdaChunk; a += 16)
          beyond =
              beyond || at(a) - at(a + 8) > kKdaHalfDecayBound || at(a + 8) - at(a + 15) > kKdaHalfDecayBound;
      }
      past += beyond ? 1 : 0;
    }
  return past;
}

TEST(CudaKda, ChunkedForwardAndBackwardMatchRecurrence) {
  // A partial last chunk and sub-chunk, non-multiples of 16 in both head dims, the largest head
  // dims, a single token, a long sequence, a partial chunk with the largest dk and dv != dk, and a dv
  // that is not a multiple of 4.
  for (auto [T, H, dk, dv] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{200, 2, 16, 16},
                              {257, 3, 64, 64},
                              {130, 2, 40, 24},
                              {64, 1, 128, 128},
                              {1, 2, 32, 32},
                              {4096, 2, 64, 64},
                              {333, 2, 128, 40},
                              {700, 2, 8, 8},     // the tiny model's heads (tests/configs/tiny.json)
                              {130, 2, 36, 18}})  // dv not a multiple of 4: the scan stores value by value
    check_against_recurrence(T, H, dk, dv, false);
}

TEST(CudaKda, CarriedStatesMatchRecurrence) {
  // A streamed chunk: the state it starts from and the gradient its final state receives.
  for (auto [T, H, dk, dv] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{150, 2, 32, 48},
                              {77, 1, 128, 128},
                              {0, 2, 16, 16},
                              {100, 2, 24, 128},
                              {150, 2, 20, 18},
                              {16448, 1, 32, 32}})  // 257 chunks: segments of 256 + 1 (128 + 128 + 1)
    check_against_recurrence(T, H, dk, dv, true);
}

TEST(CudaKda, StrongDecaysOverALongSequence) {
  // Log decays down to -5 (a trained model's range): whole chunks decay to nothing. 512 chunks
  // cross the forward's segments of 256 and the backward's of 128.
  check_against_recurrence(32768, 4, 16, 16, false, -5.0f);
  check_against_recurrence(2048, 2, 64, 64, true, -5.0f);
}

TEST(CudaKda, StrongDecaysWithPartialChunks) {
  // Decays past fp32's range: down to -5 a chunk decays by ~160 nats, down to -20 even one 16-token
  // sub-chunk does, so exp(-G) of either overflows; the preps factor exp(G_t - G_s) through a token
  // between s and t, every factor <= 1. Partial last chunks of lengths that are no multiple of 16
  // (13, 41, 8, 22, 33 tokens), the largest head dims, a dk that is no multiple of 8.
  for (auto [T, H, dk, dv, carried, g_min] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, bool, float>{333, 2, 128, 128, false, -5.0f},
        {1001, 2, 128, 64, true, -5.0f},
        {200, 2, 100, 72, false, -5.0f},
        {150, 1, 128, 128, true, -20.0f},
        // Head dims that are no multiple of 4 (rows not 16-byte aligned: the 4-byte copies) nor of 8.
        {150, 2, 30, 21, true, -5.0f},
        {97, 1, 127, 9, false, -20.0f}})
    check_against_recurrence(T, H, dk, dv, carried, g_min);
}

TEST(CudaKda, DiagonalBlocksOnBothPaths) {
  // The preps and the grad kernel take a chunk's diagonal blocks on the tensor cores while its
  // decay over each half sub-chunk stays within kKdaHalfDecayBound (kda.h), element by element past
  // it (decays below about -5.5 per token): decays down to -7 put part of these chunks past it, and
  // the check needs both kinds.
  const int64_t T = 2600, H = 2, dk = 16;
  const auto g = check_against_recurrence(T, H, dk, 32, true, -7.0f);
  const int64_t past = chunks_past_the_decay_bound(g, T, H, dk), all = kda_chunks(T) * H;
  EXPECT_GT(past, 0) << "no chunk took the element-by-element diagonal";
  EXPECT_LT(past, all) << "no chunk took the diagonal on the tensor cores";
}

// The streaming executor keeps a chunk's intra-chunk matrices and u from its recomputation's
// forward for its backward (kept_matrices, kernels/cuda/kda.h): the forward that writes them must be
// bit for bit the one that does not, and the backward that takes them (summing dbeta and dq's and
// dk's state products in another order) the one that computes them again within fp32 rounding.
void check_kept_matrices(int64_t T, int64_t H, int64_t dk, int64_t dv, bool carried, float g_min) {
  auto qf = random_floats(T * H * dk), kf = random_floats(T * H * dk);
  normalise_rows(qf, dk, 1.0f / std::sqrt(static_cast<float>(dk)));
  normalise_rows(kf, dk, 1.0f);
  const int64_t chunks = kda_chunks(T), SS = dk * dv;
  Stream stream;
  auto qb = device(to_bf16(rounded(qf))), kb = device(to_bf16(rounded(kf)));
  auto vb = device(to_bf16(random_floats(T * H * dv))), dob = device(to_bf16(random_floats(T * H * dv)));
  auto gb = device(random_uniform(T * H * dk, g_min, 0.0f)), bb = device(random_uniform(T * H, 1e-3f, 1.0f));
  auto initial = device(random_floats(H * SS, 0.3f)), d_final = device(random_floats(H * SS));
  auto matrices = poisoned<float>(kda_kept_matrices_floats(T, H));
  struct Run {
    DeviceBuffer<bf16> out;
    DeviceBuffer<float> states;
    DeviceBuffer<bf16> dq, dk, dv;
    DeviceBuffer<float> dg, dbeta, d_initial;
  };
  const auto run = [&](bool kept) {
    Run r{poisoned<bf16>(T * H * dv), poisoned<float>((chunks + 1) * H * SS),
          poisoned<bf16>(T * H * dk), poisoned<bf16>(T * H * dk),
          poisoned<bf16>(T * H * dv), poisoned<float>(T * H * dk),
          poisoned<float>(T * H),     poisoned<float>(H * SS)};
    auto workspace = poisoned<float>(kda_forward_workspace_floats(T, H));
    kda_chunked_forward(qb.data(), kb.data(), vb.data(), gb.data(), bb.data(), r.out.data(), r.states.data(),
                        workspace.data(), T, H, dk, dv, stream.get(), carried ? initial.data() : nullptr,
                        kept ? matrices.data() : nullptr);
    auto bwd_workspace = poisoned<float>(kda_backward_workspace_floats(T, H, dk, dv, kept));
    kda_chunked_backward(qb.data(), kb.data(), vb.data(), gb.data(), bb.data(), dob.data(), r.states.data(),
                         r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(),
                         bwd_workspace.data(), T, H, dk, dv, stream.get(), carried ? d_final.data() : nullptr,
                         carried ? r.d_initial.data() : nullptr, kept ? matrices.data() : nullptr);
    stream.synchronize();
    return r;
  };
  const Run computed = run(false), kept = run(true);
  const auto where = [&] {
    return testing::Message() << " T=" << T << " H=" << H << " dk=" << dk << " dv=" << dv
                              << (carried ? " carried" : "");
  };
  const auto same = [](const auto& a, const auto& b) {
    const auto x = a.download(), y = b.download();
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  // Relative to the path that computes them again; 1e-5: a few fp32 roundings, far under kFp32Bound.
  // dq, dk and dv, rounded to bf16: 1e-3, where the two fp32 sums straddle a rounding boundary (one
  // ulp, 2^-8).
  constexpr double kReordered = 1e-5, kReorderedBf16 = 1e-3;
  EXPECT_TRUE(same(computed.out, kept.out)) << "out" << where();
  EXPECT_TRUE(same(computed.states, kept.states)) << "chunk states" << where();
  EXPECT_LT(close(kept.dq, computed.dq), kReorderedBf16) << "dq" << where();
  EXPECT_LT(close(kept.dk, computed.dk), kReorderedBf16) << "dk" << where();
  EXPECT_LT(close(kept.dv, computed.dv), kReorderedBf16) << "dv" << where();
  EXPECT_LT(close(kept.dg, computed.dg), kReordered) << "dg" << where();
  EXPECT_LT(close(kept.dbeta, computed.dbeta), kReordered) << "dbeta" << where();
  if (carried) {
    EXPECT_LT(close(kept.d_initial, computed.d_initial), kReordered) << "d_initial" << where();
  }
}

TEST(CudaKda, KeptMatricesGiveTheSameGradients) {
  // A partial last chunk and sub-chunk with dk != dv; 257 chunks, past the forward's segment of
  // 256 and the backward's of 128; head dims that are no multiple of 4 or 8, an odd dk (the kept
  // prep's q and k tiles by plain loads) beside the widest dv (its dO tile copied whole); decays
  // down to -7, so that the chunks' diagonal blocks take both of chunk_matrices' forms
  // (DiagonalBlocksOnBothPaths).
  for (auto [T, H, dk, dv, carried, g_min] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, bool, float>{333, 2, 128, 40, false, -5.0f},
        {16448, 2, 64, 64, true, -5.0f},
        {150, 2, 30, 21, true, -5.0f},
        {97, 1, 127, 128, false, -5.0f},
        {2600, 2, 16, 16, false, -7.0f}})
    check_kept_matrices(T, H, dk, dv, carried, g_min);
}

}  // namespace
}  // namespace spindle::cuda
