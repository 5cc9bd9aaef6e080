// transformers' load-balancing auxiliary loss over all MoE layers (load_balancing_loss_func), as
// balance_loss in model/backward.cpp: p = softmax(router logits) per token, f_e = the share of
// tokens whose top-k of p (ties to the lower expert index) picks e, P_e = the mean of p_e, and
// aux = E * sum_e f_e P_e with the picks and probabilities pooled over every layer's tokens.
// Use: zero counts and prob_sum, balance_statistics for each MoE layer, copy both to the host for
// balance_loss_value, then balance_loss_backward for each layer with the pooled counts.
// Logits fp32 [tokens, experts], 1 <= topk <= experts <= 2048.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace spindle::cuda {

// counts[e] += the number of tokens whose top-k picks e; prob_sum[e] += sum_t p_e (both double
// [experts], accumulated). Deterministic: the picks are whole numbers, and each block's share of
// prob_sum is rounded to a multiple of 2^-24 so that the atomic adds are exact (sums below 2^29).
void balance_statistics(const float* logits, int64_t tokens, int64_t experts, int64_t topk, double* counts,
                        double* prob_sum, cudaStream_t stream);

// aux = E * sum_e counts[e] / rows * prob_sum[e] / rows (host arrays; rows = tokens over all layers).
double balance_loss_value(const double* counts_host, const double* prob_sum_host, int64_t experts,
                          double rows);

// dlogits[t, e] += d(coef * aux)/dlogits[t, e] = coef E / rows^2 * p_e (counts_e - sum_j p_j counts_j)
// for one layer (fp32, accumulated; counts on the device, pooled over all layers).
void balance_loss_backward(const float* logits, const double* counts, int64_t tokens, int64_t experts,
                           double rows, double coef, float* dlogits, cudaStream_t stream);

}  // namespace spindle::cuda
