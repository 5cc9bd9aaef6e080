// The MoE dispatch kernels (gather to the expert-sorted order, the weighted combine back, the
// scatter backward, the down projection's backward without its output) and the balance-loss
// kernels against loops on the host in double, on fresh random inputs (seed printed): bf16-rounded
// inputs where the GPU stores bf16, written outputs poisoned with NaN first, accumulated outputs
// pre-filled with values of the size of what is added.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "backend/cuda/device_memory.h"
#include "backend/cuda/stream.h"
#include "gpu_test_util.h"
#include "kernels/cuda/balance_loss.h"
#include "kernels/cuda/moe_dispatch.h"

namespace spindle::cuda {
namespace {

// device() and poisoned() copy and memset on the legacy stream, which a non-blocking Stream does not
// wait for, and a copy from pageable memory returns before its last DMA has landed: without this
// wait a kernel can read (and accumulate onto) a half-uploaded buffer.
void wait_for_uploads() { SPINDLE_CUDA(cudaDeviceSynchronize()); }

// ---------------------------------------------------------------- dispatch

// A random routing: topk distinct experts per token, the stable expert-sorted permutation of the
// assignments t * topk + k (as ExpertPermutation builds it) and its inverse.
struct Routing {
  std::vector<int32_t> permutation, inverse;
};

Routing random_routing(int64_t T, int64_t K, int64_t E) {
  std::vector<int32_t> expert(T * K);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(E - 1));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const auto first = expert.begin() + t * K;
      int32_t e;
      do e = pick(rng());
      while (std::find(first, first + k, e) != first + k);
      first[k] = e;
    }
  Routing r;
  r.permutation.resize(T * K);
  std::iota(r.permutation.begin(), r.permutation.end(), 0);
  std::stable_sort(r.permutation.begin(), r.permutation.end(),
                   [&](int32_t a, int32_t b) { return expert[a] < expert[b]; });
  r.inverse.resize(T * K);
  for (int64_t i = 0; i < T * K; ++i) r.inverse[r.permutation[i]] = static_cast<int32_t>(i);
  return r;
}

// Empty when `got` and `want` hold the same bits, else how many elements differ and the first
// of them (index, both values), instead of both arrays in full.
template <class T>
std::string bit_differences(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size())
    return "sizes " + std::to_string(got.size()) + " and " + std::to_string(want.size());
  int64_t count = 0;
  size_t first = 0;
  for (size_t i = got.size(); i-- > 0;)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      ++count;
      first = i;
    }
  if (count == 0) return {};
  auto value = [](T v) {
    if constexpr (std::is_same_v<T, bf16>)
      return std::to_string(__bfloat162float(v));
    else
      return std::to_string(v);
  };
  return std::to_string(count) + " of " + std::to_string(got.size()) + " elements differ, the first at " +
         std::to_string(first) + ": " + value(got[first]) + " instead of " + value(want[first]);
}

struct DispatchCase {
  int64_t T, K, E, D;
};

