// The KDA short conv and the mHC hyper-connection kernels against the CPU reference (double, on
// the same bf16-rounded inputs), on fresh random inputs: written outputs are poisoned with NaN
// first (every element must be written); accumulated outputs start from random values and the
// increment (got - start) is compared with the reference.
// Bounds: bf16 outputs 1e-2 (one bf16 rounding is ~3e-3 relative; fp32 math adds far less);
// fp32 outputs and gradients 1e-3: the inputs are the same rounded values on both sides, so only
// fp32 arithmetic differs (expected ~1e-6 .. 1e-5, Sinkhorn's 39 passes included); 1e-3 leaves
// headroom for the fp32 atomics' summation order and cancellation in the small sums (dscale). The
// streams' gradients (bf16, their dout too) element by element: within 4e-3 of their row's largest
// value (one rounding to nearest is at most 2^-9 = 2e-3 of it).
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "core/error.h"
#include "gpu_test_util.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/mhc.h"
#include "kernels/cpu/norms.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/mhc.h"

namespace spindle::cuda {
namespace {

constexpr double kBf16Bound = 1e-2;
constexpr double kFp32Bound = 1e-3;
constexpr double kBf16RowBound = 4e-3;

// The worst row of a bf16 result [rows, D]: its largest |got - want| over its largest |want|;
// infinite where `got` holds a non-finite value.
double row_error(const std::vector<bf16>& got, const std::vector<double>& want, int64_t D) {
  double worst = 0;
  for (size_t first = 0; first < got.size(); first += static_cast<size_t>(D)) {
    double diff = 0, scale = 0;
    for (size_t i = first; i < first + static_cast<size_t>(D); ++i) {
      const double g = __bfloat162float(got[i]);
      if (!std::isfinite(g)) return INFINITY;
      diff = std::max(diff, std::abs(g - want[i]));
      scale = std::max(scale, std::abs(want[i]));
    }
    worst = std::max(worst, diff / std::max(scale, 1e-300));
  }
  return worst;
}

// The first C values of each of T rows ld apart; `gaps_written` counts the values between the rows
// that are not NaN (written where they should have kept their poison).
std::vector<bf16> packed_rows(const std::vector<bf16>& rows, int64_t T, int64_t C, int64_t ld,
                              int64_t& gaps_written) {
  std::vector<bf16> packed(T * C);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < ld; ++c) {
      const bf16 v = rows[t * ld + c];
      if (c < C)
        packed[t * C + c] = v;
      else
        gaps_written += !std::isnan(__bfloat162float(v));
    }
  return packed;
}

TEST(CudaConvMhc, CausalConvSiluForwardAndBackward) {
  // (tokens, channels, K): tokens not a multiple of the 64-token tile or of the 8-token load batch,
  // channels not a multiple of 128 (or of 8), odd channels (one per thread) and even (two), fewer
  // tokens than taps, the 4B model's KDA shape, channels 2 mod 4 (two a thread, not four); dx into
  // columns of a wider buffer (the KDA backward's stacked gradients), its rows an even and an odd
  // number of values apart; x in columns of a wider buffer (the KDA forward's projections side by
  // side, 6400 values a row at the 4B config), its rows 2 mod 4 (two a thread) and an odd number of
  // values apart, the values between its rows NaN (never read).
  for (auto [T, C, K, dx_ld, x_ld] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{1000, 256, 4, 256, 256},
        {1029, 2048, 4, 2048, 2048},
        {1029, 2048, 4, 6416, 6400},
        {333, 100, 3, 100, 100},
        {333, 100, 3, 101, 100},
        {333, 100, 3, 100, 102},
        {70, 1031, 4, 1031, 1031},
        {2, 64, 4, 64, 64},
        {130, 40, 8, 40, 41},
        {65, 129, 1, 129, 129},
        {300, 102, 4, 102, 102}}) {
    const auto x = rounded(random_floats(T * C)), dy = rounded(random_floats(T * C));
    const auto w = random_floats(C * K, 0.5f), dw0 = random_floats(C * K);
    std::vector<float> x_rows(T * x_ld, NAN);
    for (int64_t t = 0; t < T; ++t) std::copy_n(x.begin() + t * C, C, x_rows.begin() + t * x_ld);
    Stream stream;
    auto xb = device(to_bf16(x_rows)), dyb = device(to_bf16(dy));
    auto wb = device(w, MemoryCategory::Weights);
    auto dwb = device(dw0, MemoryCategory::Gradients);
    auto y = poisoned<bf16>(T * C), dx = poisoned<bf16>(T * dx_ld);
    causal_conv_silu(xb.data(), x_ld, wb.data(), y.data(), T, C, K, stream.get());
    causal_conv_silu_backward(xb.data(), x_ld, wb.data(), dyb.data(), dx.data(), dx_ld, dwb.data(), T, C, K,
                              stream.get());
    stream.synchronize();
    const auto xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
    std::vector<double> y_ref(T * C), dx_ref(T * C), dw_ref(C * K, 0.0);
    cpu::causal_conv_silu(xd.data(), wd.data(), y_ref.data(), T, C, K);
    cpu::causal_conv_silu_backward(xd.data(), wd.data(), dyd.data(), dx_ref.data(), dw_ref.data(), T, C, K);
    EXPECT_LT(relative_error(y.download(), y_ref), kBf16Bound)
        << "y, T=" << T << " C=" << C << " K=" << K << " x_ld=" << x_ld;
    int64_t gaps_written = 0;  // the values between dx's rows keep their poison
    const std::vector<bf16> dx_got = packed_rows(dx.download(), T, C, dx_ld, gaps_written);
    EXPECT_LT(relative_error(dx_got, dx_ref), kBf16Bound)
        << "dx, T=" << T << " C=" << C << " K=" << K << " dx_ld=" << dx_ld << " x_ld=" << x_ld;
    EXPECT_EQ(gaps_written, 0) << "dx_ld=" << dx_ld;
    EXPECT_LT(increment_error(dwb.download(), dw0, dw_ref), kFp32Bound)
        << "dw, T=" << T << " C=" << C << " K=" << K << " x_ld=" << x_ld;
  }
}

