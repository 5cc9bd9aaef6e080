// The delta rule's backward in chunk form (matrix products per chunk, the state gradient carried
// between chunks) against the token-by-token backward, in double.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/random.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/kda_chunked.h"

namespace spindle::cpu {
namespace {

struct Case {
  int64_t tokens, heads, dk, dv, chunk;
  double g_low;  // log decays uniform in [g_low, 0]
  bool carries;  // an initial state and a gradient arriving at the final state
};

struct Inputs {
  std::vector<double> q, k, v, g, beta, dout, initial, d_final;
};

Inputs make_inputs(const Case& c, uint64_t seed) {
  Random rng(seed);
  const auto draw = [&](int64_t n, double scale) {
    std::vector<double> x(static_cast<size_t>(n));
    for (double& e : x) e = rng.normal() * scale;
    return x;
  };
  const int64_t rows = c.tokens * c.heads, SS = c.heads * c.dk * c.dv;
  Inputs in;
  in.q = draw(rows * c.dk, 0.5);
  in.k = draw(rows * c.dk, 1.0);
  in.v = draw(rows * c.dv, 1.0);
  in.dout = draw(rows * c.dv, 1.0);
  in.g.resize(static_cast<size_t>(rows * c.dk));
  for (double& x : in.g) x = rng.uniform(c.g_low, 0.0);
  in.beta.resize(static_cast<size_t>(rows));
  for (double& b : in.beta) b = 1.0 / (1.0 + std::exp(-rng.normal()));
  for (int64_t r = 0; r < rows; ++r) {  // l2-normalised keys, as the model feeds them
    double n = 0;
    for (int64_t i = 0; i < c.dk; ++i) n += in.k[r * c.dk + i] * in.k[r * c.dk + i];
    for (int64_t i = 0; i < c.dk; ++i) in.k[r * c.dk + i] /= std::sqrt(n);
  }
  if (c.carries) {
    in.initial = draw(SS, 1.0);
    in.d_final = draw(SS, 1.0);
  }
  return in;
}

struct Grads {
  std::vector<double> dq, dk, dv, dg, dbeta, d_initial;
};

// Runs `backward` (either form, same signature but for the last-but-one argument) on the inputs.
template <class Backward>
Grads run(const Case& c, const Inputs& in, int64_t block, Backward backward) {
  Grads d;
  d.dq.resize(in.q.size());
  d.dk.resize(in.k.size());
  d.dv.resize(in.v.size());
  d.dg.resize(in.g.size());
  d.dbeta.resize(in.beta.size());
  d.d_initial.resize(static_cast<size_t>(c.heads * c.dk * c.dv));
  const KdaChunkStates<double> states{c.carries ? in.initial.data() : nullptr,
                                      c.carries ? in.d_final.data() : nullptr, d.d_initial.data()};
  backward(KdaShape{c.tokens, c.heads, c.dk, c.dv}, in.q.data(), in.k.data(), in.v.data(), in.g.data(),
           in.beta.data(), in.dout.data(), d.dq.data(), d.dk.data(), d.dv.data(), d.dg.data(), d.dbeta.data(),
           block, states);
  return d;
}

// Largest difference relative to the largest reference entry.
double worst(const std::vector<double>& a, const std::vector<double>& ref) {
  double m = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::abs(a[i] - ref[i])), scale = std::max(scale, std::abs(ref[i]));
  return m / std::max(scale, 1e-300);
}

TEST(KdaChunked, BackwardEqualsTheTokenByTokenBackward) {
  const Case cases[] = {
      {150, 2, 8, 5, 8, -5.0, true},      // many small chunks, strong decay
      {150, 2, 8, 5, 8, -0.5, false},     // the same, weak decay, no carries
      {200, 2, 16, 12, 64, -0.5, true},   // C = 64, a partial last chunk (200 = 3 x 64 + 8)
      {130, 1, 12, 20, 64, -5.0, false},  // dv > dk
      {128, 2, 10, 10, 64, -5.0, true},   // whole chunks only
      {37, 3, 6, 4, 64, -0.5, true},      // one partial chunk
      {21, 1, 4, 3, 1, -5.0, true},       // chunks of one token
      {1, 2, 3, 2, 8, -0.5, true},
  };
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c, 1000 + static_cast<uint64_t>(c.tokens * 7 + c.chunk));
    const Grads ref = run(c, in, 16, kda_recurrence_backward<double>);
    const Grads got = run(c, in, c.chunk, kda_chunked_backward<double>);
    const std::string where = std::to_string(c.tokens) + " tokens, " + std::to_string(c.heads) +
                              " heads, dk " + std::to_string(c.dk) + ", dv " + std::to_string(c.dv) + ", C " +
                              std::to_string(c.chunk) + ", g in [" + std::to_string(c.g_low) + ", 0]" +
                              (c.carries ? ", carries" : "");
    EXPECT_LT(worst(got.dq, ref.dq), 1e-10) << where;
    EXPECT_LT(worst(got.dk, ref.dk), 1e-10) << where;
    EXPECT_LT(worst(got.dv, ref.dv), 1e-10) << where;
    EXPECT_LT(worst(got.dg, ref.dg), 1e-10) << where;
    EXPECT_LT(worst(got.dbeta, ref.dbeta), 1e-10) << where;
    EXPECT_LT(worst(got.d_initial, ref.d_initial), 1e-10) << where;
  }
}

