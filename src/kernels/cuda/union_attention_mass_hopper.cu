// The union form's attention mass for the indexer's KL training (union_attention_hopper.h): a CTA
// per block of 64 queries and tile (the union's, then the block's two tail tiles) loops over the
// heads, S_h = Q_h K_h^T on wgmma and P_h from the forward's log-sum-exp summed in registers, then
// writes each selected key's sum at its slot. The indexer's layout makes the slot a count: a row's
// pool slots hold its pooled tokens ascending (then -1), its tail slots its own pool's tokens
// ascending from `pooled`, so the k-th set bit of its mask is slot k; each slot written is checked
// against the token it holds.
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

struct MassArgs {
  Tiles t;
  const int32_t* keys;         // the union's tokens
  const float* lse;            // [queries, heads]: the forward's log-sum-exp
  const uint32_t* tail_masks;  // [queries, 4]: each query's tail bits over its block's window
  float* mass;                 // [queries, width]
  float scale2;
};

constexpr int kStageBytes = 2 * kMatrixBytes;  // Q_h, then the tile's K_h
constexpr size_t kMassSharedBytes = 1024 + kStages * kStageBytes;

__global__ void __launch_bounds__(kThreads, 3)
    union_mass_kernel(MassArgs a, const __grid_constant__ Maps maps) {
  wait_for_earlier_kernels();
  extern __shared__ unsigned char raw[];
  __shared__ Barriers bars;
  unsigned char* stages = align_1024(raw);
  const Tiles& t = a.t;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q0 = t.q_begin + static_cast<int64_t>(blockIdx.x) * kRows, window = t.first + q0 - kTailReach;
  const int64_t tile = blockIdx.y, row0 = q0 + 16 * warp + lane / 4;
  const bool tail = tile >= t.union_tiles;

  // This thread's two rows' bits over the tile, and the slot of each row's first one: the bits
  // below the tile (for a union tile, summed a quarter by each thread of the row's quad).
  uint32_t bits[2][2];
  int base[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t query = row0 + 8 * hh;
    const bool valid = query < t.q_end;
    int below = 0;
    if (!tail) {
      const uint32_t* row = t.masks + query * t.words;
      bits[hh][0] = valid && 2 * tile < t.words ? row[2 * tile] : 0u;
      bits[hh][1] = valid && 2 * tile + 1 < t.words ? row[2 * tile + 1] : 0u;
      if (valid)
        for (int64_t k = lane % 4; k < 2 * tile; k += 4) below += __popc(row[k]);
    } else {
      uint32_t m[4] = {0u, 0u, 0u, 0u};
      if (valid)
        for (int w = 0; w < 4; ++w) m[w] = a.tail_masks[query * 4 + w];
      const bool second = tile > t.union_tiles;
      bits[hh][0] = second ? m[2] : m[0];
      bits[hh][1] = second ? m[3] : m[1];
      below = lane % 4 == 0 ? static_cast<int>(t.pooled) + (second ? __popc(m[0]) + __popc(m[1]) : 0) : 0;
    }
    below += __shfl_xor_sync(0xffffffffu, below, 1);
    below += __shfl_xor_sync(0xffffffffu, below, 2);
    base[hh] = below;
  }
  if (!__syncthreads_or((bits[0][0] | bits[0][1] | bits[1][0] | bits[1][1]) != 0)) return;  // no query's
  bars.init();
  const TileRows rows = tile_rows(t, maps, tile, window);
  const auto load_head = [&](int h) {
    if (threadIdx.x != 0) return;
    unsigned char* stage = stages + (h % kStages) * kStageBytes;
    mbarrier_arrive_expect(bars.stage(h), kStageBytes);
    load_rows(&maps.q, stage, q0, h, bars.stage(h));
    load_matrix(stage + kMatrixBytes, rows.map, h * 2 * kDim, rows.y, bars.stage(h));
  };
  load_head(0);
  float sum[32];
#pragma unroll
  for (int j = 0; j < 32; ++j) sum[j] = 0.0f;
  for (int h = 0; h < t.heads; ++h) {
    if (h + 1 < t.heads) load_head(h + 1);  // its stage was last read before the previous barrier
    mbarrier_wait(bars.stage(h), bars.parity(h));
    const uint32_t q_address = shared_address(stages + (h % kStages) * kStageBytes);
    float s[32];
    wgmma_fence();
    product_over_values(s, q_address, q_address + kMatrixBytes);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(s);
    float lse2[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int64_t query = row0 + 8 * hh;
      lse2[hh] = query < t.q_end ? a.lse[query * t.heads + h] * kLog2e : INFINITY;
    }
#pragma unroll
    for (int j = 0; j < 32; ++j)
      if (column_bit(bits, j)) sum[j] += exp2_ftz(s[j] * a.scale2 - lse2[(j / 2) % 2]);
    __syncthreads();  // every thread done with the stage before it is refilled
  }

#pragma unroll
  for (int j = 0; j < 32; ++j) {
    if (!column_bit(bits, j)) continue;
    const int hh = (j / 2) % 2, col = 8 * (j / 4) + 2 * (lane % 4) + j % 2;
    const uint32_t below_in_word = bits[hh][col / 32] & ((1u << (col % 32)) - 1u);
    const int64_t slot = base[hh] + __popc(below_in_word) + (col >= 32 ? __popc(bits[hh][0]) : 0);
    const int64_t query = row0 + 8 * hh;
    const int32_t token = tail ? static_cast<int32_t>(window + (tile - t.union_tiles) * kKeys + col)
                               : a.keys[tile * kKeys + col];
    if (slot >= t.width || t.selected[query * t.width + slot] != token) __trap();  // not the indexer's layout
    a.mass[query * t.width + slot] = sum[j];
  }
}

}  // namespace

void union_attention_mass_fused(const UnionAttentionShape& s, const ChunkUnion& u,
                                const __nv_bfloat16* union_kv, const __nv_bfloat16* tail_kv,
                                const TailRows& tail, int64_t q_begin, int64_t q_end, const int32_t* selected,
                                const __nv_bfloat16* q, const float* lse, const uint32_t* tail_masks,
                                float* mass, cudaStream_t stream) {
  const MassArgs a{union_fused_tiles(s, u, union_kv, tail_kv, tail, q_begin, q_end, selected),
                   u.keys.data(),
                   lse,
                   tail_masks,
                   mass,
                   s.scale * kLog2e};
  if (q_end <= q_begin) return;
  allow_shared_memory(union_mass_kernel, kMassSharedBytes, "union attention mass (fused)");
  const dim3 grid(static_cast<unsigned>((q_end - q_begin + kRows - 1) / kRows),
                  static_cast<unsigned>(a.t.union_tiles + kTailTiles));
  launch_kernel(union_mass_kernel, grid, kThreads, kMassSharedBytes, stream, a, union_fused_maps(a.t, q, q));
  SPINDLE_LAUNCHED("union_mass_kernel");
}

}  // namespace spindle::cuda
