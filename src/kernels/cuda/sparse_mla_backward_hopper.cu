// The sparse MLA backward on wgmma; see sparse_mla_hopper.h for the design. Not yet run on a GPU:
// sparse_mla_backward does not dispatch here until the GPU tests have passed it.
#include <cmath>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/shared_memory_limit.h"
#include "kernels/cuda/sparse_mla_hopper.h"
#include "kernels/cuda/sparse_mla_tile.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace spindle::cuda {

namespace {

constexpr int kThreads = 256;     // two warpgroups
constexpr int kKeys = kTileKeys;  // rows per tile
constexpr int kHeads = 32;        // heads per CTA

struct Args : SparseMlaInputs {
  const __nv_bfloat16* out;
  const float* lse;
  const __nv_bfloat16* dout;
  __nv_bfloat16* dq;
  float* d_latent;
};

// Byte offsets into the dynamic shared memory.
struct Layout {
  uint32_t tile_bytes;  // one tile, [kKeys][dk] bf16; the two tiles come first
  uint32_t q;           // [kHeads][dk] bf16
  uint32_t dout;        // [kHeads][dv] bf16
  uint32_t exchange;    // [2 warpgroups][4][128 threads][4] fp32: S^T from warpgroup 0, dP^T from 1
  uint32_t ds;          // dS^T as [kHeads][kKeys] bf16, the B operand of dQ^T
  uint32_t idx;         // [2][kKeys] int32: each tile's selected rows
  uint32_t stats;       // [kHeads] lse (log2 domain), [kHeads] delta
  uint32_t total;
};

__host__ __device__ Layout layout(int dk, int dv) {
  Layout l{};
  l.tile_bytes = static_cast<uint32_t>(kKeys * dk * 2);
  l.q = 2 * l.tile_bytes;
  l.dout = l.q + kHeads * dk * 2;
  l.exchange = l.dout + kHeads * dv * 2;
  l.ds = l.exchange + 2 * 128 * 16 * 4;
  l.idx = l.ds + kHeads * kKeys * 2;
  l.stats = l.idx + 2 * kKeys * 4;
  l.total = l.stats + 2 * kHeads * 4;
  return l;
}

// [kHeads][dim] rows of query t (heads h0 ..) into the core-matrix layout, zero past the last head.
__device__ __forceinline__ void load_heads(unsigned char* dst, const __nv_bfloat16* src, int64_t t, int h0,
                                           int heads, int dim) {
  const int chunks = dim / 8;
  for (int u = threadIdx.x; u < kHeads * chunks; u += kThreads) {
    const int g = u / (8 * chunks), c = u % (8 * chunks) / 8, head = 8 * g + u % 8;
    const bool valid = h0 + head < heads;
    copy16(dst + u * 16, valid ? src + ((t * heads + h0 + head) * dim + c * 8) : src, valid);
  }
}

// KB = dk / 128: each warpgroup owns half of dk, KB blocks of 64, for dQ^T and the latent's
// gradient.
template <int KB>
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_backward_hopper_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char shared[];
  constexpr int kDk = 128 * KB;
  const Layout L = layout(kDk, a.dv);
  const int64_t t = blockIdx.x;
  // Through a shuffle, so that the compiler sees them uniform and does not serialise the wgmma.
  const int group = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0),
            warp = __shfl_sync(0xffffffffu, threadIdx.x % 128 / 32, 0);
  const int tid = threadIdx.x, wt = tid % 128, lane = tid % 32, c = lane % 4;
  const int h0 = blockIdx.y * kHeads;
  unsigned char* q_s = shared + L.q;
  unsigned char* do_s = shared + L.dout;
  float* exchange = reinterpret_cast<float*>(shared + L.exchange);
  unsigned char* ds_s = shared + L.ds;
  int32_t* idx_s = reinterpret_cast<int32_t*>(shared + L.idx);
  float* lse_s = reinterpret_cast<float*>(shared + L.stats);
  float* delta_s = lse_s + kHeads;
  const int64_t tiles = (a.width + kKeys - 1) / kKeys;
  constexpr uint32_t kRowGroup = kDk * 16;  // bytes between 8-row groups of a tile and of q
  const uint32_t do_row_group = static_cast<uint32_t>(a.dv * 16);

  load_heads(q_s, a.q, t, h0, a.heads, kDk);
  load_heads(do_s, a.dout, t, h0, a.heads, a.dv);
  TileRows rows = tile_rows(a.selected, a.width, t, 0, tid);
  if (tid < kKeys) idx_s[tid] = rows.own;
  if (tiles > 0) gather_tile<kThreads>(shared, rows, a.latent, a.latent_stride, a.dk, tid);
  copy_commit();
  rows = tile_rows(a.selected, a.width, t, 1, tid);
  {  // delta = rowsum(dO o O) and the log-sum-exp (log2 domain), 8 threads per head
    const int head = tid / 8, part = tid % 8;
    float sum = 0.0f;
    if (h0 + head < a.heads) {
      const int64_t base = (t * a.heads + h0 + head) * a.dv;
      for (int col = part; col < a.dv; col += 8)
        sum += __bfloat162float(a.dout[base + col]) * __bfloat162float(a.out[base + col]);
    }
#pragma unroll
    for (int offset = 4; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (part == 0) {
      delta_s[head] = sum;
      lse_s[head] = h0 + head < a.heads ? a.lse[t * a.heads + h0 + head] * kLog2e : INFINITY;
    }
  }

  const int key_a = 16 * warp + lane / 4;  // this thread's rows of the tile: key_a and key_a + 8
  const uint32_t q_address = shared_address(q_s), do_address = shared_address(do_s),
                 ds_address = shared_address(ds_s);
  float dq[KB][16] = {};  // dQ^T, this warpgroup's dk blocks
  // The per-tile accumulators, set once here: each tile's first wgmma overwrites them, and a
  // non-wgmma write inside the pipeline would make ptxas serialise the wgmma.
  float mine[16] = {}, acc[32] = {};
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int buf = static_cast<int>(tile & 1);
    copy_wait_all();
    fence_async_shared();
    __syncthreads();  // tile, indices, q and statistics visible; what tile - 1 used is free
    if (tile + 1 < tiles) {
      if (tid < kKeys) idx_s[(buf ^ 1) * kKeys + tid] = rows.own;
      gather_tile<kThreads>(shared + (buf ^ 1) * L.tile_bytes, rows, a.latent, a.latent_stride, a.dk, tid);
    }
    copy_commit();
    rows = tile_rows(a.selected, a.width, t, tile + 2, tid);
    const uint32_t tile_address = shared_address(shared + buf * L.tile_bytes);
    const int32_t* idx = idx_s + buf * kKeys;

    // Warpgroup 0: S^T [64 keys, 32 heads] = K Q^T over dk; warpgroup 1: dP^T = V dO^T over dv.
#pragma unroll
    for (int j = 0; j < 16; ++j) wgmma_hold(mine[j]);
    if (group == 0) {
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kDk / 16; ++k)
        wgmma_m64n32k16<0>(mine, wgmma_descriptor(tile_address + k * 256, 128, kRowGroup),
                           wgmma_descriptor(q_address + k * 256, 128, kRowGroup), k > 0);
    } else {
      for (int k = 0; k < a.dv / 16; k += 4) {  // dv a multiple of 64
        wgmma_fence();
#pragma unroll
        for (int kk = k; kk < k + 4; ++kk)
          wgmma_m64n32k16<0>(mine, wgmma_descriptor(tile_address + kk * 256, 128, kRowGroup),
                             wgmma_descriptor(do_address + kk * 256, 128, do_row_group), kk > 0);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < 16; ++j) wgmma_hold(mine[j]);

#pragma unroll
    for (int v = 0; v < 4; ++v)  // to the other warpgroup, whose same thread holds the same elements
      reinterpret_cast<float4*>(exchange)[(group * 4 + v) * 128 + wt] =
          make_float4(mine[4 * v], mine[4 * v + 1], mine[4 * v + 2], mine[4 * v + 3]);
    __syncthreads();
    float other[16];
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float4 x = reinterpret_cast<const float4*>(exchange)[((1 - group) * 4 + v) * 128 + wt];
      other[4 * v] = x.x;
      other[4 * v + 1] = x.y;
      other[4 * v + 2] = x.z;
      other[4 * v + 3] = x.w;
    }
    // P = exp(S - lse), dS = P (dP - delta) scale at (row key_a + 8 ((j / 2) % 2), head 8 (j / 4) +
    // 2 c + j % 2); warpgroup 0 stores dS^T for dQ^T.
    const bool valid0 = idx[key_a] >= 0, valid1 = idx[key_a + 8] >= 0;
    float p[16], ds[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int head = 8 * (j / 4) + 2 * c + j % 2;
      const float s = group == 0 ? mine[j] : other[j], dp = group == 0 ? other[j] : mine[j];
      const bool valid = (j / 2) % 2 ? valid1 : valid0;
      p[j] = valid ? exp2f(s * a.scale2 - lse_s[head]) : 0.0f;
      ds[j] = p[j] * (dp - delta_s[head]) * a.scale;
      if (group == 0)
        *reinterpret_cast<__nv_bfloat16*>(ds_s + core_offset(head, key_a + 8 * ((j / 2) % 2), kKeys)) =
            __float2bfloat16(ds[j]);
    }
    // dS^T and P^T as A fragments over the heads (k16 steps kk: heads 16 kk ..).
    uint32_t ds_a[2][4], p_a[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        ds_a[kk][r] = pack_bf16(ds[8 * kk + 2 * r], ds[8 * kk + 2 * r + 1]);
        p_a[kk][r] = pack_bf16(p[8 * kk + 2 * r], p[8 * kk + 2 * r + 1]);
      }
    fence_async_shared();
    __syncthreads();  // dS^T stored

    // dQ^T [dk rows of this warpgroup, 32 heads] += K^T dS^T: the tile read MN-major.