TEST(CudaConvMhc, CausalConvSiluWithL2NormsEqualsTheConvThenTheNorms) {
  // (tokens, channels, K, head_dim, x_ld, skip, fused): in one pass with heads of 128 (four channels a
  // thread, a warp a head: the KDA's q and k, x in the projections' columns, many runs that start past
  // `skip`), 64 (four, half a warp a head), 32 (one, x's rows an odd number of values apart), 16 and 8
  // (four, a head of four and two lanes: the tests' tiny models; 64 channels leave half of a warp's
  // lanes without channels); skip 0; fewer tokens than a load batch. In more passes where x's alignment
  // allows two channels a thread for heads of 128 (64 lanes a head) and for heads of 48 (no power of
  // two of lanes). The backward: dx into columns of a wider buffer (the KDA's stacked gradients).
  for (auto [T, C, K, head_dim, x_ld, skip, fused] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>{1029, 2048, 4, 128, 6400, 3,
                                                                               true},
        {2000, 512, 4, 128, 512, 0, true},
        {333, 256, 4, 64, 256, 3, true},
        {130, 96, 3, 32, 101, 2, true},
        {5, 128, 4, 128, 128, 3, true},
        {70, 64, 4, 8, 64, 3, true},
        {150, 96, 4, 16, 96, 3, true},
        {300, 256, 4, 128, 258, 3, false},
        {90, 96, 4, 48, 96, 3, false}}) {
    const auto x = rounded(random_floats(T * C));
    const auto w = random_floats(C * K, 0.5f), dw0 = random_floats(C * K);
    const auto dz = rounded(random_floats((T - skip) * C));
    std::vector<float> x_rows(T * x_ld, NAN);
    for (int64_t t = 0; t < T; ++t) std::copy_n(x.begin() + t * C, C, x_rows.begin() + t * x_ld);
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim)), eps = 1e-6f;
    const int64_t dx_ld = C + 8;
    Stream stream;
    auto xb = device(to_bf16(x_rows));
    auto dzb = device(to_bf16(dz));
    auto wb = device(w, MemoryCategory::Weights);
    auto dwb = device(dw0, MemoryCategory::Gradients);
    auto z = poisoned<bf16>((T - skip) * C), dx = poisoned<bf16>(T * dx_ld);
    const bool forward_fused = causal_conv_silu_l2(xb.data(), x_ld, wb.data(), z.data(), skip, T, C, K,
                                                   head_dim, eps, scale, stream.get());
    const bool backward_fused =
        causal_conv_silu_l2_backward(xb.data(), x_ld, wb.data(), dzb.data(), skip, dx.data(), dx_ld,
                                     dwb.data(), T, C, K, head_dim, eps, scale, stream.get());
    stream.synchronize();
    const auto xd = to_double(x), wd = to_double(w);
    std::vector<double> y_ref(T * C);
    cpu::causal_conv_silu(xd.data(), wd.data(), y_ref.data(), T, C, K);
    std::vector<double> z_ref(y_ref.begin() + skip * C, y_ref.end());
    cpu::l2_normalize(z_ref.data(), (T - skip) * C / head_dim, head_dim, double{eps});
    for (double& v : z_ref) v *= scale;
    // The conv output's gradient: zero in the skipped rows, then the norm's backward (scaled).
    std::vector<double> dy_ref(T * C, 0.0), dx_ref(T * C), dw_ref(C * K, 0.0);
    std::vector<double> dzd = to_double(dz);
    for (double& v : dzd) v *= scale;
    cpu::l2_normalize_backward(y_ref.data() + skip * C, dzd.data(), dy_ref.data() + skip * C,
                               (T - skip) * C / head_dim, head_dim, double{eps});
    cpu::causal_conv_silu_backward(xd.data(), wd.data(), dy_ref.data(), dx_ref.data(), dw_ref.data(), T, C,
                                   K);
    const std::string shape = "T=" + std::to_string(T) + " C=" + std::to_string(C) +
                              " K=" + std::to_string(K) + " head_dim=" + std::to_string(head_dim) +
                              " x_ld=" + std::to_string(x_ld) + " skip=" + std::to_string(skip);
    EXPECT_EQ(forward_fused, fused) << shape;
    EXPECT_EQ(backward_fused, fused) << shape;
    EXPECT_LT(relative_error(z.download(), z_ref), kBf16Bound) << "z, " << shape;
    int64_t gaps_written = 0;  // the values between dx's rows keep their poison
    const std::vector<bf16> dx_got = packed_rows(dx.download(), T, C, dx_ld, gaps_written);
    EXPECT_LT(relative_error(dx_got, dx_ref), kBf16Bound) << "dx, " << shape;
    EXPECT_EQ(gaps_written, 0) << shape;
    EXPECT_LT(increment_error(dwb.download(), dw0, dw_ref), kBf16Bound) << "dw, " << shape;
  }
}

