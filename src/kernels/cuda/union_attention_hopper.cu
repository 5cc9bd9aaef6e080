// The union form's forward, fused; see union_attention_hopper.h. Shared memory: the CTA's Q, three
// slots for the tiles' K and V (by the TMA, on the slot's barrier), two buffers of mask words
// (cp.async), then its tile list (union_attention_tile.cuh's layouts).
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/log2_domain.h"
#include "kernels/cuda/online_softmax.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/tensor_map.h"
#include "kernels/cuda/union_attention_hopper.h"
#include "kernels/cuda/union_attention_tile.cuh"

namespace spindle::cuda {

namespace {

using namespace union_tile;

// Three CTAs an SM (the kernel is paced by each warpgroup's chain of products, softmax and waits,
// not by the L2: docs/PERF.md, "The union forward on three slots"), so a CTA holds Q and
// three 64 x 128 slots, not two stages of a whole tile: the tiles' matrices K0, V0, K1, V1, ..
// (matrix m) rotate through the slots (m % 3), each loaded as soon as the matrix three before it is
// used: K of tile i + 1 while tile i runs, V of tile i + 1 from tile i's softmax on. The mask words
// are double-buffered (cp.async).
constexpr int kSlots = 3;
constexpr int kMaskBytes = kRows * 2 * sizeof(uint32_t);

size_t forward_shared_bytes(int64_t union_tiles) {
  return 1024 + (1 + kSlots) * kMatrixBytes + 2 * kMaskBytes +
         static_cast<size_t>(union_tiles + kTailTiles) * sizeof(int32_t);
}

struct ForwardArgs {
  Tiles t;
  const bf16* q;
  bf16* out;
  float* lse;
  float scale2;
};

__global__ void __launch_bounds__(kThreads, 3)
    union_forward_kernel(ForwardArgs a, const __grid_constant__ Maps maps) {
  wait_for_earlier_kernels();
  extern __shared__ unsigned char raw[];
  __shared__ int count_s;
  __shared__ StageBarriers<kSlots> bars;  // a slot's is stage(m) for its matrices m
  unsigned char* q_s = align_1024(raw);
  unsigned char* slots = q_s + kMatrixBytes;
  unsigned char* masks = slots + kSlots * kMatrixBytes;  // two buffers of kMaskBytes
  int32_t* list = reinterpret_cast<int32_t*>(masks + 2 * kMaskBytes);
  const Tiles& t = a.t;
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q0 = t.q_begin + static_cast<int64_t>(blockIdx.x) * kRows, window = t.first + q0 - kTailReach;
  const int64_t row0 = q0 + 16 * warp + lane / 4;  // this thread's rows: row0 and row0 + 8
  bars.init();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect(bars.own(), kMatrixBytes);
    load_rows(&maps.q, q_s, q0, h, bars.own());
  }
  uint32_t tails[2][4];
  tail_bits(t, row0, window, tails[0]);
  tail_bits(t, row0 + 8, window, tails[1]);
  const int count = live_tiles(t, q0, tails, list, &count_s);
  // Matrix m (thread 0): K (even m) or V of tile m / 2 into slot m % 3.
  const auto load_matrix_of = [&](int m) {
    if (threadIdx.x != 0 || m >= 2 * count) return;
    const TileRows r = tile_rows(t, maps, list[m / 2], window);
    mbarrier_arrive_expect(bars.stage(m), kMatrixBytes);
    load_matrix(slots + (m % kSlots) * kMatrixBytes, r.map, h * 2 * kDim + (m % 2) * kDim, r.y,
                bars.stage(m));
  };
  // Tile i's mask words (a union tile's) into buffer i % 2, as one commit group.
  const auto load_masks = [&](int i) {
    if (i < count && list[i] < t.union_tiles)
      load_mask_words(t, reinterpret_cast<uint32_t*>(masks + (i % 2) * kMaskBytes), list[i], q0);
    copy_commit();
  };
  load_matrix_of(0);
  load_matrix_of(1);
  load_masks(0);
  mbarrier_wait(bars.own(), 0);

  float o[2][32], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int b = 0; b < 2; ++b) {
#pragma unroll
    for (int j = 0; j < 32; ++j) o[b][j] = 0.0f;
  }
  const uint32_t q_address = shared_address(q_s);
  for (int i = 0; i < count; ++i) {
    const int mk = 2 * i, mv = 2 * i + 1;
    copy_wait<0>();  // this thread's mask words of tile i
    mbarrier_wait(bars.stage(mk), bars.parity(mk));
    __syncthreads();         // everyone's words; everyone done with tile i - 1 (V's slot, the other buffer)
    load_matrix_of(mk + 2);  // K of tile i + 1, into tile i - 1's V slot
    load_masks(i + 1);
    const int tile = list[i];

    float s[32];
    wgmma_fence();
    product_over_values(s, q_address, shared_address(slots + (mk % kSlots) * kMatrixBytes));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(s);
    __syncthreads();  // every warp's S done: K's slot takes V of tile i + 1
    load_matrix_of(mk + 3);

    uint32_t bits[2][2];
    tile_bits(t, reinterpret_cast<const uint32_t*>(masks + (i % 2) * kMaskBytes), tails, tile, bits);
#pragma unroll
    for (int j = 0; j < 32; ++j) s[j] = column_bit(bits, j) ? s[j] * a.scale2 : -INFINITY;
    float m_new[2];
    row_maxima(s, m, m_new);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float factor = rescale(m[hh], m_new[hh]);
      l[hh] *= factor;
      m[hh] = m_new[hh];
#pragma unroll
      for (int b = 0; b < 2; ++b) {
#pragma unroll
        for (int j = 0; j < 32; ++j)
          if ((j / 2) % 2 == hh) o[b][j] *= factor;
      }
    }
    uint32_t p[4][4];
    probabilities(s, m, l, p);

