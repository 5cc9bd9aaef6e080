// The union form's backward, fused (union_attention_hopper.h): two kernels, as flash attention's
// backward without atomics. union_dq_kernel, a CTA per 64 queries and head over the tiles they
// attend to (the forward's loop): S = Q K^T and dP = dO V^T, P from the forward's log-sum-exp,
// dS = P (dP - D), dQ += dS K. union_dkv_kernel, a CTA per tile of 64 keys and head over the
// blocks of queries that attend to it: S^T = K Q^T and dP^T = V dO^T, dV += P^T dO and
// dK += dS^T Q; its tiles are the union's, then the tails' segments of 64 positions (segment k
// is the second tail tile of query block k - 1 and the first of block k).
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/log2_domain.h"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/union_attention_hopper.h"
#include "kernels/cuda/union_attention_tile.cuh"

namespace spindle::cuda {

namespace {

using namespace union_tile;

struct BackwardArgs {
  Tiles t;
  const bf16 *q, *dout;
  const float *lse, *dot;           // [queries, heads]: the forward's log-sum-exp, dO . O
  const uint32_t* tail_masks;       // [queries, 4]: each query's tail bits over its block's window
  bf16 *dq, *union_dkv, *tail_dkv;  // dq [queries, heads, kDim]; the keys' and values' as kv's rows
  float scale2, scale;
  int64_t first_tile;  // union_dkv_kernel: blockIdx.x's tile (the union's, then the tail segments)
};

__device__ __forceinline__ int64_t blocks_of(const Tiles& t) {
  return (t.q_end - t.q_begin + kRows - 1) / kRows;
}

// One thread a query: its tail bits over its block's window.
__global__ void tail_masks_kernel(Tiles t, uint32_t* tail_masks) {
  wait_for_earlier_kernels();
  const int64_t query = t.q_begin + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (query >= t.q_end) return;
  const int64_t q0 = t.q_begin + (query - t.q_begin) / kRows * kRows;
  uint32_t bits[4];
  tail_bits(t, query, t.first + q0 - kTailReach, bits);
#pragma unroll
  for (int w = 0; w < 4; ++w) tail_masks[query * 4 + w] = bits[w];
}

// S (or S^T) and dP to P (or P^T) and dS as bf16 A fragments: P = exp2(s scale2 - lse2) where
// selected, dS = P (dP - D) scale. lse2 and D per accumulator index.
template <typename Selected, typename Lse2, typename Dot>
__device__ __forceinline__ void probabilities_and_gradient(const float (&s)[32], const float (&dp)[32],
                                                           const BackwardArgs& a, Selected selected,
                                                           Lse2 lse2, Dot dot, uint32_t (&p)[4][4],
                                                           uint32_t (&ds)[4][4]) {
  // Not in place: union_dq_kernel issues the next tile's S and dP into s and dp while this tile's
  // dQ product still reads ds, and ptxas serialises wgmma whose accumulators other instructions
  // define inside the pipeline.
  const auto prob = [&](int j) { return selected(j) ? exp2_ftz(s[j] * a.scale2 - lse2(j)) : 0.0f; };
  const auto grad = [&](int j, float pj) { return pj * (dp[j] - dot(j)) * a.scale; };
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int j = 8 * k + 2 * r;
      const float p0 = prob(j), p1 = prob(j + 1);
      p[k][r] = pack_bf16(p0, p1);
      ds[k][r] = pack_bf16(grad(j, p0), grad(j + 1, p1));
    }
  }
}

size_t dq_shared_bytes(int64_t union_tiles) {
  return 1024 + 2 * kMatrixBytes + kStages * kTileStageBytes +
         static_cast<size_t>(union_tiles + kTailTiles) * sizeof(int32_t);
}

