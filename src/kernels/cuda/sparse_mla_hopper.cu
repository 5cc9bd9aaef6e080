// The sparse MLA forward on wgmma; see sparse_mla_hopper.h for the design. Scores are kept in the
// log2 domain (scaled by scale * log2(e)) so that each exponential is one instruction (exp2_ftz).
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/sparse_mla_hopper.h"
#include "kernels/cuda/sparse_mla_tile.cuh"
#include "kernels/cuda/tensor_map.h"
#include "kernels/cuda/wgmma.cuh"

namespace spindle::cuda {

namespace {

constexpr int kGroups = 2;  // warpgroups, each over every other tile
constexpr int kThreads = 128 * kGroups;
constexpr int kKeys = kTileKeys;  // rows per tile: the scores' M
constexpr int kHeads = 32;        // heads per CTA: both products' N
constexpr int kMaxDim = 512;

struct Args : SparseMlaInputs {
  __nv_bfloat16* out;
  float* lse;
};

// Byte offsets into the dynamic shared memory, from its first 1024-byte boundary (the swizzled
// tiles' alignment; kAlignSlack more bytes are asked for).
constexpr uint32_t kAlignSlack = 1024;
struct Layout {
  uint32_t tile_bytes;  // one tile, [kKeys][dk] bf16; the kGroups tiles come first
  uint32_t q;           // [kHeads][dk] bf16
  uint32_t p;           // [kGroups] P^T, [kHeads][kKeys] bf16
  uint32_t idx;         // [kGroups][kKeys] int32: the tile's selected rows
  uint32_t red_max;     // [kGroups][4 warps][kHeads] float: per-warp column maxima
  uint32_t red_sum;     // [kGroups][4 warps][kHeads] float: per-warp column sums
  uint32_t merge;       // [2][kHeads] float: warpgroup 1's running max and sum
  uint32_t bars;        // [kGroups] uint64: each warpgroup's tile barrier (TMA and its arrival)
  uint32_t total;
};

__host__ __device__ Layout layout(int dk) {
  Layout l{};
  l.tile_bytes = static_cast<uint32_t>(kKeys * dk * 2);
  l.q = kGroups * l.tile_bytes;
  l.p = l.q + kHeads * dk * 2;
  l.idx = l.p + kGroups * kHeads * kKeys * 2;
  l.red_max = l.idx + kGroups * kKeys * 4;
  l.red_sum = l.red_max + kGroups * 4 * kHeads * 4;
  l.merge = l.red_sum + kGroups * 4 * kHeads * 4;
  l.bars = l.merge + 2 * kHeads * 4;
  l.total = l.bars + kGroups * 8;
  return l;
}

// Blocks: dv / 64, a template argument so that no branch stands between a tile's wgmma (the
// compiler serialises them otherwise).
template <int Blocks>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_mla_forward_hopper_kernel(const Args a, const __grid_constant__ CUtensorMap latent_map) {
  extern __shared__ __align__(128) unsigned char shared_base[];
  unsigned char* shared =
      shared_base + ((kAlignSlack - shared_address(shared_base) % kAlignSlack) % kAlignSlack);
  const Layout L = layout(a.dk);
  const int64_t t = blockIdx.x;
  // The warpgroup (and warp) through a shuffle: the compiler then knows them uniform across the warp,
  // and does not serialise the wgmma in branches and loops that depend on them.
  const int group = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0),
            warp = __shfl_sync(0xffffffffu, threadIdx.x % 128 / 32, 0);
  const int h0 = blockIdx.y * kHeads, wt = threadIdx.x % 128, lane = threadIdx.x % 32;
  unsigned char* tile_s = shared + group * L.tile_bytes;
  unsigned char* q_s = shared + L.q;
  unsigned char* p_s = shared + L.p + group * kHeads * kKeys * 2;
  int32_t* idx_s = reinterpret_cast<int32_t*>(shared + L.idx) + group * kKeys;
  uint64_t* bar = reinterpret_cast<uint64_t*>(shared + L.bars) + group;
  uint32_t phase = 0;  // of bar: one completed phase per tile
  float* red_max = reinterpret_cast<float*>(shared + L.red_max) + group * 4 * kHeads;
  float* red_sum = reinterpret_cast<float*>(shared + L.red_sum) + group * 4 * kHeads;
  const int64_t tiles = (a.width + kKeys - 1) / kKeys;
  const int chunks = a.dk / 8;
  const uint32_t row_group_bytes = static_cast<uint32_t>(a.dk * 16);

