// Hopper's bulk tensor copies (TMA) and the shared-memory barriers (mbarrier) they complete on:
// one thread arms a barrier with the bytes to expect and issues the copies; the threads that read
// the data wait on the barrier's phase. The tensor map comes from kernels/cuda/tensor_map.h.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/cuda/mma.cuh"

namespace spindle::cuda {

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(arrivals)
               : "memory");
}

// After mbarrier_init and before a barrier that publishes it: the copies (the async proxy) see it.
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// The calling thread's arrival, with `bytes` more for the phase to wait for.
__device__ __forceinline__ void mbarrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
}

// The calling thread's arrival, nothing more to expect.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(bar)) : "memory");
}

// An arrival on bar once the calling thread's cp.async copies issued so far have landed, counted
// among the arrivals the barrier was initialised with (.noinc): the copies' readers wait on bar
// instead of each copier waiting for its own.
__device__ __forceinline__ void copy_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(shared_address(bar))
               : "memory");
}

// Waits until the barrier's phase `parity` (0, 1, 0, ...: one per use) has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}

// The box at (column x, row y) of the tensor map into dst (aligned as the map's swizzle needs:
// 1024 bytes for 128-byte swizzle), its bytes counted on bar.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(shared_address(bar))
      : "memory");
}

// dst[0 .. bytes / 4) += src[0 .. bytes / 4) (fp32, global += shared) by the TMA engine, in the
// calling thread's current bulk group: 16-byte aligned addresses, bytes a multiple of 16. The
// writers of src fence (fence_async_shared) and meet the issuing thread at a barrier first.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(shared_address(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until the calling thread's bulk groups but the newest N have read their shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Until all of the calling thread's bulk groups have completed.
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

}  // namespace spindle::cuda