#pragma unroll
    for (int b = 0; b < KB; ++b)
#pragma unroll
      for (int j = 0; j < 16; ++j) wgmma_hold(dq[b][j]);
    wgmma_fence();
#pragma unroll
    for (int b = 0; b < KB; ++b)
#pragma unroll
      for (int k = 0; k < kKeys / 16; ++k)
        wgmma_m64n32k16<1>(
            dq[b],
            wgmma_descriptor(tile_address + 2 * k * kRowGroup + (group * KB + b) * 1024, kRowGroup, 128),
            wgmma_descriptor(ds_address + k * 256, 128, kKeys * 16), true);
    wgmma_commit();

    // The rows' gradient, [64 keys, this warpgroup's dk columns] = dS^T Q + P^T dO (the value part:
    // columns < dv), 64 columns at a time, added to the latent's rows with atomics (many queries
    // select the same row). B = Q or dO read MN-major.
#pragma unroll
    for (int n = 0; n < KB; ++n) {
      const int col0 = (group * KB + n) * 64;
#pragma unroll
      for (int j = 0; j < 32; ++j) wgmma_hold(acc[j]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
        wgmma_m64n64k16_rs<1>(acc, ds_a[kk],
                              wgmma_descriptor(q_address + 2 * kk * kRowGroup + col0 * 16, kRowGroup, 128),
                              kk > 0);
      if (col0 < a.dv) {
#pragma unroll
        for (int kk = 0; kk < 2; ++kk)
          wgmma_m64n64k16_rs<1>(
              acc, p_a[kk],
              wgmma_descriptor(do_address + 2 * kk * do_row_group + col0 * 16, do_row_group, 128), true);
      }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int j = 0; j < 32; ++j) wgmma_hold(acc[j]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int32_t index = idx[key_a + 8 * h];
        if (index < 0) continue;
        float* dst = a.d_latent + static_cast<int64_t>(index) * a.latent_stride + col0 + 2 * c;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          atomicAdd(reinterpret_cast<float2*>(dst + 8 * j),
                    make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
      }
    }
  }

  // dQ through shared memory as bf16 [kHeads][dk], then out in 16-byte rows.
  wgmma_wait<0>();
  copy_wait_all();  // q and dO with no tile to wait for them
  __syncthreads();
  __nv_bfloat16* dq_s = reinterpret_cast<__nv_bfloat16*>(shared);
