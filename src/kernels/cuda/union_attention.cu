// MLA's sparse attention over a chunk's union and tails: the union, the expansions by kv_b_proj and
// the latent's gradient here, the attention in the fused kernels (union_attention_hopper.h).
#include <algorithm>
#include <cub/device/device_scan.cuh>

#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/union_attention.h"
#include "kernels/cuda/union_attention_hopper.h"

namespace spindle::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
// The fused kernels' queries a launch: their tails' keys and values expanded at once (68 MB).
constexpr int64_t kFusedGroup = 4096;
static_assert(kFusedGroup % 64 == 0, "groups of whole blocks of the fused kernels' queries");

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

__global__ void mark_selected_kernel(const int32_t* selected, int64_t queries, int64_t width, int64_t pooled,
                                     int64_t span, int32_t* flags) {
  wait_for_earlier_kernels();
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= queries * pooled) return;
  const int32_t t = selected[i / pooled * width + i % pooled];
  if (t >= 0 && t < span) flags[t] = 1;  // racing writers all write 1
}

__global__ void write_keys_kernel(const int32_t* flags, const int32_t* slots, int64_t span, int32_t* keys) {
  wait_for_earlier_kernels();
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t < span && flags[t]) keys[slots[t]] = static_cast<int32_t>(t);
}

// One warp per query: its pool slots' bits over the union, 32 slots a round. Lanes whose keys share
// a word OR their bits first (the slots of a pool are consecutive keys), one lane a word adds them to
// the row, which this warp alone writes: no atomics (33M of them a 16k chunk, contended 16 to a word).
__global__ void write_masks_kernel(const int32_t* selected, int64_t queries, int64_t width, int64_t pooled,
                                   int64_t span, const int32_t* slots, int64_t words, uint32_t* masks) {
  wait_for_earlier_kernels();
  const int64_t query = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (query >= queries) return;  // the whole warp
  uint32_t* row = masks + query * words;
  for (int64_t base = 0; base < pooled; base += 32) {
    const int64_t slot = base + lane;
    const int32_t t = slot < pooled ? selected[query * width + slot] : -1;
    const bool valid = t >= 0 && t < span;
    const int32_t j = valid ? slots[t] : 0;
    const uint32_t word = valid ? static_cast<uint32_t>(j / 32) : 0xFFFFFFFFu;
    const uint32_t group = __match_any_sync(0xffffffffu, word);
    const uint32_t bits = __reduce_or_sync(group, valid ? 1u << (j % 32) : 0u);
    if (valid && lane == __ffs(group) - 1) row[word] |= bits;
    __syncwarp();  // this round's words written before the next round reads them
  }
}

// One warp per (query, head): D = dout . out over the values.
__global__ void output_dot_kernel(const bf16* dout, const bf16* out, int64_t rows, int64_t dv, float* dot) {
  wait_for_earlier_kernels();
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float sum = 0.0f;
  for (int64_t i = lane; i < dv; i += 32)
    sum += __bfloat162float(dout[row * dv + i]) * __bfloat162float(out[row * dv + i]);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) dot[row] = sum;
}

__global__ void gather_rows_kernel(const bf16* latent, int64_t stride, const int32_t* keys, int64_t n,
                                   int64_t cols, bf16* rows) {
  wait_for_earlier_kernels();
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n * cols) rows[i] = latent[keys[i / cols] * stride + i % cols];
}

// d_latent[row(r)] += d_rows[r]: row(r) = keys[r] where keys are given (the union's tokens, distinct),
// else low + r (a group's consecutive tail rows).
__global__ void add_rows_kernel(const float* d_rows, const int32_t* keys, int64_t low, int64_t n,
                                int64_t cols, float* d_latent, int64_t stride) {
  wait_for_earlier_kernels();
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * cols) return;
  const int64_t r = i / cols, row = keys != nullptr ? keys[r] : low + r;
  d_latent[row * stride + i % cols] += d_rows[i];
}