__global__ void __launch_bounds__(kThreads, 2)
    union_dq_kernel(BackwardArgs a, const __grid_constant__ Maps maps) {
  wait_for_earlier_kernels();
  extern __shared__ unsigned char raw[];
  __shared__ int count_s;
  __shared__ Barriers bars;
  unsigned char* q_s = align_1024(raw);
  unsigned char* do_s = q_s + kMatrixBytes;
  unsigned char* stages = do_s + kMatrixBytes;
  int32_t* list = reinterpret_cast<int32_t*>(stages + kStages * kTileStageBytes);
  const Tiles& t = a.t;
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q0 = t.q_begin + static_cast<int64_t>(blockIdx.x) * kRows, window = t.first + q0 - kTailReach;
  const int64_t row0 = q0 + 16 * warp + lane / 4;
  bars.init();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect(bars.own(), 2 * kMatrixBytes);
    load_rows(&maps.q, q_s, q0, h, bars.own());
    load_rows(&maps.dout, do_s, q0, h, bars.own());
  }
  uint32_t tails[2][4];
  float lse2[2], dot[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t query = row0 + 8 * hh;
#pragma unroll
    for (int w = 0; w < 4; ++w) tails[hh][w] = query < t.q_end ? a.tail_masks[query * 4 + w] : 0u;
    lse2[hh] = query < t.q_end ? a.lse[query * t.heads + h] * kLog2e : INFINITY;
    dot[hh] = query < t.q_end ? a.dot[query * t.heads + h] : 0.0f;
  }
  const int count = live_tiles(t, q0, tails, list, &count_s);
  const auto load_stage = [&](int i) {
    load_tile_stage(t, maps, stages + (i % kStages) * kTileStageBytes, list[i], window, h, q0, bars.stage(i));
  };
  if (count > 0) load_stage(0);
  copy_commit();
  mbarrier_wait(bars.own(), 0);

  float dq[2][32];
#pragma unroll
  for (int b = 0; b < 2; ++b) {
#pragma unroll
    for (int j = 0; j < 32; ++j) dq[b][j] = 0.0f;
  }
  const uint32_t q_address = shared_address(q_s), do_address = shared_address(do_s);
  // Tile i - 1's dQ += dS K is issued in tile i's group, right before tile i's S and dP: the tensor
  // cores take the three back to back and one wait covers them. So tile i - 1's stage is refilled
  // (tile i + 1's loads) only after that wait.
  uint32_t ds[4][4] = {};   // tile i - 1's dS, which its dQ product reads until the wait
  uint32_t previous_k = 0;  // tile i - 1's K
  for (int i = 0; i < count; ++i) {
    unsigned char* stage = stages + (i % kStages) * kTileStageBytes;
    copy_wait<0>();  // this thread's mask words of tile i
    mbarrier_wait(bars.stage(i), bars.parity(i));
    __syncthreads();  // everyone's
    const int tile = list[i];
    const uint32_t k_address = shared_address(stage);

    float s[32], dp[32];
    wgmma_fence();
    if (i > 0) product_over_rows(dq, ds, previous_k);
    product_over_values(s, q_address, k_address);
    product_over_values(dp, do_address, k_address + kMatrixBytes);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(dq);
    wgmma_hold_fragment(ds);
    wgmma_hold(s);
    wgmma_hold(dp);
    __syncthreads();  // every warp's dQ product of tile i - 1 done: its stage takes tile i + 1
    if (i + 1 < count) load_stage(i + 1);
    copy_commit();

    uint32_t bits[2][2];
    tile_bits(t, reinterpret_cast<const uint32_t*>(stage + 2 * kMatrixBytes), tails, tile, bits);
    uint32_t p[4][4];
    probabilities_and_gradient(
        s, dp, a, [&](int j) { return column_bit(bits, j); }, [&](int j) { return lse2[(j / 2) % 2]; },
        [&](int j) { return dot[(j / 2) % 2]; }, p, ds);
    previous_k = k_address;
  }
  if (count > 0) {
    wgmma_fence();
    product_over_rows(dq, ds, previous_k);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(dq);
  }

  store_rows(t, dq, {1.0f, 1.0f}, row0, h, a.dq);
}

