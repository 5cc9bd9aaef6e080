// MLA's absorbed sparse attention at a million tokens, GLM's shape (32 heads, a 512-wide latent as
// key and value, 2048 selected + 15 tail rows per query): a streamed chunk of queries at the end of
// the sequence, each selecting 128 random 16-row pools of the latent before it plus its tail, as
// the executor runs them. Times, by CUDA events (median of a few launches), the forward and the
// backward, with their FLOP rates (per selected row, 2 x heads x (dk + dv) forward: S, O; 2 x heads x
// (3 dk + 2 dv) backward: S, dP, dQ and the row's gradient). `share` > 1: groups of that many neighbouring
// queries select the same pools (as a trained indexer's neighbours might), to see how much of the gather and
// of the gradient's reductions the L2 then absorbs; the backward on mma.sync (one query a CTA) and on
// wgmma (sparse_mla_backward_hopper.h: pairs that share their rows together), the latter also with
// the attention mass by slot (the indexer's KL training).
//     build/bench_sparse_mla [tokens] [queries] [share]
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "cuda_timing.cuh"
#include "sparse_mla_chunk.cuh"

using namespace spindle;
using namespace spindle::cuda;

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 1048576;
  const int64_t queries = argc > 2 ? std::atoll(argv[2]) : 16384;
  const int64_t share = argc > 3 ? std::max<int64_t>(1, std::atoll(argv[3])) : 1;
  SparseMlaChunk chunk(tokens, queries, share);
  const double forward = median_ms([&] { chunk.forward(nullptr); }, 5);
  const double mma = median_ms([&] { chunk.backward_mma(nullptr); }, 5);
  const double wgmma = median_ms([&] { chunk.backward(nullptr); }, 5);
  const double wgmma_mass = median_ms([&] { chunk.backward(nullptr, true); }, 5);
  const int64_t heads = SparseMlaChunk::kHeads, dim = SparseMlaChunk::kDim;
  const double rows = static_cast<double>(SparseMlaChunk::kPools * SparseMlaChunk::kPool) * queries;
  // Forward: S and O (dk + dv per row and head); backward: S, dP, dQ and the rows' gradient (dk + dv).
  const double flops = 2.0 * static_cast<double>(heads) * 2 * dim * rows;
  const double backward_flops = 2.0 * static_cast<double>(heads) * 5 * dim * rows;
  std::printf(
      "sparse MLA at %lld tokens, queries %lld .. %lld (32 heads, latent 512, %lld selected rows each, "
      "the same pools for groups of %lld neighbours):\n"
      "  forward (wgmma) %.3f ms (%.0f TFLOP/s)\n"
      "  backward: mma.sync one query a CTA %.3f ms (%.0f TFLOP/s), wgmma %.3f ms (%.0f TFLOP/s, %.2fx "
      "mma.sync, %.2fx the forward), wgmma with the attention mass %.3f ms\n",
      static_cast<long long>(tokens), static_cast<long long>(chunk.first), static_cast<long long>(tokens),
      static_cast<long long>(SparseMlaChunk::kWidth), static_cast<long long>(share), forward,
      flops / forward / 1e9, mma, backward_flops / mma / 1e9, wgmma, backward_flops / wgmma / 1e9,
      wgmma / mma, wgmma / forward, wgmma_mass);
  return 0;
}