  if (wt == 0) mbarrier_init(bar, 1);
  mbarrier_init_fence();
  __syncthreads();
  // Q (zero rows past the last head), then each warpgroup's first tile.
  for (int u = threadIdx.x; u < kHeads * chunks; u += kThreads) {
    const int g = u / (8 * chunks), c = u % (8 * chunks) / 8, head = 8 * g + u % 8;
    const bool valid = h0 + head < a.heads;
    copy16(q_s + u * 16, valid ? a.q + ((t * a.heads + h0 + head) * a.dk + c * 8) : a.q, valid);
  }
  TileRows rows = tile_rows(a.selected, a.width, t, group, wt);
  if (wt < kKeys) idx_s[wt] = rows.own;
  if (group < tiles) fill_tile(tile_s, rows, a.latent, a.latent_stride, a.dk, wt, &latent_map, bar);
  copy_commit();
  rows = tile_rows(a.selected, a.width, t, group + kGroups, wt);

  // Per thread, heads 8 b + 2 (lane % 4) + e at index 2 b + e (the accumulators' columns).
  float m_run[8], l_run[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.0f;
  }
  float acc[Blocks][16] = {};
  const uint32_t tile_address = shared_address(tile_s), q_address = shared_address(q_s),
                 p_address = shared_address(p_s);
  const int key_a = 16 * warp + lane / 4;  // this thread's score rows: key_a and key_a + 8

  copy_wait_all();
  fence_async_shared();
  __syncthreads();  // Q and the first tiles landed
  for (int64_t tile = group; tile < tiles; tile += kGroups) {
    copy_wait_all();
    fence_async_shared();
    mbarrier_wait(bar, phase);
    phase ^= 1;
    warpgroup_barrier(group);
    // S^T [64 keys, 32 heads] = K Q^T over dk.
    float s[16] = {};
    tile_times_rows<kHeads>(s, tile_address, q_address, a.dk, row_group_bytes);

    // Online softmax down each head's column: the column's maximum over the 4 warps.
    const bool valid0 = idx_s[key_a] >= 0, valid1 = idx_s[key_a + 8] >= 0;
    float mx[8];
#pragma unroll
    for (int j = 0; j < 16; ++j) s[j] = ((j / 2) % 2 ? valid1 : valid0) ? s[j] * a.scale2 : -INFINITY;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      mx[i] = fmaxf(s[4 * (i / 2) + i % 2], s[4 * (i / 2) + 2 + i % 2]);
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2)
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], offset));
    }
    if (lane < 4) {
#pragma unroll
      for (int i = 0; i < 8; ++i) red_max[warp * kHeads + 8 * (i / 2) + 2 * lane + i % 2] = mx[i];
    }
    warpgroup_barrier(group);
    float alpha[8], sum[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int head = 8 * (i / 2) + 2 * (lane % 4) + i % 2;
      float m_new = m_run[i];
#pragma unroll
      for (int w = 0; w < 4; ++w) m_new = fmaxf(m_new, red_max[w * kHeads + head]);
      alpha[i] = m_new == -INFINITY ? 1.0f : exp2_ftz(m_run[i] - m_new);
      m_run[i] = m_new;
      sum[i] = 0.0f;
    }
    // P^T [32 heads, 64 keys] to shared memory, the B operand of the values' product.
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int i = 2 * (j / 4) + j % 2, head = 8 * (j / 4) + 2 * (lane % 4) + j % 2;
      const float p = m_run[i] == -INFINITY ? 0.0f : exp2_ftz(s[j] - m_run[i]);
      *reinterpret_cast<__nv_bfloat16*>(p_s + core_offset(head, key_a + 8 * ((j / 2) % 2), kKeys)) =
          __float2bfloat16(p);
      sum[i] += p;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2) sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], offset);
    }
    if (lane < 4) {
#pragma unroll
      for (int i = 0; i < 8; ++i) red_sum[warp * kHeads + 8 * (i / 2) + 2 * lane + i % 2] = sum[i];
    }
    fence_async_shared();
    warpgroup_barrier(group);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int head = 8 * (i / 2) + 2 * (lane % 4) + i % 2;
      float total = 0.0f;