// union_dkv_kernel's stage: a block's Q, dO, mask words over the tile [query][2], lse2 and D.
constexpr int kWordsOffset = 2 * kMatrixBytes, kLseOffset = kWordsOffset + kRows * 2 * 4,
              kDotOffset = kLseOffset + kRows * 4, kDkvStageBytes = kDotOffset + kRows * 4;
static_assert(kDkvStageBytes % 1024 == 0, "stages 1024-aligned");

size_t dkv_shared_bytes(int64_t blocks) {
  return 1024 + 2 * kMatrixBytes + kStages * kDkvStageBytes +
         static_cast<size_t>(blocks + 2) * sizeof(int32_t);
}

__global__ void __launch_bounds__(kThreads, 2)
    union_dkv_kernel(BackwardArgs a, const __grid_constant__ Maps maps) {
  wait_for_earlier_kernels();
  extern __shared__ unsigned char raw[];
  __shared__ int count_s;
  __shared__ Barriers bars;
  unsigned char* k_s = align_1024(raw);
  unsigned char* stages = k_s + 2 * kMatrixBytes;
  int32_t* list = reinterpret_cast<int32_t*>(stages + kStages * kDkvStageBytes);
  const Tiles& t = a.t;
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t blocks = blocks_of(t), x = a.first_tile + blockIdx.x;
  const bool tail = x >= t.union_tiles;
  // A tail segment's positions start here (the window of block x - union_tiles, second tile on).
  const int64_t segment = tail ? t.first + t.q_begin + (x - t.union_tiles - 1) * kRows : 0;
  bars.init();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect(bars.own(), 2 * kMatrixBytes);
    load_keys(t, maps, k_s, tail ? t.union_tiles : x, segment, h, bars.own());
  }

  // The query blocks that attend to the tile: for the union's, those with a bit in it; for a
  // segment, the two whose windows hold it (its block list: b, and b + blocks marks the window's
  // second tile).
  if (!tail) {
    for (int64_t b = warp; b < blocks; b += kThreads / 32) {
      const bool live = any_bit(t, t.q_begin + b * kRows, x);
      if (lane == 0) list[b] = live;
    }
    __syncthreads();
    if (warp == 0) {
      const int count = compact_flags(list, blocks);
      if (lane == 0) count_s = count;
    }
  } else if (threadIdx.x == 0) {
    const int64_t k = x - t.union_tiles;
    int count = 0;
    if (k - 1 >= 0) list[count++] = static_cast<int32_t>(k - 1 + blocks);
    if (k < blocks) list[count++] = static_cast<int32_t>(k);
    count_s = count;
  }
  __syncthreads();
  const int count = count_s;
  const auto load_stage = [&](int i) {
    unsigned char* stage = stages + (i % kStages) * kDkvStageBytes;
    const int64_t b = list[i] % blocks, q0 = t.q_begin + b * kRows;
    if (threadIdx.x == 0) {
      mbarrier_arrive_expect(bars.stage(i), 2 * kMatrixBytes);
      load_rows(&maps.q, stage, q0, h, bars.stage(i));
      load_rows(&maps.dout, stage + kMatrixBytes, q0, h, bars.stage(i));
    }
    uint32_t* words = reinterpret_cast<uint32_t*>(stage + kWordsOffset);
    if (!tail) {
      load_mask_words(t, words, x, q0);
    } else {
      const int64_t query = q0 + threadIdx.x / 2, word = 2 * (list[i] / blocks) + threadIdx.x % 2;
      const bool valid = query < t.q_end;
      copy4(words + threadIdx.x, valid ? a.tail_masks + query * 4 + word : a.tail_masks, valid);
    }
    const int64_t query = q0 + threadIdx.x % kRows;
    const bool valid = query < t.q_end;
    const float* src = threadIdx.x < kRows ? a.lse : a.dot;
    copy4(stage + (threadIdx.x < kRows ? kLseOffset : kDotOffset) + (threadIdx.x % kRows) * 4,
          valid ? src + query * t.heads + h : src, valid);
  };
  if (count > 0) load_stage(0);
  copy_commit();
  mbarrier_wait(bars.own(), 0);

  float dk[2][32], dv[2][32];
