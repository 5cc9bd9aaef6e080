// What the memory-bound kernels share: loads and stores of V consecutive bf16 or fp32 values in
// one aligned access (fp32 in registers), the widest V that the pointers and the row length
// allow, grid sizes for grid-stride loops, and an elementwise map over one or more inputs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "backend/cuda/check.h"
#include "kernels/cuda/launch.cuh"

namespace spindle::cuda {

// V values loaded or stored at once; no access is wider than 16 bytes (8 fp32 take two).
template <class T, int V>
struct alignas(sizeof(T) * V < 16 ? sizeof(T) * V : 16) Packed {
  T v[V];
};

template <class T>
__device__ __forceinline__ float to_float(T value) {
  if constexpr (std::is_same_v<T, float>)
    return value;
  else
    return __bfloat162float(value);
}

template <class T>
__device__ __forceinline__ T from_float(float value) {
  if constexpr (std::is_same_v<T, float>)
    return value;
  else
    return __float2bfloat16(value);
}

// out[0, V) = p[0, V) as fp32; p is aligned to the access (see vector_width).
template <int V, class T>
__device__ __forceinline__ void load(const T* p, float* out) {
  const Packed<T, V> packed = *reinterpret_cast<const Packed<T, V>*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = to_float(packed.v[j]);
}

template <int V, class T>
__device__ __forceinline__ void store(T* p, const float* in) {
  Packed<T, V> packed;
#pragma unroll
  for (int j = 0; j < V; ++j) packed.v[j] = from_float<T>(in[j]);
  *reinterpret_cast<Packed<T, V>*>(p) = packed;
}

// store<V> for global memory, as one vector store instruction written in PTX (V = 1, 2 or 4): where
// the values come from different branches (log1pf's, say), nvcc splits store<V>'s Packed store into
// V scalar stores, each a partly filled warp-wide write. No memory clobber: the caller's later
// loads of other addresses may pass it (the decay's unrolled tokens load ahead of their stores).
template <int V>
__device__ __forceinline__ void store_global(float* p, const float* in) {
  static_assert(V == 1 || V == 2 || V == 4, "one access of at most 16 bytes");
  const size_t global = __cvta_generic_to_global(p);
  if constexpr (V == 4)
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(global), "f"(in[0]), "f"(in[1]),
                 "f"(in[2]), "f"(in[3]));
  else if constexpr (V == 2)
    asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(global), "f"(in[0]), "f"(in[1]));
  else
    *p = in[0];
}

template <int V>
__device__ __forceinline__ void store_global(__nv_bfloat16* p, const float* in) {
  static_assert(V == 1 || V == 2 || V == 4, "one access of at most 8 bytes");
  const auto pair = [](float x, float y) {
    const __nv_bfloat162 two = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&two);
  };
  const size_t global = __cvta_generic_to_global(p);
  if constexpr (V == 4)
    asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(global), "r"(pair(in[0], in[1])),
                 "r"(pair(in[2], in[3])));
  else if constexpr (V == 2)
    asm volatile("st.global.b32 [%0], %1;\n" ::"l"(global), "r"(pair(in[0], in[1])));
  else
    *p = __float2bfloat16(in[0]);
}

// A pointer a kernel reads or writes with vector accesses, and the size of its elements.
struct Access {
  const void* pointer;
  size_t element_bytes;
};

// The widest V in {8, 4, 2, 1} for which every access is aligned, V divides `row` (no vector
// straddles two rows; 0: flat data whose kernel handles the tail) and a row holds at least
// `min_vectors` vectors (a warp on a row of 128 wants 32 vectors of 4, not 16 of 8).
inline int vector_width(std::initializer_list<Access> accesses, int64_t row = 0, int64_t min_vectors = 1) {
  for (int v = 8; v > 1; v /= 2) {
    if (row != 0 && (row % v != 0 || row / v < min_vectors)) continue;
    bool aligned = true;
    for (const Access& a : accesses) {
      const auto bytes = static_cast<uintptr_t>(std::min<size_t>(16, v * a.element_bytes));
      aligned = aligned && reinterpret_cast<uintptr_t>(a.pointer) % bytes == 0;
    }
    if (aligned) return v;
  }
  return 1;
}