TEST(CudaMoeDispatch, GatherCombineAndBackwardMatchTheHost) {
  // D odd (one by one), even (pairs), a multiple of 8 (16-byte pieces) up to 6144; topk 1 to 8;
  // the last case has more sorted rows than the gather's grid has warps.
  for (const DispatchCase& c :
       {DispatchCase{300, 8, 32, 37}, DispatchCase{257, 4, 16, 74}, DispatchCase{1000, 8, 64, 1024},
        DispatchCase{33, 1, 4, 38}, DispatchCase{3, 6, 8, 1032}, DispatchCase{40, 8, 288, 6144},
        DispatchCase{70000, 8, 64, 2}}) {
    const auto [T, K, E, D] = c;
    const int64_t A = T * K;
    const std::string where = "T=" + std::to_string(T) + " K=" + std::to_string(K) +
                              " E=" + std::to_string(E) + " D=" + std::to_string(D);
    const Routing routing = random_routing(T, K, E);
    const auto x = rounded(random_floats(T * D)), expert_out = rounded(random_floats(A * D)),
               shared = rounded(random_floats(T * D)), drows_in = rounded(random_floats(A * D));
    const auto dx_before = random_floats(T * D, std::sqrt(static_cast<float>(K)));
    std::vector<float> weight(A);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (float& w : weight) w = u(rng());

    Stream stream;
    auto inverse = device(routing.inverse);
    auto x_d = device(to_bf16(x));
    auto rows = poisoned<bf16>(A * D);
    auto out_d = device(to_bf16(expert_out)), shared_d = device(to_bf16(shared));
    auto weight_d = device(weight);
    auto y = poisoned<bf16>(T * D);
    auto y_in_place = device(to_bf16(shared));
    auto drows_d = device(to_bf16(drows_in));
    auto dx = device(dx_before);
    wait_for_uploads();
    gather_expert_rows(x_d.data(), inverse.data(), T, K, D, rows.data(), stream.get());
    combine_expert_rows(out_d.data(), inverse.data(), weight_d.data(), shared_d.data(), T, K, D, y.data(),
                        stream.get());
    combine_expert_rows(out_d.data(), inverse.data(), weight_d.data(), y_in_place.data(), T, K, D,
                        y_in_place.data(), stream.get());
    scatter_expert_rows_backward(drows_d.data(), inverse.data(), T, K, D, dx.data(), stream.get());
    stream.synchronize();

    // The gather is a copy: every element exact.
    const auto rows_got = rows.download();
    int64_t wrong = 0;
    for (int64_t r = 0; r < A; ++r) {
      const int64_t t = routing.permutation[r] / K;
      for (int64_t d = 0; d < D; ++d) wrong += __bfloat162float(rows_got[r * D + d]) != x[t * D + d];
    }
    EXPECT_EQ(wrong, 0) << "gathered elements that differ from x, " << where;

    std::vector<double> y_ref(T * D), dx_ref(T * D);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        double sum = shared[t * D + d], grad = dx_before[t * D + d];
        for (int64_t k = 0; k < K; ++k) {
          const int64_t a = t * K + k, r = routing.inverse[a];
          sum += static_cast<double>(weight[a]) * expert_out[r * D + d];
          grad += drows_in[r * D + d];
        }
        y_ref[t * D + d] = sum;
        dx_ref[t * D + d] = grad;
      }
    // One rounding to bf16 (relative rms about 1.6e-3) on top of fp32 sums.
    const auto y_got = y.download();
    EXPECT_LT(relative_error(y_got, y_ref), 4e-3) << "combine, " << where;
    EXPECT_EQ(bit_differences(y_in_place.download(), y_got), "") << "combine in place, " << where;
    EXPECT_LT(relative_error(dx.download(), dx_ref), 1e-6) << "dx, " << where;
  }
}

// The down projection's backward without its output: dweight against double dots, g and hidden
// scaled by the row's weight in fp32 and rounded once (bit-exact, the host rounds the same way).
TEST(CudaMoeDispatch, ExpertDownBackwardMatchesTheHost) {
  for (const DispatchCase& c : {DispatchCase{300, 8, 32, 37}, DispatchCase{257, 4, 16, 74},
                                DispatchCase{1000, 4, 16, 576}, DispatchCase{9000, 2, 8, 8}}) {
    const auto [T, K, E, I] = c;
    const int64_t A = T * K;
    const std::string where =
        "T=" + std::to_string(T) + " K=" + std::to_string(K) + " I=" + std::to_string(I);
    const Routing routing = random_routing(T, K, E);
    const auto g = rounded(random_floats(A * I)), hidden = rounded(random_floats(A * I));
    const auto weight = random_uniform(A, 0.0f, 2.5f);
    Stream stream;
    auto permutation = device(routing.permutation);
    auto g_d = device(to_bf16(g)), hidden_d = device(to_bf16(hidden));
    auto weight_d = device(weight);
    auto dweight = poisoned<float>(A);
    wait_for_uploads();
    expert_down_backward(permutation.data(), weight_d.data(), A, I, g_d.data(), hidden_d.data(),
                         dweight.data(), stream.get());
    stream.synchronize();
    std::vector<double> dweight_ref(A);
    std::vector<bf16> g_ref(A * I), hidden_ref(A * I);
    for (int64_t r = 0; r < A; ++r) {
      const int32_t a = routing.permutation[r];
      double dot = 0;
      for (int64_t i = 0; i < I; ++i) {
        dot += static_cast<double>(g[r * I + i]) * hidden[r * I + i];
        g_ref[r * I + i] = __float2bfloat16(g[r * I + i] * weight[a]);
        hidden_ref[r * I + i] = __float2bfloat16(hidden[r * I + i] * weight[a]);
      }
      dweight_ref[a] = dot;
    }
    EXPECT_LT(relative_error(dweight.download(), dweight_ref), 1e-5) << "dweight, " << where;
    EXPECT_EQ(bit_differences(g_d.download(), g_ref), "") << "the hidden's gradient, " << where;
    EXPECT_EQ(bit_differences(hidden_d.download(), hidden_ref), "") << "the weighted hidden, " << where;
  }
}