#pragma unroll
  for (int b = 0; b < 2; ++b) {
#pragma unroll
    for (int j = 0; j < 32; ++j) dk[b][j] = dv[b][j] = 0.0f;
  }
  const uint32_t k_address = shared_address(k_s), v_address = k_address + kMatrixBytes;
  // This thread's keys (rows) 16 warp + lane / 4 + 8 hh share a mask word: (16 warp) / 32.
  const int word = warp / 2, bit0 = 16 * (warp % 2) + lane / 4;
  // Block i - 1's dV += P^T dO and dK += dS^T Q are issued in block i's group, right before its S^T
  // and dP^T (union_dq_kernel's order): one wait covers the four, and only after it is block i - 1's
  // stage refilled (block i + 1's loads).
  uint32_t p[4][4] = {}, ds[4][4] = {};  // block i - 1's, which its products read until the wait
  uint32_t previous_q = 0;               // block i - 1's Q (and dO after it)
  const auto gradient_products = [&] {
    product_over_rows(dv, p, previous_q + kMatrixBytes);
    product_over_rows(dk, ds, previous_q);
  };
  for (int i = 0; i < count; ++i) {
    unsigned char* stage = stages + (i % kStages) * kDkvStageBytes;
    copy_wait<0>();  // this thread's words, lse and D of block i
    mbarrier_wait(bars.stage(i), bars.parity(i));
    __syncthreads();  // everyone's
    const uint32_t q_address = shared_address(stage), do_address = q_address + kMatrixBytes;

    float s[32], dp[32];
    wgmma_fence();
    if (i > 0) gradient_products();
    product_over_values(s, k_address, q_address);
    product_over_values(dp, v_address, do_address);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(dk);
    wgmma_hold(dv);
    wgmma_hold_fragment(p);
    wgmma_hold_fragment(ds);
    wgmma_hold(s);
    wgmma_hold(dp);
    __syncthreads();  // every warp's products of block i - 1 done: its stage takes block i + 1
    if (i + 1 < count) load_stage(i + 1);
    copy_commit();

    const uint32_t* words = reinterpret_cast<const uint32_t*>(stage + kWordsOffset);
    const float* lse = reinterpret_cast<const float*>(stage + kLseOffset);
    const float* dots = reinterpret_cast<const float*>(stage + kDotOffset);
    const auto column = [&](int j) { return 8 * (j / 4) + 2 * (lane % 4) + j % 2; };  // the query
    probabilities_and_gradient(
        s, dp, a, [&](int j) { return (words[2 * column(j) + word] >> (bit0 + 8 * ((j / 2) % 2))) & 1u; },
        [&](int j) { return lse[column(j)] * kLog2e; }, [&](int j) { return dots[column(j)]; }, p, ds);
    previous_q = q_address;
  }
  if (count > 0) {
    wgmma_fence();
    gradient_products();
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(dk);
    wgmma_hold(dv);
  }

  const int64_t kv_row = t.heads * 2 * kDim;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t r = 16 * warp + lane / 4 + 8 * hh;
    bf16* dst = nullptr;
    if (!tail) {
      const int64_t key = x * kKeys + r;
      if (key < t.union_count) dst = a.union_dkv + key * kv_row;
    } else {
      const int64_t pos = segment + r;
      if (pos >= t.tail_low && pos < t.tail_high) dst = a.tail_dkv + (pos - t.tail_low) * kv_row;
    }
    if (dst == nullptr) continue;
    dst += h * 2 * kDim;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int j = 4 * jj + 2 * hh, col = 64 * b + 8 * jj + 2 * (lane % 4);
        *reinterpret_cast<__nv_bfloat162*>(dst + col) = __floats2bfloat162_rn(dk[b][j], dk[b][j + 1]);
        *reinterpret_cast<__nv_bfloat162*>(dst + kDim + col) = __floats2bfloat162_rn(dv[b][j], dv[b][j + 1]);
      }
    }
  }
}

