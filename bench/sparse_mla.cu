// MLA's absorbed sparse attention at a million tokens, GLM's shape (32 heads, a 512-wide latent as
// key and value, 2048 selected + 15 tail rows per query): a streamed chunk of queries at the end of
// the sequence, each selecting 128 random 16-row pools of the latent before it plus its tail, as
// the executor runs them. Times, by CUDA events (median of a few launches), the forward and the
// backward, with the forward's FLOP rate (2 x heads x (dk + dv) per selected row) and the
// backward's time against the forward's. `share` > 1: groups of that many neighbouring queries
// select the same pools (as a trained indexer's neighbours might), to see how much of the gather
// and of the gradient's atomics the L2 then absorbs (both kernels are DRAM-bound, docs/PERF.md), and
// what the backward over pairs of queries (sparse_mla_pair.h) saves.
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
  const double mma = median_ms([&] { chunk.backward(nullptr); }, 5);
  double shared = 0;
  const double partners = median_ms([&] { shared = chunk.pair_partners(nullptr); }, 5);
  const double pairs = median_ms([&] { chunk.backward_pairs(nullptr); }, 5);
  const int64_t heads = SparseMlaChunk::kHeads, dim = SparseMlaChunk::kDim;
  const double flops = 2.0 * static_cast<double>(heads) * 2 * dim *
                       static_cast<double>(SparseMlaChunk::kPools * SparseMlaChunk::kPool) * queries;
  std::printf(
      "sparse MLA at %lld tokens, queries %lld .. %lld (32 heads, latent 512, %lld selected rows each, "
      "the same pools for groups of %lld neighbours):\n"
      "  forward (wgmma) %.3f ms (%.0f TFLOP/s)\n"
      "  backward (mma.sync) %.3f ms (%.2fx the forward)\n"
      "  over pairs of queries: first pass %.3f ms (%.3f of the second queries' rows shared), backward %.3f "
      "ms, together %.2fx the one-query kernel\n",
      static_cast<long long>(tokens), static_cast<long long>(chunk.first), static_cast<long long>(tokens),
      static_cast<long long>(SparseMlaChunk::kWidth), static_cast<long long>(share), forward,
      flops / forward / 1e9, mma, mma / forward, partners, shared, pairs, (partners + pairs) / mma);
  return 0;
}