struct HcCase {
  int64_t tokens, H, D;
};

// (tokens, H, D): tokens not a multiple of the 64-token tile, D not a multiple of 8 or of the 256
// threads, H D not a multiple of the 64-element mix slice; 2100 tokens span several 1024-token dfn
// blocks. H 1 and 3: mix outputs M = (2 + H) H not a multiple of 4 or 8 (the MMA tiles' and the
// dm rows' padding; the dfn's w chunk in 16-byte pieces); H 6 and 8: the backward's one-column
// path (M > 24). 200 x 4 x 512: 32 mix slices per tile (the cp.async ring wraps many times) on the
// 16-byte path; 1100 x 2 x 200: dfn's last 128-column block partial, two 1024-token blocks.
// Three are wider: 70 x 4 x 2048, the model's width; 40 x 3 x 1400 and 33 x 5 x 1000, wide
// rows on the two-column and one-column paths. 40 x 4 x 32: hc_combine_mix's one slice, fewer than
// its ring loads ahead. The collapse's norm (hidden a multiple of 8; a token a warp's, 8 columns a lane
// an item): 2048 eight items a lane, 256 one, 768 three, 4096 (the full model's) sixteen, 1000 and 200
// a last item on some lanes only, 24 and 40 lanes without any item.
const HcCase kHcCases[] = {{130, 4, 256}, {77, 4, 1000}, {333, 2, 61},   {19, 8, 40},   {1, 4, 12},
                           {2100, 4, 96}, {200, 4, 512}, {1100, 2, 200}, {70, 1, 24},   {150, 3, 64},
                           {65, 6, 32},   {90, 3, 13},   {70, 4, 2048},  {40, 3, 1400}, {33, 5, 1000},
                           {40, 4, 32},   {75, 4, 768},  {20, 2, 4096}};

cpu::HcShape shape_of(const HcCase& c) { return cpu::HcShape{c.tokens, c.H, c.D, 1e-6, 1e-6, 20}; }

// Random parameters with mix logits of order one: fn ~ N(0, 1 / sqrt(H D)).
struct HcParams {
  std::vector<float> fn, base, scale;
  explicit HcParams(const HcCase& c)
      : fn(random_floats(static_cast<size_t>((2 + c.H) * c.H * c.H * c.D),
                         1.0f / std::sqrt(float(c.H * c.D)))),
        base(random_floats(static_cast<size_t>((2 + c.H) * c.H), 0.5f)),
        scale(random_uniform(3, 0.3f, 1.5f)) {}
};