BackwardArgs backward_args(const UnionAttentionShape& s, const ChunkUnion& u, const bf16* union_kv,
                           const bf16* tail_kv, const TailRows& tail, int64_t q_begin, int64_t q_end,
                           const int32_t* selected, const UnionBackwardInputs& in) {
  return {union_fused_tiles(s, u, union_kv, tail_kv, tail, q_begin, q_end, selected),
          in.q,
          in.dout,
          in.lse,
          in.dot,
          nullptr,
          nullptr,
          nullptr,
          nullptr,
          s.scale * kLog2e,
          s.scale,
          0};
}

void launch_dkv(const BackwardArgs& a, int64_t tiles, int heads, cudaStream_t stream) {
  const int64_t blocks = (a.t.q_end - a.t.q_begin + kRows - 1) / kRows;
  const size_t bytes = dkv_shared_bytes(blocks);
  allow_shared_memory(union_dkv_kernel, bytes, "union attention backward (fused): ", blocks,
                      " blocks of queries");
  launch_kernel(union_dkv_kernel, dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(heads)), kThreads,
                bytes, stream, a, union_fused_maps(a.t, a.q, a.dout));
  SPINDLE_LAUNCHED("union_dkv_kernel");
}

}  // namespace

void union_attention_backward_fused_union(const UnionAttentionShape& s, const ChunkUnion& u,
                                          const bf16* union_kv, const int32_t* selected,
                                          const UnionBackwardInputs& in, bf16* union_dkv,
                                          cudaStream_t stream) {
  BackwardArgs a = backward_args(s, u, union_kv, nullptr, TailRows{0, 0}, 0, s.queries, selected, in);
  a.union_dkv = union_dkv;
  if (s.queries == 0 || a.t.union_tiles == 0) return;
  launch_dkv(a, a.t.union_tiles, static_cast<int>(s.heads), stream);
}

void union_attention_backward_fused_tails(const UnionAttentionShape& s, const ChunkUnion& u,
                                          const bf16* union_kv, const bf16* tail_kv, const TailRows& tail,
                                          int64_t q_begin, int64_t q_end, const int32_t* selected,
                                          const UnionBackwardInputs& in, uint32_t* tail_masks, bf16* dq,
                                          bf16* tail_dkv, cudaStream_t stream) {
  BackwardArgs a = backward_args(s, u, union_kv, tail_kv, tail, q_begin, q_end, selected, in);
  a.tail_masks = tail_masks;
  a.dq = dq;
  a.tail_dkv = tail_dkv;
  a.first_tile = a.t.union_tiles;
  if (q_end <= q_begin) return;
  const int64_t blocks = (q_end - q_begin + kRows - 1) / kRows;
  launch_kernel(tail_masks_kernel, static_cast<unsigned>((q_end - q_begin + 255) / 256), 256, 0, stream, a.t,
                tail_masks);
  SPINDLE_LAUNCHED("tail_masks_kernel");
  const size_t dq_bytes = dq_shared_bytes(a.t.union_tiles);
  allow_shared_memory(union_dq_kernel, dq_bytes, "union attention backward (fused): a union of ", u.count,
                      " keys");
  launch_kernel(union_dq_kernel, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(s.heads)),
                kThreads, dq_bytes, stream, a, union_fused_maps(a.t, a.q, a.dout));
  SPINDLE_LAUNCHED("union_dq_kernel");
  launch_dkv(a, blocks + 1, static_cast<int>(s.heads), stream);
}

}  // namespace spindle::cuda