#pragma unroll
      for (int w = 0; w < 4; ++w) total += red_sum[w * kHeads + head];
      l_run[i] = l_run[i] * alpha[i] + total;
    }

    // O^T [dv, 32 heads] = O^T alpha + V^T P^T: V^T is the tile read MN-major, 64 columns a block.
#pragma unroll
    for (int b = 0; b < Blocks; ++b) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        acc[b][j] *= alpha[2 * (j / 4) + j % 2];
        wgmma_hold(acc[b][j]);
      }
    }
    wgmma_fence();
#pragma unroll
    for (int b = 0; b < Blocks; ++b) {
#pragma unroll
      for (int k = 0; k < kKeys / 16; ++k)
        wgmma_m64n32k16<1>(acc[b],
                           wgmma_descriptor_128b(tile_address + b * kSwizzleBlockBytes + k * 16 * 128,
                                                 kSwizzleBlockBytes, 1024),
                           wgmma_descriptor(p_address + k * 256, 128, kKeys * 16), true);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < Blocks; ++b) {
#pragma unroll
      for (int j = 0; j < 16; ++j) wgmma_hold(acc[b][j]);
    }
    warpgroup_barrier(group);  // every warp is done with the tile, P^T and the indices

    if (tile + kGroups < tiles) {
      if (wt < kKeys) idx_s[wt] = rows.own;
      fill_tile(tile_s, rows, a.latent, a.latent_stride, a.dk, wt, &latent_map, bar);
    }
    copy_commit();
    rows = tile_rows(a.selected, a.width, t, tile + 2 * kGroups, wt);
  }

  // Merge the two warpgroups' softmax states: warpgroup 1's output (unnormalised, fp32) through its
  // tile buffer, the result as bf16 [heads][dv] through warpgroup 0's, then out in 16-byte rows.
  __syncthreads();
  float* merge_o = reinterpret_cast<float*>(shared + L.tile_bytes);  // [kHeads][dv]
  float* merge_ml = reinterpret_cast<float*>(shared + L.merge);      // m [kHeads], l [kHeads]
  if (group == 1) {
#pragma unroll
    for (int b = 0; b < Blocks; ++b) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int dim = 64 * b + key_a + 8 * ((j / 2) % 2), head = 8 * (j / 4) + 2 * (lane % 4) + j % 2;
        merge_o[head * a.dv + dim] = acc[b][j];
      }
    }
    if (warp == 0 && lane < 4) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int head = 8 * (i / 2) + 2 * lane + i % 2;
        merge_ml[head] = m_run[i];
        merge_ml[kHeads + head] = l_run[i];
      }
    }
  }
  __syncthreads();
  __nv_bfloat16* o_s = reinterpret_cast<__nv_bfloat16*>(shared);  // [kHeads][dv]
  if (group == 0) {
    float w0[8], w1[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int head = 8 * (i / 2) + 2 * (lane % 4) + i % 2;
      const float m1 = merge_ml[head], l1 = merge_ml[kHeads + head], m = fmaxf(m_run[i], m1);
      const float a0 = m == -INFINITY ? 0.0f : exp2_ftz(m_run[i] - m),
                  a1 = m == -INFINITY ? 0.0f : exp2_ftz(m1 - m);
      const float l = l_run[i] * a0 + l1 * a1, inv = l > 0.0f ? 1.0f / l : 0.0f;
      w0[i] = a0 * inv;
      w1[i] = a1 * inv;
      if (warp == 0 && lane < 4 && h0 + head < a.heads)
        a.lse[t * a.heads + h0 + head] = l > 0.0f ? (m + log2f(l)) / kLog2e : INFINITY;
    }
#pragma unroll
    for (int b = 0; b < Blocks; ++b) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int i = 2 * (j / 4) + j % 2;
        const int dim = 64 * b + key_a + 8 * ((j / 2) % 2), head = 8 * (j / 4) + 2 * (lane % 4) + j % 2;
        o_s[head * a.dv + dim] = __float2bfloat16(acc[b][j] * w0[i] + merge_o[head * a.dv + dim] * w1[i]);
      }
    }
  }
  __syncthreads();
  const int heads_here = min(kHeads, a.heads - h0), units = heads_here * a.dv / 8;
  uint4* dst = reinterpret_cast<uint4*>(a.out + (t * a.heads + h0) * a.dv);
  for (int u = threadIdx.x; u < units; u += kThreads) dst[u] = reinterpret_cast<const uint4*>(o_s)[u];
}

}  // namespace