TEST(CudaConvMhc, HcCoefficientsForward) {
  for (const HcCase& c : kHcCases) {
    const cpu::HcShape s = shape_of(c);
    const int64_t T = c.tokens, H = c.H, D = c.D;
    const HcParams p(c);
    const auto x = rounded(random_floats(T * H * D));
    Stream stream;
    auto xb = device(to_bf16(x));
    auto fn = device(p.fn, MemoryCategory::Weights);
    auto base = device(p.base, MemoryCategory::Weights), scale = device(p.scale, MemoryCategory::Weights);
    auto pre = poisoned<float>(T * H), post = poisoned<float>(T * H), comb = poisoned<float>(T * H * H);
    auto collapsed = poisoned<bf16>(T * D), normed = poisoned<bf16>(T * D);
    const auto norm_weight = rounded(random_uniform(D, 0.5f, 1.5f));
    auto weight = device(to_bf16(norm_weight), MemoryCategory::Weights);
    const HcNorm norm{weight.data(), normed.data(), 1e-5f};
    EXPECT_EQ(hc_norm_fused(s, xb.data(), collapsed.data(), norm), D % 8 == 0)
        << "T=" << T << " H=" << H << " D=" << D;
    auto mix = poisoned<float>(static_cast<size_t>(hc_mix_floats(s)));
    hc_coefficients(s, xb.data(), fn.data(), base.data(), scale.data(), pre.data(), post.data(), comb.data(),
                    collapsed.data(), norm, stream.get(), mix.data());
    // Everything again from the kept mix, as a site's backward does: the very same values.
    auto pre2 = poisoned<float>(T * H), post2 = poisoned<float>(T * H), comb2 = poisoned<float>(T * H * H);
    auto collapsed2 = poisoned<bf16>(T * D), normed2 = poisoned<bf16>(T * D);
    hc_coefficients_from_mix(s, xb.data(), mix.data(), base.data(), scale.data(), pre2.data(), post2.data(),
                             comb2.data(), collapsed2.data(), {weight.data(), normed2.data(), 1e-5f},
                             stream.get());
    stream.synchronize();
    const auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    const std::string case_name =
        " T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D);
    EXPECT_TRUE(same(pre.download(), pre2.download())) << "pre from the mix" << case_name;
    EXPECT_TRUE(same(post.download(), post2.download())) << "post from the mix" << case_name;
    EXPECT_TRUE(same(comb.download(), comb2.download())) << "comb from the mix" << case_name;
    EXPECT_TRUE(same(collapsed.download(), collapsed2.download())) << "collapsed from the mix" << case_name;
    EXPECT_TRUE(same(normed.download(), normed2.download())) << "normed from the mix" << case_name;
    // The norm of the collapsed values as stored, against the CPU's in double.
    const auto stored = collapsed.download();
    std::vector<double> stored_d(stored.size()), normed_ref(stored.size());
    for (size_t i = 0; i < stored.size(); ++i) stored_d[i] = __bfloat162float(stored[i]);
    const auto weight_d = to_double(norm_weight);
    cpu::rms_norm(stored_d.data(), weight_d.data(), normed_ref.data(), T, D, 1e-5);
    EXPECT_LT(relative_error(normed.download(), normed_ref), kBf16Bound) << "normed" << case_name;
    const auto xd = to_double(x), fnd = to_double(p.fn), based = to_double(p.base),
               scaled = to_double(p.scale);
    std::vector<double> pre_ref(T * H), post_ref(T * H), comb_ref(T * H * H), col_ref(T * D);
    cpu::hc_coefficients(s, xd.data(), fnd.data(), based.data(), scaled.data(), pre_ref.data(),
                         post_ref.data(), comb_ref.data(), col_ref.data());
    const std::string where =
        " T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D);
    EXPECT_LT(relative_error(pre.download(), pre_ref), kFp32Bound) << "pre" << where;
    EXPECT_LT(relative_error(post.download(), post_ref), kFp32Bound) << "post" << where;
    EXPECT_LT(relative_error(comb.download(), comb_ref), kFp32Bound) << "comb" << where;
    EXPECT_LT(relative_error(collapsed.download(), col_ref), kBf16Bound) << "collapsed" << where;
  }
}

