#include "model/balance_loss.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace spindle {

namespace {

// p = softmax(logits row) in double.
template <class T>
void softmax_row(const T* logits, int64_t experts, std::vector<double>& p) {
  double mx = -INFINITY, z = 0;
  for (int64_t e = 0; e < experts; ++e) mx = std::max(mx, static_cast<double>(logits[e]));
  for (int64_t e = 0; e < experts; ++e)
    z += (p[static_cast<size_t>(e)] = std::exp(static_cast<double>(logits[e]) - mx));
  for (double& v : p) v /= z;
}

}  // namespace

template <class T>
void add_balance_stats(const ModelConfig& c, const T* logits, int64_t tokens, BalanceStats& stats) {
  const int64_t E = c.n_routed_experts, k = c.num_experts_per_tok;
  stats.counts.resize(static_cast<size_t>(E), 0.0);
  stats.prob_sum.resize(static_cast<size_t>(E), 0.0);
  std::vector<double> p(static_cast<size_t>(E));
  std::vector<int64_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < tokens; ++t) {
    softmax_row(logits + t * E, E, p);
    for (int64_t e = 0; e < E; ++e) stats.prob_sum[static_cast<size_t>(e)] += p[static_cast<size_t>(e)];
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return p[static_cast<size_t>(a)] > p[static_cast<size_t>(b)];
    });
    for (int64_t i = 0; i < k; ++i) stats.counts[static_cast<size_t>(order[static_cast<size_t>(i)])] += 1;
  }
  stats.rows += static_cast<double>(tokens);
}

double balance_value(const ModelConfig& c, const BalanceStats& stats) {
  double aux = 0;
  for (size_t e = 0; e < stats.counts.size(); ++e)
    aux += stats.counts[e] / stats.rows * stats.prob_sum[e] / stats.rows;
  return aux * static_cast<double>(c.n_routed_experts);
}

template <class T>
void balance_gradient(const ModelConfig& c, const T* logits, int64_t tokens, const BalanceStats& stats,
                      double coef, T* dlogits) {
  const int64_t E = c.n_routed_experts;
  std::vector<double> p(static_cast<size_t>(E));
  const double factor = coef * static_cast<double>(E) / (stats.rows * stats.rows);
  for (int64_t t = 0; t < tokens; ++t) {
    softmax_row(logits + t * E, E, p);
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += p[static_cast<size_t>(e)] * stats.counts[static_cast<size_t>(e)];
    for (int64_t e = 0; e < E; ++e)
      dlogits[t * E + e] =
          static_cast<T>(factor * p[static_cast<size_t>(e)] * (stats.counts[static_cast<size_t>(e)] - dot));
  }
}

template void add_balance_stats<float>(const ModelConfig&, const float*, int64_t, BalanceStats&);
template void add_balance_stats<double>(const ModelConfig&, const double*, int64_t, BalanceStats&);
template void balance_gradient<float>(const ModelConfig&, const float*, int64_t, const BalanceStats&, double,
                                      float*);
template void balance_gradient<double>(const ModelConfig&, const double*, int64_t, const BalanceStats&,
                                       double, double*);

}  // namespace spindle