// Keys and values [n, heads (qk + v)] of n latent rows (`stride` apart) by kv_b_proj.
void expand(Gemm& gemm, const UnionLatent& lat, const bf16* rows, int64_t stride, int64_t n, int64_t kv_row,
            bf16* kv, cudaStream_t stream) {
  gemm.matmul(true, false, kv_row, n, lat.rank, lat.kv_b_proj, lat.rank, rows, stride, kv, CUDA_R_16BF,
              kv_row, 1.0f, 0.0f, stream, Gemm::Rows::N);
}

// The gradient [n, heads (qk + v)] of n rows' keys and values back through kv_b_proj: the rows'
// latent gradient d_rows [n, rank] (written) and kv_b_proj's (accumulated).
void expand_backward(Gemm& gemm, const UnionLatent& lat, const bf16* rows, int64_t stride, int64_t n,
                     int64_t kv_row, const bf16* dkv, float* d_rows, float* d_kv_b_proj,
                     cudaStream_t stream) {
  gemm.linear_backward_input(dkv, lat.kv_b_proj, d_rows, n, lat.rank, kv_row, 0.0f, stream);
  gemm.matmul(false, true, lat.rank, kv_row, n, rows, stride, dkv, kv_row, d_kv_b_proj, CUDA_R_32F, lat.rank,
              1.0f, 1.0f, stream, Gemm::Rows::K);
}

// The most tail rows of a group of the fused kernels' queries.
int64_t most_fused_tail_rows(const UnionAttentionShape& s, int64_t group) {
  int64_t most = 0;
  for (int64_t g0 = 0; g0 < s.queries; g0 += group) {
    const TailRows t = union_fused_tail_rows(s, g0, std::min(s.queries, g0 + group));
    most = std::max(most, t.high - t.low);
  }
  return most;
}

}  // namespace