TEST(CudaConvMhc, HcCombineForwardAndBackward) {
  for (const HcCase& c : kHcCases) {
    const cpu::HcShape s = shape_of(c);
    const int64_t T = c.tokens, H = c.H, D = c.D;
    const auto x = rounded(random_floats(T * H * D)), y = rounded(random_floats(T * D));
    const auto post = random_uniform(T * H, 0.0f, 2.0f), comb = random_uniform(T * H * H, 0.0f, 1.0f);
    const auto dout = rounded(random_floats(T * H * D));
    Stream stream;
    auto xb = device(to_bf16(x)), yb = device(to_bf16(y));
    auto postb = device(post), combb = device(comb);
    auto doutb = device(to_bf16(dout), MemoryCategory::Gradients);
    auto dsb = poisoned<bf16>(T * H * D);  // written, not accumulated
    auto out = poisoned<bf16>(T * H * D), dy = poisoned<bf16>(T * D);
    auto d_post = poisoned<float>(T * H), d_comb = poisoned<float>(T * H * H);
    hc_combine(s, xb.data(), yb.data(), postb.data(), combb.data(), out.data(), stream.get());
    hc_combine_backward(s, xb.data(), postb.data(), combb.data(), doutb.data(), dsb.data(), dy.data(),
                        d_comb.data(), stream.get());
    hc_post_gradient(s, yb.data(), doutb.data(), d_post.data(), stream.get());
    // With y known: d_post in the same pass.
    auto ds2 = poisoned<bf16>(T * H * D);
    auto dy2 = poisoned<bf16>(T * D);
    auto d_post2 = poisoned<float>(T * H), d_comb2 = poisoned<float>(T * H * H);
    hc_combine_backward(s, xb.data(), postb.data(), combb.data(), doutb.data(), ds2.data(), dy2.data(),
                        d_comb2.data(), stream.get(), yb.data(), d_post2.data());
    stream.synchronize();
    const auto xd = to_double(x), yd = to_double(y), postd = to_double(post), combd = to_double(comb);
    const auto doutd = to_double(dout);
    std::vector<double> out_ref(T * H * D), ds_ref(T * H * D, 0.0), dy_ref(T * D), dpost_ref(T * H),
        dcomb_ref(T * H * H);
    cpu::hc_combine(s, xd.data(), yd.data(), postd.data(), combd.data(), out_ref.data());
    cpu::hc_combine_backward(s, xd.data(), yd.data(), postd.data(), combd.data(), doutd.data(), ds_ref.data(),
                             dy_ref.data(), dpost_ref.data(), dcomb_ref.data());
    const std::string where =
        " T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D);
    EXPECT_LT(relative_error(out.download(), out_ref), kBf16Bound) << "out" << where;
    EXPECT_LT(relative_error(dy.download(), dy_ref), kBf16Bound) << "dy" << where;
    EXPECT_LT(relative_error(d_post.download(), dpost_ref), kFp32Bound) << "d_post" << where;
    EXPECT_LT(relative_error(d_comb.download(), dcomb_ref), kFp32Bound) << "d_comb" << where;
    EXPECT_LT(row_error(dsb.download(), ds_ref, D), kBf16RowBound) << "dstreams" << where;
    EXPECT_LT(row_error(ds2.download(), ds_ref, D), kBf16RowBound) << "dstreams with d_post" << where;
    EXPECT_LT(relative_error(dy2.download(), dy_ref), kBf16Bound) << "dy with d_post" << where;
    EXPECT_LT(relative_error(d_post2.download(), dpost_ref), kFp32Bound)
        << "d_post with the combine" << where;
    EXPECT_LT(relative_error(d_comb2.download(), dcomb_ref), kFp32Bound) << "d_comb with d_post" << where;
  }
}