// A sequence cut into pieces, each piece's chunked backward handed the next piece's initial-state
// gradient (the streaming executor's use), gives the whole sequence's gradients.
TEST(KdaChunked, BackwardInPiecesEqualsTheWholeSequence) {
  const Case whole{150, 2, 8, 6, 16, -1.0, false};
  const Inputs in = make_inputs(whole, 77);
  const Grads ref = run(whole, in, 16, kda_chunked_backward<double>);
  const int64_t H = whole.heads, dk = whole.dk, dv = whole.dv, SS = H * dk * dv;
  const std::vector<int64_t> bounds{0, 5, 70, 150};
  std::vector<std::vector<double>> starts;
  std::vector<double> state(static_cast<size_t>(SS), 0.0), scratch(in.v.size());
  for (size_t p = 0; p + 1 < bounds.size(); ++p) {
    starts.push_back(state);
    const int64_t t0 = bounds[p], n = bounds[p + 1] - t0;
    kda_recurrence<double>({n, H, dk, dv}, in.q.data() + t0 * H * dk, in.k.data() + t0 * H * dk,
                           in.v.data() + t0 * H * dv, in.g.data() + t0 * H * dk, in.beta.data() + t0 * H,
                           scratch.data(), state.data());
  }
  Grads got;
  for (auto* x : {&got.dq, &got.dk, &got.dg}) x->resize(in.q.size());
  got.dv.resize(in.v.size());
  got.dbeta.resize(in.beta.size());
  std::vector<double> d_next(static_cast<size_t>(SS), 0.0), d_here(static_cast<size_t>(SS));
  for (size_t p = bounds.size() - 1; p-- > 0;) {
    const int64_t t0 = bounds[p], n = bounds[p + 1] - t0;
    const KdaChunkStates<double> piece{starts[p].data(), d_next.data(), d_here.data()};
    kda_chunked_backward<double>(
        {n, H, dk, dv}, in.q.data() + t0 * H * dk, in.k.data() + t0 * H * dk, in.v.data() + t0 * H * dv,
        in.g.data() + t0 * H * dk, in.beta.data() + t0 * H, in.dout.data() + t0 * H * dv,
        got.dq.data() + t0 * H * dk, got.dk.data() + t0 * H * dk, got.dv.data() + t0 * H * dv,
        got.dg.data() + t0 * H * dk, got.dbeta.data() + t0 * H, 16, piece);
    d_next = d_here;
  }
  EXPECT_LT(worst(got.dq, ref.dq), 1e-10);
  EXPECT_LT(worst(got.dk, ref.dk), 1e-10);
  EXPECT_LT(worst(got.dv, ref.dv), 1e-10);
  EXPECT_LT(worst(got.dg, ref.dg), 1e-10);
  EXPECT_LT(worst(got.dbeta, ref.dbeta), 1e-10);
}

// The float instantiation follows the double one to float accuracy.
TEST(KdaChunked, FloatBackwardFollowsDouble) {
  const Case c{100, 2, 16, 8, 64, -1.0, true};
  const Inputs in = make_inputs(c, 5);
  const Grads ref = run(c, in, 64, kda_chunked_backward<double>);
  const auto to_float = [](const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); };
  const auto q = to_float(in.q), k = to_float(in.k), v = to_float(in.v), g = to_float(in.g),
             beta = to_float(in.beta), dout = to_float(in.dout), initial = to_float(in.initial),
             d_final = to_float(in.d_final);
  std::vector<float> dq(q.size()), dk(k.size()), dv(v.size()), dg(g.size()), db(beta.size()),
      d_initial(initial.size());
  kda_chunked_backward<float>({c.tokens, c.heads, c.dk, c.dv}, q.data(), k.data(), v.data(), g.data(),
                              beta.data(), dout.data(), dq.data(), dk.data(), dv.data(), dg.data(), db.data(),
                              64, {initial.data(), d_final.data(), d_initial.data()});
  const auto to_double = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  EXPECT_LT(worst(to_double(dq), ref.dq), 1e-5);
  EXPECT_LT(worst(to_double(dk), ref.dk), 1e-5);
  EXPECT_LT(worst(to_double(dv), ref.dv), 1e-5);
  EXPECT_LT(worst(to_double(dg), ref.dg), 1e-5);
  EXPECT_LT(worst(to_double(db), ref.dbeta), 1e-5);
  EXPECT_LT(worst(to_double(d_initial), ref.d_initial), 1e-5);
}

}  // namespace
}  // namespace spindle::cpu
