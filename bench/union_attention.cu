// The union form of MLA's sparse attention (kernels/cuda/union_attention.h, docs/UNION_ATTENTION.md)
// beside the absorbed kernels, on the sparse MLA bench's chunk (bench/sparse_mla_chunk.cuh: GLM's
// shape, 16k queries at the end of a long sequence, pools drawn once per group of `share`
// neighbours; share = queries is a chunk whose queries all choose the same pools, as the 20-step
// trained checkpoint's nearly do). Times by CUDA events (median of a few launches): the union and
// its bits, the union form's forward and backward (keys and values made from the latent by
// kv_b_proj inside them, the fused kernels), the absorbed forward and backward; both backwards also
// with the attention mass by slot (the indexer's KL training).
//     build/bench_union_attention [tokens] [queries] [share]
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "cuda_timing.cuh"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/union_attention.h"
#include "sparse_mla_chunk.cuh"

using namespace spindle;
using namespace spindle::cuda;

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 1048576;
  const int64_t queries = argc > 2 ? std::atoll(argv[2]) : 16384;
  const int64_t share = argc > 3 ? std::max<int64_t>(1, std::atoll(argv[3])) : queries;
  SparseMlaChunk chunk(tokens, queries, share);
  constexpr int64_t kHeads = SparseMlaChunk::kHeads, kQk = 128, kV = 128, kRank = SparseMlaChunk::kDim;
  const int64_t kv_row = kHeads * (kQk + kV);
  const UnionAttentionShape s{queries,
                              kHeads,
                              kQk,
                              kV,
                              SparseMlaChunk::kWidth,
                              SparseMlaChunk::kPools * SparseMlaChunk::kPool,
                              chunk.first,
                              1.0f / std::sqrt(static_cast<float>(kQk))};
  DeviceBuffer<__nv_bfloat16> q = random_bf16(queries * kHeads * kQk, 11),
                              kv_b_proj = random_bf16(kv_row * kRank, 12),
                              dout = random_bf16(queries * kHeads * kV, 13),
                              out(static_cast<size_t>(queries * kHeads * kV), MemoryCategory::Activations),
                              dq(static_cast<size_t>(queries * kHeads * kQk), MemoryCategory::Activations);
  DeviceBuffer<float> lse(static_cast<size_t>(queries * kHeads), MemoryCategory::Activations),
      d_kv_b_proj(static_cast<size_t>(kv_row * kRank), MemoryCategory::Gradients);
  const UnionLatent lat{chunk.latent.data(), kRank, kRank, kv_b_proj.data()};
  Gemm gemm;
  const ChunkUnion u = chunk_union(s, chunk.selection.data(), nullptr);
  const double build = median_ms([&] { chunk_union(s, chunk.selection.data(), nullptr); }, 5);
  const double forward = median_ms(
      [&] {
        union_attention_forward(gemm, s, u, lat, chunk.selection.data(), q.data(), out.data(), lse.data(),
                                nullptr);
      },
      5);
  const auto backward_ms = [&](float* mass) {
    return median_ms(
        [&] {
          union_attention_backward(gemm, s, u, lat, chunk.selection.data(), q.data(), out.data(), lse.data(),
                                   dout.data(), dq.data(), chunk.d_latent.data(), d_kv_b_proj.data(), mass,
                                   nullptr);
        },
        5);
  };
  const double backward = backward_ms(nullptr), backward_mass = backward_ms(chunk.mass.data());
  const double absorbed_forward = median_ms([&] { chunk.forward(nullptr); }, 5);
  const double absorbed_backward = median_ms([&] { chunk.backward(nullptr); }, 5);
  const double absorbed_backward_mass = median_ms([&] { chunk.backward(nullptr, true); }, 5);
  std::printf(
      "union form at %lld tokens, queries %lld .. %lld (32 heads, keys and values 128 + 128 from the "
      "512-wide "
      "latent, pools shared by groups of %lld): a union of %lld pooled tokens\n"
      "  union and bits %.3f ms, forward %.3f ms, backward %.3f ms, with the attention mass %.3f ms\n"
      "  absorbed: forward %.3f ms, backward %.3f ms, with the attention mass %.3f ms\n",
      static_cast<long long>(tokens), static_cast<long long>(chunk.first), static_cast<long long>(tokens),
      static_cast<long long>(share), static_cast<long long>(u.count), build, forward, backward, backward_mass,
      absorbed_forward, absorbed_backward, absorbed_backward_mass);
  return 0;
}