// A site's backward inputs in one pass (hc_site_backward_inputs) against the two calls it stands for:
// hc_coefficients_from_mix and hc_combine_backward with y, without dstreams. The same bits for every
// output, on every case whose rows are in 16-byte vectors; the others it must refuse.
TEST(CudaConvMhc, SiteBackwardInputsInOnePassEqualTheTwoCalls) {
  int taken = 0;
  for (const HcCase& c : kHcCases) {
    const cpu::HcShape s = shape_of(c);
    const int64_t T = c.tokens, H = c.H, D = c.D;
    const std::string where =
        " T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D);
    const HcParams p(c);
    const auto x = rounded(random_floats(T * H * D)), y = rounded(random_floats(T * D));
    const auto dout = rounded(random_floats(T * H * D));
    Stream stream;
    auto xb = device(to_bf16(x)), yb = device(to_bf16(y)), doutb = device(to_bf16(dout));
    auto fn = device(p.fn, MemoryCategory::Weights);
    auto base = device(p.base, MemoryCategory::Weights), scale = device(p.scale, MemoryCategory::Weights);
    auto weight = device(to_bf16(rounded(random_uniform(D, 0.5f, 1.5f))), MemoryCategory::Weights);
    auto mix = poisoned<float>(static_cast<size_t>(hc_mix_floats(s)));
    {
      auto pre = poisoned<float>(T * H), post = poisoned<float>(T * H), comb = poisoned<float>(T * H * H);
      auto collapsed = poisoned<bf16>(T * D), normed = poisoned<bf16>(T * D);
      hc_coefficients(s, xb.data(), fn.data(), base.data(), scale.data(), pre.data(), post.data(),
                      comb.data(), collapsed.data(), {weight.data(), normed.data(), 1e-5f}, stream.get(),
                      mix.data());
    }
    // [0]: the two calls; [1]: the one pass.
    std::vector<DeviceBuffer<float>> pre, post, comb, d_post, d_comb;
    std::vector<DeviceBuffer<bf16>> collapsed, normed, dy;
    for (int i = 0; i < 2; ++i) {
      pre.push_back(poisoned<float>(T * H));
      post.push_back(poisoned<float>(T * H));
      comb.push_back(poisoned<float>(T * H * H));
      d_post.push_back(poisoned<float>(T * H));
      d_comb.push_back(poisoned<float>(T * H * H));
      collapsed.push_back(poisoned<bf16>(T * D));
      normed.push_back(poisoned<bf16>(T * D));
      dy.push_back(poisoned<bf16>(T * D));
    }
    const auto norm = [&](int i) { return HcNorm{weight.data(), normed[i].data(), 1e-5f}; };
    const HcCombineGrad grad{doutb.data(), yb.data(), dy[1].data(), d_comb[1].data(), d_post[1].data()};
    const bool fused = hc_site_backward_fused(s, xb.data(), collapsed[1].data(), norm(1), grad);
    EXPECT_EQ(fused, D % 8 == 0) << where;
    if (!fused) {
      EXPECT_THROW(hc_site_backward_inputs(s, xb.data(), mix.data(), base.data(), scale.data(), pre[1].data(),
                                           post[1].data(), comb[1].data(), collapsed[1].data(), norm(1), grad,
                                           stream.get()),
                   Error)
          << where;
      continue;
    }
    ++taken;
    hc_coefficients_from_mix(s, xb.data(), mix.data(), base.data(), scale.data(), pre[0].data(),
                             post[0].data(), comb[0].data(), collapsed[0].data(), norm(0), stream.get());
    hc_combine_backward(s, xb.data(), post[0].data(), comb[0].data(), doutb.data(), nullptr, dy[0].data(),
                        d_comb[0].data(), stream.get(), yb.data(), d_post[0].data());
    hc_site_backward_inputs(s, xb.data(), mix.data(), base.data(), scale.data(), pre[1].data(),
                            post[1].data(), comb[1].data(), collapsed[1].data(), norm(1), grad, stream.get());
    stream.synchronize();
    const auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    EXPECT_TRUE(same(pre[0].download(), pre[1].download())) << "pre" << where;
    EXPECT_TRUE(same(post[0].download(), post[1].download())) << "post" << where;
    EXPECT_TRUE(same(comb[0].download(), comb[1].download())) << "comb" << where;
    EXPECT_TRUE(same(collapsed[0].download(), collapsed[1].download())) << "collapsed" << where;
    EXPECT_TRUE(same(normed[0].download(), normed[1].download())) << "normed" << where;
    EXPECT_TRUE(same(dy[0].download(), dy[1].download())) << "dy" << where;
    EXPECT_TRUE(same(d_comb[0].download(), d_comb[1].download())) << "d_comb" << where;
    EXPECT_TRUE(same(d_post[0].download(), d_post[1].download())) << "d_post" << where;
  }
  EXPECT_GE(taken, 10);
}