// ---------------------------------------------------------------- balance loss

// balance_loss of model/backward.cpp, in double on the fp32 logits: p = softmax(logits), the
// top-k by a stable sort of p in descending order.
std::vector<double> softmax(const float* l, int64_t E) {
  std::vector<double> p(E);
  double mx = -INFINITY, z = 0;
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, static_cast<double>(l[e]));
  for (int64_t e = 0; e < E; ++e) z += (p[e] = std::exp(static_cast<double>(l[e]) - mx));
  for (double& v : p) v /= z;
  return p;
}

void reference_statistics(const std::vector<float>& logits, int64_t E, int64_t K, std::vector<double>& counts,
                          std::vector<double>& prob_sum) {
  std::vector<int64_t> order(E);
  for (size_t t = 0; t < logits.size() / E; ++t) {
    const auto p = softmax(logits.data() + t * E, E);
    for (int64_t e = 0; e < E; ++e) prob_sum[e] += p[e];
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    for (int64_t i = 0; i < K; ++i) counts[order[i]] += 1;
  }
}

double reference_value(const std::vector<double>& counts, const std::vector<double>& prob_sum, double rows) {
  double aux = 0;
  for (size_t e = 0; e < counts.size(); ++e) aux += counts[e] / rows * prob_sum[e] / rows;
  return aux * static_cast<double>(counts.size());
}

// d(coef * aux)/dlogits of one layer.
std::vector<double> reference_gradient(const std::vector<float>& logits, const std::vector<double>& counts,
                                       double rows, double coef) {
  const auto E = static_cast<int64_t>(counts.size());
  std::vector<double> grad(logits.size());
  for (size_t t = 0; t < logits.size() / E; ++t) {
    const auto p = softmax(logits.data() + t * E, E);
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += p[e] * counts[e];
    for (int64_t e = 0; e < E; ++e)
      grad[t * E + e] = coef * static_cast<double>(E) / (rows * rows) * p[e] * (counts[e] - dot);
  }
  return grad;
}

