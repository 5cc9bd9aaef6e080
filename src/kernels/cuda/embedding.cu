// Embedding and stream mean: memory-bound, one thread per V consecutive features of a token
// (V = 8 when D and the pointers allow), grid-stride over tokens x D / V. A thread reads its
// embedding slice once and writes it to every stream, or reads the H stream slices once and
// writes their mean (or sum, for the embedding gradient).
#include "backend/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/memory_bound.cuh"

namespace spindle::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;

// Work item i of a grid-stride loop over tokens x (D / V): token i / per_token, features from
// (i % per_token) V.
template <int V>
struct Slices {
  int64_t per_token, count;
  __device__ Slices(int64_t tokens, int64_t D) : per_token(D / V), count(tokens * (D / V)) {}
  __device__ int64_t token(int64_t i) const { return i / per_token; }
  __device__ int64_t feature(int64_t i) const { return i % per_token * V; }
};

__device__ int64_t first_item() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ int64_t item_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

template <int V>
__global__ void embed_streams_kernel(const int32_t* tokens, const bf16* embed, bf16* streams, int64_t count,
                                     int64_t H, int64_t D) {
  wait_for_earlier_kernels();
  const Slices<V> s(count, D);
  for (int64_t i = first_item(); i < s.count; i += item_stride()) {
    const int64_t t = s.token(i), d = s.feature(i);
    float v[V];
    load<V>(embed + static_cast<int64_t>(tokens[t]) * D + d, v);
    for (int64_t h = 0; h < H; ++h) store<V>(streams + (t * H + h) * D + d, v);
  }
}

// grad[0, V) += v with the widest fp32 atomics Hopper has (float4, float2).
template <int V>
__device__ void atomic_add(float* grad, const float* v) {
  if constexpr (V >= 4) {
#pragma unroll
    for (int j = 0; j < V; j += 4)
      atomicAdd(reinterpret_cast<float4*>(grad + j), make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]));
  } else if constexpr (V == 2) {
    atomicAdd(reinterpret_cast<float2*>(grad), make_float2(v[0], v[1]));
  } else {
    atomicAdd(grad, v[0]);
  }
}

template <int V>
__global__ void embed_backward_kernel(const int32_t* tokens, const bf16* dstreams, float* dembed,
                                      int64_t count, int64_t H, int64_t D, int32_t skip_id) {
  wait_for_earlier_kernels();
  const Slices<V> s(count, D);
  for (int64_t i = first_item(); i < s.count; i += item_stride()) {
    const int64_t t = s.token(i), d = s.feature(i);
    const int32_t id = tokens[t];
    if (id == skip_id) continue;
    float sum[V] = {}, v[V];
    for (int64_t h = 0; h < H; ++h) {
      load<V>(dstreams + (t * H + h) * D + d, v);
#pragma unroll
      for (int j = 0; j < V; ++j) sum[j] += v[j];
    }
    atomic_add<V>(dembed + static_cast<int64_t>(id) * D + d, sum);
  }
}

template <int V>
__global__ void stream_mean_kernel(const bf16* streams, bf16* mean, int64_t count, int64_t H, int64_t D) {
  wait_for_earlier_kernels();
  const Slices<V> s(count, D);
  for (int64_t i = first_item(); i < s.count; i += item_stride()) {
    const int64_t t = s.token(i), d = s.feature(i);
    float sum[V] = {}, v[V];
    for (int64_t h = 0; h < H; ++h) {
      load<V>(streams + (t * H + h) * D + d, v);
#pragma unroll
      for (int j = 0; j < V; ++j) sum[j] += v[j];
    }
#pragma unroll
    for (int j = 0; j < V; ++j) sum[j] /= static_cast<float>(H);
    store<V>(mean + t * D + d, sum);
  }
}

template <int V>
__global__ void stream_mean_backward_kernel(const bf16* dmean, bf16* dstreams, int64_t count, int64_t H,
                                            int64_t D) {
  wait_for_earlier_kernels();
  const Slices<V> s(count, D);
  for (int64_t i = first_item(); i < s.count; i += item_stride()) {
    const int64_t t = s.token(i), d = s.feature(i);
    float v[V];
    load<V>(dmean + t * D + d, v);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] /= static_cast<float>(H);
    for (int64_t h = 0; h < H; ++h) store<V>(dstreams + (t * H + h) * D + d, v);
  }
}

unsigned blocks_for(int64_t count, int64_t D, int V) { return grid_blocks(count * (D / V), kThreads); }

constexpr size_t kB = sizeof(bf16), kF = sizeof(float);

}  // namespace

void embed_streams(const int32_t* tokens, const bf16* embed, bf16* streams, int64_t tokens_count, int64_t H,
                   int64_t D, cudaStream_t stream) {
  if (tokens_count == 0 || H == 0 || D == 0) return;
  with_width(vector_width({{embed, kB}, {streams, kB}}, D), [&](auto width) {
    constexpr int V = decltype(width)::value;
    launch_kernel(embed_streams_kernel<V>, blocks_for(tokens_count, D, V), kThreads, 0, stream, tokens, embed,
                  streams, tokens_count, H, D);
  });
  SPINDLE_LAUNCHED("embed_streams_kernel");
}

void embed_backward(const int32_t* tokens, const bf16* dstreams, float* dembed, int64_t tokens_count,
                    int64_t H, int64_t D, int32_t skip_id, cudaStream_t stream) {
  if (tokens_count == 0 || H == 0 || D == 0) return;
  with_width(vector_width({{dstreams, kB}, {dembed, kF}}, D), [&](auto width) {
    constexpr int V = decltype(width)::value;
    launch_kernel(embed_backward_kernel<V>, blocks_for(tokens_count, D, V), kThreads, 0, stream, tokens,
                  dstreams, dembed, tokens_count, H, D, skip_id);
  });
  SPINDLE_LAUNCHED("embed_backward_kernel");
}

void stream_mean(const bf16* streams, bf16* mean, int64_t tokens_count, int64_t H, int64_t D,
                 cudaStream_t stream) {
  check(H >= 1, "stream_mean: no streams (H = ", H, ")");
  if (tokens_count == 0 || D == 0) return;
  with_width(vector_width({{streams, kB}, {mean, kB}}, D), [&](auto width) {
    constexpr int V = decltype(width)::value;
    launch_kernel(stream_mean_kernel<V>, blocks_for(tokens_count, D, V), kThreads, 0, stream, streams, mean,
                  tokens_count, H, D);
  });
  SPINDLE_LAUNCHED("stream_mean_kernel");
}

void stream_mean_backward(const bf16* dmean, bf16* dstreams, int64_t tokens_count, int64_t H, int64_t D,
                          cudaStream_t stream) {
  if (tokens_count == 0 || H == 0 || D == 0) return;
  with_width(vector_width({{dmean, kB}, {dstreams, kB}}, D), [&](auto width) {
    constexpr int V = decltype(width)::value;
    launch_kernel(stream_mean_backward_kernel<V>, blocks_for(tokens_count, D, V), kThreads, 0, stream, dmean,
                  dstreams, tokens_count, H, D);
  });
  SPINDLE_LAUNCHED("stream_mean_backward_kernel");
}

}  // namespace spindle::cuda