// hc_combine_mix against hc_combine and then hc_coefficients on its output with the next site's fn:
// the same output bit for bit; the mix to fp32 rounding (another summation order), and the
// coefficients from it against the CPU's. On every case it takes (hc_mult 4, hidden a multiple of
// 32: tokens past a tile, one slice of columns, the model's width); it must refuse the others.
TEST(CudaConvMhc, HcCombineMixEqualsTheCombineThenTheNextMix) {
  int taken = 0;
  for (const HcCase& c : kHcCases) {
    const cpu::HcShape s = shape_of(c);
    const int64_t T = c.tokens, H = c.H, D = c.D;
    const auto x = rounded(random_floats(T * H * D)), y = rounded(random_floats(T * D));
    const auto post = random_uniform(T * H, 0.0f, 2.0f), comb = random_uniform(T * H * H, 0.0f, 1.0f);
    const HcParams next(c);
    Stream stream;
    auto xb = device(to_bf16(x)), yb = device(to_bf16(y));
    auto postb = device(post), combb = device(comb);
    auto out = poisoned<bf16>(T * H * D);
    const bool supported = hc_combine_mix_supported(s, xb.data(), yb.data(), out.data());
    EXPECT_EQ(supported, H == 4 && D % 32 == 0) << "T=" << T << " H=" << H << " D=" << D;
    if (!supported) continue;
    ++taken;
    auto fn = device(next.fn, MemoryCategory::Weights);
    auto base = device(next.base, MemoryCategory::Weights),
         scale = device(next.scale, MemoryCategory::Weights);
    auto mix = poisoned<float>(static_cast<size_t>(hc_mix_floats(s)));
    hc_combine_mix(s, xb.data(), yb.data(), postb.data(), combb.data(), out.data(), fn.data(), mix.data(),
                   stream.get());
    auto out_ref = poisoned<bf16>(T * H * D);
    auto mix_ref = poisoned<float>(static_cast<size_t>(hc_mix_floats(s)));
    auto pre = poisoned<float>(T * H), post2 = poisoned<float>(T * H), comb2 = poisoned<float>(T * H * H);
    auto collapsed = poisoned<bf16>(T * D);
    hc_combine(s, xb.data(), yb.data(), postb.data(), combb.data(), out_ref.data(), stream.get());
    hc_coefficients(s, out_ref.data(), fn.data(), base.data(), scale.data(), pre.data(), post2.data(),
                    comb2.data(), collapsed.data(), {}, stream.get(), mix_ref.data());
    // The next site's coefficients from the handed mix, as residual_site_forward takes them.
    auto pre_m = poisoned<float>(T * H), post_m = poisoned<float>(T * H), comb_m = poisoned<float>(T * H * H);
    auto collapsed_m = poisoned<bf16>(T * D);
    hc_coefficients_from_mix(s, out.data(), mix.data(), base.data(), scale.data(), pre_m.data(),
                             post_m.data(), comb_m.data(), collapsed_m.data(), {}, stream.get());
    stream.synchronize();
    const std::string where =
        " T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D);
    const auto got = out.download(), want = out_ref.download();
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(bf16)), 0) << "out" << where;
    const auto mix_want = mix_ref.download();
    EXPECT_LT(relative_error(mix.download(), to_double(mix_want)), 1e-5) << "mix" << where;
    std::vector<double> outd(got.size());
    for (size_t i = 0; i < got.size(); ++i) outd[i] = __bfloat162float(got[i]);
    const auto fnd = to_double(next.fn), based = to_double(next.base), scaled = to_double(next.scale);
    std::vector<double> pre_ref(T * H), post_ref(T * H), comb_ref(T * H * H), col_ref(T * D);
    cpu::hc_coefficients(s, outd.data(), fnd.data(), based.data(), scaled.data(), pre_ref.data(),
                         post_ref.data(), comb_ref.data(), col_ref.data());
    EXPECT_LT(relative_error(pre_m.download(), pre_ref), kFp32Bound) << "pre" << where;
    EXPECT_LT(relative_error(post_m.download(), post_ref), kFp32Bound) << "post" << where;
    EXPECT_LT(relative_error(comb_m.download(), comb_ref), kFp32Bound) << "comb" << where;
    EXPECT_LT(relative_error(collapsed_m.download(), col_ref), kBf16Bound) << "collapsed" << where;
  }
  EXPECT_GE(taken, 4) << "cases hc_combine_mix takes";
}