    mbarrier_wait(bars.stage(mv), bars.parity(mv));
    wgmma_fence();
    product_over_rows(o, p, shared_address(slots + (mv % kSlots) * kMatrixBytes));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(o);
  }
  copy_wait<0>();  // only empty groups are left

#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
  }
  const float inv[2] = {l[0] > 0.0f ? 1.0f / l[0] : 0.0f, l[1] > 0.0f ? 1.0f / l[1] : 0.0f};
  store_rows(t, o, inv, row0, h, a.out);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t query = row0 + 8 * hh;
    if (query < t.q_end && lane % 4 == 0)
      a.lse[query * t.heads + h] = l[hh] > 0.0f ? (m[hh] + log2f(l[hh])) / kLog2e : INFINITY;
  }
}

}  // namespace

std::string union_fused_unsupported(const UnionAttentionShape& s) {
  if (s.qk_dim != kDim || s.v_dim != kDim)
    return "key and value widths " + std::to_string(s.qk_dim) + " and " + std::to_string(s.v_dim) +
           " (the fused kernels' are " + std::to_string(kDim) + ")";
  if (s.tail() > kTailReach)
    return "a tail of " + std::to_string(s.tail()) + " slots (at most " + std::to_string(kTailReach) + ")";
  return "";
}

TailRows union_fused_tail_rows(const UnionAttentionShape& s, int64_t q_begin, int64_t q_end) {
  return {std::max<int64_t>(0, s.first + q_begin - kTailReach), s.first + q_end};
}

Tiles union_tile::union_fused_tiles(const UnionAttentionShape& s, const ChunkUnion& u, const bf16* union_kv,
                                    const bf16* tail_kv, const TailRows& tail, int64_t q_begin, int64_t q_end,
                                    const int32_t* selected) {
  const std::string unsupported = union_fused_unsupported(s);
  check(unsupported.empty(), "union attention (fused): ", unsupported);
  return {union_kv, tail_kv,  u.masks.data(), selected, q_begin, q_end,
          s.heads,  s.width,  s.pooled,       u.words,  u.count, (u.count + kKeys - 1) / kKeys,
          s.first,  tail.low, tail.high};
}

Maps union_tile::union_fused_maps(const Tiles& t, const bf16* q, const bf16* dout) {
  const int64_t kv_cols = t.heads * 2 * kDim;
  Maps m{};
  m.q = bf16_tensor_map_128b(q, t.q_end, t.heads * kDim, t.heads * kDim, kRows, 64);
  m.dout = bf16_tensor_map_128b(dout, t.q_end, t.heads * kDim, t.heads * kDim, kRows, 64);
  m.union_kv =
      bf16_tensor_map_128b(t.union_kv, std::max<int64_t>(t.union_count, 1), kv_cols, kv_cols, kKeys, 64);
  m.tail_kv = t.tail_kv != nullptr
                  ? bf16_tensor_map_128b(t.tail_kv, t.tail_high - t.tail_low, kv_cols, kv_cols, kKeys, 64)
                  : m.union_kv;
  return m;
}

void union_attention_forward_fused(const UnionAttentionShape& s, const ChunkUnion& u, const bf16* union_kv,
                                   const bf16* tail_kv, const TailRows& tail, int64_t q_begin, int64_t q_end,
                                   const int32_t* selected, const bf16* q, bf16* out, float* lse,
                                   cudaStream_t stream) {
  const ForwardArgs a{union_fused_tiles(s, u, union_kv, tail_kv, tail, q_begin, q_end, selected), q, out, lse,
                      s.scale * kLog2e};
  if (q_end <= q_begin) return;
  const Maps maps = union_fused_maps(a.t, q, q);
  const size_t bytes = forward_shared_bytes(a.t.union_tiles);
  allow_shared_memory(union_forward_kernel, bytes, "union attention (fused): a union of ", u.count, " keys");
  const dim3 grid(static_cast<unsigned>((q_end - q_begin + kRows - 1) / kRows),
                  static_cast<unsigned>(s.heads));
  launch_kernel(union_forward_kernel, grid, kThreads, bytes, stream, a, maps);
  SPINDLE_LAUNCHED("union_forward_kernel");
}

}  // namespace spindle::cuda