ChunkUnion chunk_union(const UnionAttentionShape& s, const int32_t* selected, cudaStream_t stream,
                       int64_t most_keys) {
  const int64_t span = s.span();
  check(span > 0 && span <= (int64_t{1} << 31), "chunk_union: a span of ", span, " tokens");
  check(s.pooled >= 0 && s.tail() >= 0, "chunk_union: ", s.pooled, " pooled slots of ", s.width);
  DeviceBuffer<int32_t> flags(static_cast<size_t>(span), MemoryCategory::Workspace),
      slots(static_cast<size_t>(span), MemoryCategory::Workspace);
  SPINDLE_CUDA(cudaMemsetAsync(flags.data(), 0, flags.size() * sizeof(int32_t), stream));
  const int64_t entries = s.queries * s.pooled;
  if (entries > 0) {
    launch_kernel(mark_selected_kernel, blocks_for(entries), kThreads, 0, stream, selected, s.queries,
                  s.width, s.pooled, span, flags.data());
    SPINDLE_LAUNCHED("mark_selected_kernel");
  }
  size_t scratch_bytes = 0;
  SPINDLE_CUDA(cub::DeviceScan::ExclusiveSum(nullptr, scratch_bytes, flags.data(), slots.data(),
                                             static_cast<int>(span), stream));
  DeviceBuffer<unsigned char> scratch(std::max<size_t>(scratch_bytes, 1), MemoryCategory::Workspace);
  SPINDLE_CUDA(cub::DeviceScan::ExclusiveSum(scratch.data(), scratch_bytes, flags.data(), slots.data(),
                                             static_cast<int>(span), stream));
  int32_t last[2] = {0, 0};  // the last token's slot and flag
  SPINDLE_CUDA(
      cudaMemcpyAsync(&last[0], slots.data() + span - 1, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  SPINDLE_CUDA(
      cudaMemcpyAsync(&last[1], flags.data() + span - 1, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  SPINDLE_CUDA(cudaStreamSynchronize(stream));
  ChunkUnion u;
  u.count = last[0] + last[1];
  u.words = (u.count + 31) / 32;
  if (u.count > most_keys) return u;
  u.capacity = geometric_capacity(u.count);
  u.keys = DeviceBuffer<int32_t>(static_cast<size_t>(u.capacity), MemoryCategory::Workspace);
  u.masks =
      DeviceBuffer<uint32_t>(static_cast<size_t>(s.queries * (u.capacity / 32)), MemoryCategory::Workspace);
  if (u.count == 0) return u;
  launch_kernel(write_keys_kernel, blocks_for(span), kThreads, 0, stream, flags.data(), slots.data(), span,
                u.keys.data());
  SPINDLE_LAUNCHED("write_keys_kernel");
  SPINDLE_CUDA(cudaMemsetAsync(u.masks.data(), 0, u.masks.size() * sizeof(uint32_t), stream));
  launch_kernel(write_masks_kernel, blocks_for(s.queries * 32), kThreads, 0, stream, selected, s.queries,
                s.width, s.pooled, span, slots.data(), u.words, u.masks.data());
  SPINDLE_LAUNCHED("write_masks_kernel");
  return u;
}

namespace {

// The union's latent rows (gathered) and their keys and values, once for the chunk.
struct UnionRows {
  DeviceBuffer<bf16> rows, kv;
};
UnionRows expand_union(Gemm& gemm, const ChunkUnion& u, const UnionLatent& lat, int64_t kv_row,
                       cudaStream_t stream) {
  const auto cells = static_cast<size_t>(u.capacity);
  UnionRows r{DeviceBuffer<bf16>(cells * lat.rank, MemoryCategory::Workspace),
              DeviceBuffer<bf16>(cells * kv_row, MemoryCategory::Workspace)};
  if (u.count == 0) return r;
  launch_kernel(gather_rows_kernel, blocks_for(u.count * lat.rank), kThreads, 0, stream, lat.latent,
                lat.stride, u.keys.data(), u.count, lat.rank, r.rows.data());
  SPINDLE_LAUNCHED("gather_rows_kernel");
  expand(gemm, lat, r.rows.data(), lat.rank, u.count, kv_row, r.kv.data(), stream);
  return r;
}

}  // namespace

void union_attention_forward(Gemm& gemm, const UnionAttentionShape& s, const ChunkUnion& u,
                             const UnionLatent& lat, const int32_t* selected, const bf16* q, bf16* out,
                             float* lse, cudaStream_t stream) {
  if (s.queries == 0) return;
  const int64_t kv_row = s.heads * (s.qk_dim + s.v_dim);
  const UnionRows union_rows = expand_union(gemm, u, lat, kv_row, stream);
  // The tails' rows expanded a group of queries at a time.
  const int64_t group = std::min(s.queries, kFusedGroup), most_tail = most_fused_tail_rows(s, group);
  DeviceBuffer<bf16> tail_kv(static_cast<size_t>(most_tail * kv_row), MemoryCategory::Workspace);
  for (int64_t g0 = 0; g0 < s.queries; g0 += group) {
    const int64_t g1 = std::min(s.queries, g0 + group);
    const TailRows t = union_fused_tail_rows(s, g0, g1);
    expand(gemm, lat, lat.latent + t.low * lat.stride, lat.stride, t.high - t.low, kv_row, tail_kv.data(),
           stream);
    union_attention_forward_fused(s, u, union_rows.kv.data(), tail_kv.data(), t, g0, g1, selected, q, out,
                                  lse, stream);
  }
}

void union_attention_backward(Gemm& gemm, const UnionAttentionShape& s, const ChunkUnion& u,
                              const UnionLatent& lat, const int32_t* selected, const bf16* q, const bf16* out,
                              const float* lse, const bf16* dout, bf16* dq, float* d_latent,
                              float* d_kv_b_proj, float* mass, cudaStream_t stream) {
  if (s.queries == 0) return;
  if (mass != nullptr)
    SPINDLE_CUDA(cudaMemsetAsync(mass, 0, static_cast<size_t>(s.queries * s.width) * sizeof(float), stream));
  const int64_t H = s.heads, n = u.count, kv_row = H * (s.qk_dim + s.v_dim);
  DeviceBuffer<float> dot(static_cast<size_t>(s.queries * H), MemoryCategory::Workspace);
  launch_kernel(output_dot_kernel, blocks_for(s.queries * H * 32), kThreads, 0, stream, dout, out,
                s.queries * H, s.v_dim, dot.data());
  SPINDLE_LAUNCHED("output_dot_kernel");
  const UnionBackwardInputs in{q, lse, dout, dot.data()};
  const UnionRows union_rows = expand_union(gemm, u, lat, kv_row, stream);
  if (n > 0) {
    // The union's gradient from every query at once.
    DeviceBuffer<bf16> union_dkv(static_cast<size_t>(u.capacity * kv_row), MemoryCategory::Workspace);
    union_attention_backward_fused_union(s, u, union_rows.kv.data(), selected, in, union_dkv.data(), stream);
    DeviceBuffer<float> union_d_rows(static_cast<size_t>(u.capacity * lat.rank), MemoryCategory::Workspace);
    expand_backward(gemm, lat, union_rows.rows.data(), lat.rank, n, kv_row, union_dkv.data(),
                    union_d_rows.data(), d_kv_b_proj, stream);
    launch_kernel(add_rows_kernel, blocks_for(n * lat.rank), kThreads, 0, stream, union_d_rows.data(),
                  u.keys.data(), 0, n, lat.rank, d_latent, lat.stride);
    SPINDLE_LAUNCHED("add_rows_kernel");
  }
  // dq and the tails' gradient a group of queries at a time.
  const int64_t group = std::min(s.queries, kFusedGroup), most_tail = most_fused_tail_rows(s, group);
  DeviceBuffer<bf16> tail_kv(static_cast<size_t>(most_tail * kv_row), MemoryCategory::Workspace),
      tail_dkv(static_cast<size_t>(most_tail * kv_row), MemoryCategory::Workspace);
  DeviceBuffer<float> tail_d_rows(static_cast<size_t>(most_tail * lat.rank), MemoryCategory::Workspace);
  DeviceBuffer<uint32_t> tail_masks(static_cast<size_t>(s.queries * 4), MemoryCategory::Workspace);
  for (int64_t g0 = 0; g0 < s.queries; g0 += group) {
    const int64_t g1 = std::min(s.queries, g0 + group);
    const TailRows t = union_fused_tail_rows(s, g0, g1);
    const bf16* tail_latent = lat.latent + t.low * lat.stride;
    expand(gemm, lat, tail_latent, lat.stride, t.high - t.low, kv_row, tail_kv.data(), stream);
    union_attention_backward_fused_tails(s, u, union_rows.kv.data(), tail_kv.data(), t, g0, g1, selected, in,
                                         tail_masks.data(), dq, tail_dkv.data(), stream);
    if (mass != nullptr)
      union_attention_mass_fused(s, u, union_rows.kv.data(), tail_kv.data(), t, g0, g1, selected, q, lse,
                                 tail_masks.data(), mass, stream);
    expand_backward(gemm, lat, tail_latent, lat.stride, t.high - t.low, kv_row, tail_dkv.data(),
                    tail_d_rows.data(), d_kv_b_proj, stream);
    // Consecutive groups share rows: their adds run in turn on the stream.
    launch_kernel(add_rows_kernel, blocks_for((t.high - t.low) * lat.rank), kThreads, 0, stream,
                  tail_d_rows.data(), nullptr, t.low, t.high - t.low, lat.rank, d_latent, lat.stride);
    SPINDLE_LAUNCHED("add_rows_kernel");
  }
}

}  // namespace spindle::cuda