TEST(CudaConvMhc, HcCoefficientsBackward) {
  for (const HcCase& c : kHcCases) {
    const cpu::HcShape s = shape_of(c);
    const int64_t T = c.tokens, H = c.H, D = c.D, M = (2 + H) * H;
    const HcParams p(c);
    const auto x = rounded(random_floats(T * H * D)), dcol = rounded(random_floats(T * D));
    const auto d_pre = random_floats(T * H), d_post = random_floats(T * H), d_comb = random_floats(T * H * H);
    const auto ds0 = rounded(random_floats(T * H * D)), dfn0 = random_floats(M * H * D, 0.01f);
    const auto dbase0 = random_floats(M), dscale0 = random_floats(3);
    Stream stream;
    auto xb = device(to_bf16(x)), dcolb = device(to_bf16(dcol));
    auto fn = device(p.fn, MemoryCategory::Weights);
    auto base = device(p.base, MemoryCategory::Weights), scale = device(p.scale, MemoryCategory::Weights);
    auto d_preb = device(d_pre), d_postb = device(d_post), d_combb = device(d_comb);
    auto dsb = device(to_bf16(ds0), MemoryCategory::Gradients);
    auto dfnb = device(dfn0, MemoryCategory::Gradients);
    auto dbaseb = device(dbase0, MemoryCategory::Gradients),
         dscaleb = device(dscale0, MemoryCategory::Gradients);
    auto workspace = poisoned<float>(static_cast<size_t>(hc_coefficients_backward_workspace(s)));
    // The mix from the forward, as a site's backward has it.
    auto mix = poisoned<float>(static_cast<size_t>(hc_mix_floats(s)));
    {
      auto pre = poisoned<float>(T * H), post = poisoned<float>(T * H), comb = poisoned<float>(T * H * H);
      auto collapsed = poisoned<bf16>(T * D);
      hc_coefficients(s, xb.data(), fn.data(), base.data(), scale.data(), pre.data(), post.data(),
                      comb.data(), collapsed.data(), {}, stream.get(), mix.data());
      stream.synchronize();  // before the scratch buffers go
    }
    hc_coefficients_backward(s, xb.data(), mix.data(), fn.data(), base.data(), scale.data(), d_preb.data(),
                             d_postb.data(), d_combb.data(), dcolb.data(), nullptr, nullptr, dsb.data(),
                             dfnb.data(), dbaseb.data(), dscaleb.data(), workspace.data(), stream.get());
    // The fused form: dstreams written as hc_combine's part (comb^T dout) plus this one's, while
    // hc_combine_backward leaves dstreams alone (its other outputs, as above).
    const auto comb = random_uniform(T * H * H, 0.0f, 1.0f), post = random_uniform(T * H, 0.0f, 2.0f);
    const auto dout = rounded(random_floats(T * H * D));
    auto combb = device(comb), postb = device(post);
    auto doutb = device(to_bf16(dout), MemoryCategory::Gradients);
    auto fused = poisoned<bf16>(T * H * D);  // written, not accumulated
    auto dy_fused = poisoned<bf16>(T * D);
    auto d_comb_fused = poisoned<float>(T * H * H);
    hc_combine_backward(s, xb.data(), postb.data(), combb.data(), doutb.data(), nullptr, dy_fused.data(),
                        d_comb_fused.data(), stream.get());
    auto dfn2 = device(dfn0, MemoryCategory::Gradients), dbase2 = device(dbase0, MemoryCategory::Gradients),
         dscale2 = device(dscale0, MemoryCategory::Gradients);
    hc_coefficients_backward(s, xb.data(), mix.data(), fn.data(), base.data(), scale.data(), d_preb.data(),
                             d_postb.data(), d_combb.data(), dcolb.data(), combb.data(), doutb.data(),
                             fused.data(), dfn2.data(), dbase2.data(), dscale2.data(), workspace.data(),
                             stream.get());
    stream.synchronize();
    const auto xd = to_double(x), fnd = to_double(p.fn), based = to_double(p.base),
               scaled = to_double(p.scale);
    const auto dpred = to_double(d_pre), dpostd = to_double(d_post), dcombd = to_double(d_comb);
    const auto dcold = to_double(dcol);
    std::vector<double> ds_ref(T * H * D, 0.0), dfn_ref(M * H * D, 0.0), dbase_ref(M, 0.0),
        dscale_ref(3, 0.0);
    cpu::hc_coefficients_backward(s, xd.data(), fnd.data(), based.data(), scaled.data(), dpred.data(),
                                  dpostd.data(), dcombd.data(), dcold.data(), ds_ref.data(), dfn_ref.data(),
                                  dbase_ref.data(), dscale_ref.data());
    const std::string where =
        " T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D);
    // Accumulated in bf16: the sum start + increment, rounded once.
    std::vector<double> ds_sum(T * H * D);
    for (size_t i = 0; i < ds_sum.size(); ++i) ds_sum[i] = ds0[i] + ds_ref[i];
    EXPECT_LT(row_error(dsb.download(), ds_sum, D), kBf16RowBound) << "dstreams" << where;
    EXPECT_LT(increment_error(dfnb.download(), dfn0, dfn_ref), kFp32Bound) << "dfn" << where;
    EXPECT_LT(increment_error(dbaseb.download(), dbase0, dbase_ref), kFp32Bound) << "dbase" << where;
    EXPECT_LT(increment_error(dscaleb.download(), dscale0, dscale_ref), kFp32Bound) << "dscale" << where;
    // The CPU's two parts of the fused form: hc_combine_backward's streams' gradient, then this one's.
    std::vector<double> fused_ref(T * H * D, 0.0), y_zero(T * D, 0.0), dy_ref(T * D), dpost_ref(T * H),
        dcomb_ref(T * H * H), dfn_scratch(M * H * D, 0.0), dbase_scratch(M, 0.0), dscale_scratch(3, 0.0);
    const auto combd = to_double(comb), postd = to_double(post), doutd = to_double(dout);
    cpu::hc_combine_backward(s, xd.data(), y_zero.data(), postd.data(), combd.data(), doutd.data(),
                             fused_ref.data(), dy_ref.data(), dpost_ref.data(), dcomb_ref.data());
    cpu::hc_coefficients_backward(s, xd.data(), fnd.data(), based.data(), scaled.data(), dpred.data(),
                                  dpostd.data(), dcombd.data(), dcold.data(), fused_ref.data(),
                                  dfn_scratch.data(), dbase_scratch.data(), dscale_scratch.data());
    EXPECT_LT(row_error(fused.download(), fused_ref, D), kBf16RowBound) << "dstreams, fused" << where;
    EXPECT_LT(relative_error(dy_fused.download(), dy_ref), kBf16Bound) << "dy, no dstreams" << where;
    EXPECT_LT(relative_error(d_comb_fused.download(), dcomb_ref), kFp32Bound)
        << "d_comb, no dstreams" << where;
    EXPECT_LT(increment_error(dfn2.download(), dfn0, dfn_ref), kFp32Bound) << "dfn, fused" << where;
  }
}

}  // namespace
}  // namespace spindle::cuda