// Calls launch(std::integral_constant<int, V>{}) for the runtime width v (8, 4, 2 or 1).
template <class Launch>
void with_width(int v, Launch&& launch) {
  switch (v) {
    case 8:
      launch(std::integral_constant<int, 8>{});
      break;
    case 4:
      launch(std::integral_constant<int, 4>{});
      break;
    case 2:
      launch(std::integral_constant<int, 2>{});
      break;
    default:
      launch(std::integral_constant<int, 1>{});
      break;
  }
}

// Blocks of `threads` that the GPU holds at once: a grid-stride kernel needs no more, and a
// reduction that adds one partial sum per block into global memory keeps its atomics few.
inline int64_t resident_blocks(int threads) {
  int device = 0, sms = 0, per_sm = 0;
  SPINDLE_CUDA(cudaGetDevice(&device));
  SPINDLE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  SPINDLE_CUDA(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  return static_cast<int64_t>(sms) * std::max(1, per_sm / threads);
}

// Blocks of `kernel`, `threads` each with `shared` bytes of dynamic shared memory, that the GPU
// holds at once as the kernel's registers and shared memory allow: a grid-stride kernel that adds
// per-block sums into global memory by atomics wants no more blocks than run at once. Computed once
// per kernel, block size and shared memory.
inline int64_t resident_blocks_of(const void* kernel, int threads, size_t shared) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t>, int64_t> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, threads, shared);
  if (const auto found = known.find(key); found != known.end()) return found->second;
  int device = 0, sms = 0, per_sm = 0;
  SPINDLE_CUDA(cudaGetDevice(&device));
  SPINDLE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  SPINDLE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared));
  const int64_t blocks = static_cast<int64_t>(sms) * std::max(1, per_sm);
  known.emplace(key, blocks);
  return blocks;
}
template <class Kernel>
int64_t resident_blocks_of(Kernel kernel, int threads, size_t shared = 0) {
  return resident_blocks_of(reinterpret_cast<const void*>(kernel), threads, shared);
}

// Grid of a grid-stride loop over `items` work items, one per thread.
inline unsigned grid_blocks(int64_t items, int threads) {
  return static_cast<unsigned>(
      std::max<int64_t>(1, std::min((items + threads - 1) / threads, resident_blocks(threads))));
}

constexpr int kMapThreads = 256;

template <class Op, int N, int V, size_t... k>
__device__ __forceinline__ float apply(const Op& op, const float (&args)[N][V], int j,
                                       std::index_sequence<k...>) {
  return op(args[k][j]...);
}

// out[i] = op(in[i]...): n / V vectors, then the tail of n % V elements one by one.
template <int V, class Op, class Out, class... In>
__global__ void map_kernel(Op op, Out* out, int64_t n, const In*... in) {
  wait_for_earlier_kernels();
  constexpr int N = sizeof...(In);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < n / V; i += stride) {
    float args[N][V], result[V];
    int k = 0;
    (load<V>(in + i * V, args[k++]), ...);
#pragma unroll
    for (int j = 0; j < V; ++j) result[j] = apply(op, args, j, std::make_index_sequence<N>{});
    store<V>(out + i * V, result);
  }
  for (int64_t i = n / V * V + first; i < n; i += stride) {
    const float args[N][1] = {{to_float(in[i])}...};
    out[i] = from_float<Out>(apply(op, args, 0, std::make_index_sequence<N>{}));
  }
}

// Launches map_kernel with the widest vectors the pointers allow.
template <class Op, class Out, class... In>
void launch_map(const char* name, const Op& op, Out* out, int64_t n, cudaStream_t stream, const In*... in) {
  if (n == 0) return;
  with_width(vector_width({Access{out, sizeof(Out)}, Access{in, sizeof(In)}...}), [&](auto width) {
    constexpr int V = decltype(width)::value;
    launch_kernel(map_kernel<V, Op, Out, In...>, grid_blocks(n / V + 1, kMapThreads), kMapThreads, 0, stream,
                  op, out, n, in...);
  });
  SPINDLE_LAUNCHED(name);
}

}  // namespace spindle::cuda