// Runs the statistics of the layers (pooled), the value and each layer's gradient (into dlogits
// pre-filled with the gradient's size) on the GPU, and checks them against the references.
void check_balance(const std::vector<std::vector<float>>& layers, int64_t E, int64_t K, double coef,
                   const std::string& where) {
  Stream stream;
  auto counts = device(std::vector<double>(E, 0.0)), prob_sum = device(std::vector<double>(E, 0.0));
  std::vector<DeviceBuffer<float>> logits;
  double rows = 0;
  std::vector<double> counts_ref(E, 0.0), prob_sum_ref(E, 0.0);
  for (const auto& layer : layers) logits.push_back(device(layer));
  wait_for_uploads();
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto& layer = layers[l];
    const auto T = static_cast<int64_t>(layer.size()) / E;
    balance_statistics(logits[l].data(), T, E, K, counts.data(), prob_sum.data(), stream.get());
    reference_statistics(layer, E, K, counts_ref, prob_sum_ref);
    rows += static_cast<double>(T);
  }
  stream.synchronize();
  const auto counts_got = counts.download(), prob_sum_got = prob_sum.download();
  EXPECT_EQ(counts_got, counts_ref) << "counts, " << where;
  // fp32 p, and each block's share rounded to a multiple of 2^-24: about 1e-6 of these small sums.
  EXPECT_LT(relative_error(prob_sum_got, prob_sum_ref), 1e-5) << "prob_sum, " << where;
  const double value = balance_loss_value(counts_got.data(), prob_sum_got.data(), E, rows),
               value_ref = reference_value(counts_ref, prob_sum_ref, rows);
  EXPECT_NEAR(value, value_ref, 1e-5 * value_ref) << "value, " << where;

  for (size_t l = 0; l < layers.size(); ++l) {
    const auto T = static_cast<int64_t>(layers[l].size()) / E;
    auto grad_ref = reference_gradient(layers[l], counts_ref, rows, coef);
    double rms = 0;
    for (double g : grad_ref) rms += g * g;
    rms = std::sqrt(rms / static_cast<double>(grad_ref.size()));
    const auto before = random_floats(layers[l].size(), static_cast<float>(rms));
    auto dlogits = device(before);
    wait_for_uploads();
    balance_loss_backward(logits[l].data(), counts.data(), T, E, rows, coef, dlogits.data(), stream.get());
    stream.synchronize();
    for (size_t i = 0; i < grad_ref.size(); ++i) grad_ref[i] += before[i];
    EXPECT_LT(relative_error(dlogits.download(), grad_ref), 1e-5)
        << "dlogits of layer " << l << ", " << where;
  }
}

struct BalanceCase {
  int64_t E, K, T1, T2;
};

TEST(CudaMoeDispatch, BalanceLossPooledOverTwoLayersMatchesTheHost) {
  // E not a multiple of 32, E = 288 (GLM-5.3-Flash), E = 2048 (over 48 KiB of shared memory),
  // more tokens than the statistics grid has warps, a layer of one token.
  for (const BalanceCase& c :
       {BalanceCase{64, 8, 1000, 333}, BalanceCase{288, 8, 300, 129}, BalanceCase{33, 4, 100, 5},
        BalanceCase{2048, 8, 64, 37}, BalanceCase{64, 4, 9000, 1}, BalanceCase{8, 2, 7, 1}}) {
    const auto [E, K, T1, T2] = c;
    const std::string where = "E=" + std::to_string(E) + " K=" + std::to_string(K) + " tokens " +
                              std::to_string(T1) + " + " + std::to_string(T2);
    check_balance({random_floats(T1 * E, 2.0f), random_floats(T2 * E, 2.0f)}, E, K, 0.01, where);
  }
}

TEST(CudaMoeDispatch, BalanceTopkTiesGoToTheLowerIndex) {
  // Logits from three levels, so most rows tie across the top-k cut; equal logits give equal p.
  const int64_t E = 16, K = 4, T = 500;
  std::vector<float> logits(T * E);
  std::uniform_int_distribution<int> level(0, 2);
  for (float& l : logits) l = 0.5f * static_cast<float>(level(rng()));
  std::fill(logits.begin(), logits.begin() + E, 0.0f);  // one row all equal
  check_balance({logits}, E, K, 1.0, "ties");

  // The rule itself, without the reference: a row of equal logits picks experts 0..K-1; three
  // equal maxima at 1, 3 and 4 with K = 2 pick 1 and 3.
  Stream stream;
  const std::vector<float> rows{0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0};
  auto rows_d = device(rows);
  auto counts = device(std::vector<double>(8, 0.0)), prob_sum = device(std::vector<double>(8, 0.0));
  wait_for_uploads();
  balance_statistics(rows_d.data(), 1, 8, 4, counts.data(), prob_sum.data(), stream.get());
  stream.synchronize();
  EXPECT_EQ(counts.download(), (std::vector<double>{1, 1, 1, 1, 0, 0, 0, 0}));
  auto counts2 = device(std::vector<double>(8, 0.0));
  wait_for_uploads();
  balance_statistics(rows_d.data() + 8, 1, 8, 2, counts2.data(), prob_sum.data(), stream.get());
  stream.synchronize();
  EXPECT_EQ(counts2.download(), (std::vector<double>{0, 1, 0, 1, 0, 0, 0, 0}));
}

}  // namespace
}  // namespace spindle::cuda