#pragma unroll
  for (int b = 0; b < KB; ++b)
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int dim = (group * KB + b) * 64 + key_a + 8 * ((j / 2) % 2), head = 8 * (j / 4) + 2 * c + j % 2;
      dq_s[head * kDk + dim] = __float2bfloat16(dq[b][j]);
    }
  __syncthreads();
  const int heads_here = min(kHeads, a.heads - h0), units = heads_here * kDk / 8;
  uint4* dst = reinterpret_cast<uint4*>(a.dq + (t * a.heads + h0) * kDk);
  for (int u = tid; u < units; u += kThreads) dst[u] = reinterpret_cast<const uint4*>(dq_s)[u];
}

}  // namespace

bool sparse_mla_backward_hopper_takes(const SparseMlaShape& s) {
  return sparse_mla_unsupported(s).empty() && s.dk % 128 == 0 && s.dk <= 512 && s.dv % 64 == 0 &&
         s.dv <= s.dk;
}

void sparse_mla_backward_hopper(const SparseMlaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* latent,
                                const int32_t* selected, const __nv_bfloat16* out, const float* lse,
                                const __nv_bfloat16* dout, __nv_bfloat16* dq, float* d_latent,
                                cudaStream_t stream) {
  check(sparse_mla_backward_hopper_takes(s), "sparse MLA backward on wgmma: dk ", s.dk, " and dv ", s.dv,
        " must be multiples of 128 and 64 with dv <= dk <= 512");
  check(reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(latent) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(dout) % 16 == 0 && reinterpret_cast<uintptr_t>(dq) % 16 == 0,
        "sparse MLA backward on wgmma: q, the latent, dout and dq must be 16-byte aligned");
  if (s.tokens == 0) return;
  Args args{};
  static_cast<SparseMlaInputs&>(args) = sparse_mla_inputs(s, q, latent, selected);
  args.out = out;
  args.lse = lse;
  args.dout = dout;
  args.dq = dq;
  args.d_latent = d_latent;
  const size_t shared_bytes = layout(args.dk, args.dv).total;
  const dim3 grid(static_cast<unsigned>(s.tokens), static_cast<unsigned>((s.heads + kHeads - 1) / kHeads));
  const auto run = [&](auto kernel) {
    allow_shared_memory(kernel, shared_bytes, "sparse MLA backward on wgmma: dk ", s.dk, ", dv ", s.dv);
    kernel<<<grid, kThreads, shared_bytes, stream>>>(args);
    SPINDLE_LAUNCHED("sparse_mla_backward_hopper_kernel");
  };
  switch (s.dk / 128) {
    case 1:
      return run(sparse_mla_backward_hopper_kernel<1>);
    case 2:
      return run(sparse_mla_backward_hopper_kernel<2>);
    case 3:
      return run(sparse_mla_backward_hopper_kernel<3>);
    default:
      return run(sparse_mla_backward_hopper_kernel<4>);
  }
}

}  // namespace spindle::cuda