bool sparse_mla_hopper_takes(const SparseMlaShape& s) {
  return sparse_mla_unsupported(s).empty() && s.dk % 64 == 0 && s.dv % 64 == 0 && s.dv <= s.dk &&
         s.dk <= kMaxDim;
}

void sparse_mla_forward_hopper(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                               const int32_t* selected, __nv_bfloat16* out, float* lse, cudaStream_t stream) {
  check(sparse_mla_hopper_takes(s), "sparse MLA on wgmma: dk ", s.dk, " and dv ", s.dv,
        " must be multiples of 64 with dv <= dk <= ", kMaxDim);
  check(reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(latent) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(out) % 16 == 0,
        "sparse MLA on wgmma: q, the latent and out must be 16-byte aligned");
  if (s.tokens == 0) return;
  Args args{};
  static_cast<SparseMlaInputs&>(args) = sparse_mla_inputs(s, q, latent, selected);
  args.out = out;
  args.lse = lse;
  // The kernel does not know how many rows the latent has, only that every selected row is one:
  // the map claims more rows than any sequence, and only selected pools are read through it.
  const CUtensorMap map =
      bf16_tensor_map_128b(latent, int64_t{1} << 31, s.dk, s.latent_stride, kPoolRows, 64);
  const size_t shared_bytes = layout(args.dk).total + kAlignSlack;
  const dim3 grid(static_cast<unsigned>(s.tokens), static_cast<unsigned>((s.heads + kHeads - 1) / kHeads));
  const auto run = [&](auto kernel) {
    allow_shared_memory(kernel, shared_bytes, "sparse MLA on wgmma: dk ", s.dk, ", dv ", s.dv);
    kernel<<<grid, kThreads, shared_bytes, stream>>>(args, map);
    SPINDLE_LAUNCHED("sparse_mla_forward_hopper_kernel");
  };
  switch (s.dv / 64) {
    case 1:
      return run(sparse_mla_forward_hopper_kernel<1>);
    case 2:
      return run(sparse_mla_forward_hopper_kernel<2>);
    case 3:
      return run(sparse_mla_forward_hopper_kernel<3>);
    case 4:
      return run(sparse_mla_forward_hopper_kernel<4>);
    case 5:
      return run(sparse_mla_forward_hopper_kernel<5>);
    case 6:
      return run(sparse_mla_forward_hopper_kernel<6>);
    case 7:
      return run(sparse_mla_forward_hopper_kernel<7>);
    default:
      return run(sparse_mla_forward_hopper_kernel<8>);
  }
}

}  // namespace spindle::cuda
