// Warp-level tensor-core building blocks shared by the kernels that use them: cp.async copies into
// shared memory, ldmatrix loads, the bf16 mma.sync m16n8k16 and the TF32 m16n8k8 (fp32 accumulate).
//
// Fragment layout of mma.sync.m16n8k16 (g = lane / 4, c = lane % 4): A (16 x 16, row-major)
// a0 = (g, 2c..2c+1), a1 = (g+8, 2c..), a2 = (g, 2c+8..), a3 = (g+8, 2c+8..); B (16 x 8, "col")
// b0 = (k 2c..2c+1, n g), b1 = (k 2c+8.., n g); C (16 x 8) c0, c1 = (g, 2c..2c+1), c2, c3 = (g+8, ..).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/tf32_split.h"

namespace spindle::cuda {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, or 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// 4 bytes global -> shared, or 4 zero bytes when !valid: for rows that are not 16-byte aligned.
__device__ __forceinline__ void copy4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most one committed group (the newest) is still in flight.
__device__ __forceinline__ void copy_wait_all_but_newest() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

__device__ __forceinline__ void copy_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Shared memory written by the threads (or cp.async) that the async proxy (wgmma, the TMA) reads
// next: each writer fences, then a barrier.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Waits until at most N committed groups (the newest N) are still in flight: a ring of N + 2 stages.
template <int N>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8 x 8 bf16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// Two 8 x 8 bf16 matrices; lanes 0-15 give the row addresses (the others are ignored).
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(address));
}

// The same, each matrix transposed: a [k][n] tile in shared memory becomes B fragments.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as one bf16x2 register (lo in the low half).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// An fp32 value as bf16 hi + lo, f = hi + lo to about 2^-17 relative (lo rounds what hi left):
// bf16 x (hi + lo) on the tensor cores keeps an fp32 operand's accuracy at twice the bf16 MMAs.
struct Bf16Split {
  __nv_bfloat16 hi, lo;
};
__device__ __forceinline__ Bf16Split split_bf16(float f) {
  const __nv_bfloat16 hi = __float2bfloat16_rn(f);
  return {hi, __float2bfloat16_rn(f - __bfloat162float(hi))};
}

// TF32 for fp32 data: mma.sync.m16n8k8 with tf32 operands (10 mantissa bits, split or truncated
// by tf32_split.h) and fp32 accumulation. Fragment layout (g = lane / 4, c = lane % 4):
// A (16 x 8, row-major) a0 = (g, c), a1 = (g+8, c), a2 = (g, c+4), a3 = (g+8, c+4); B (8 x 8, "col")
// b0 = (k c, n g), b1 = (k c+4, n g); C as for m16n8k16.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// N fp32 values of a TF32 operand fragment: when kSplit, x = hi + lo (tf32_split: the 3xTF32
// product hi*hi + hi*lo + lo*hi keeps x y to about 2^-19, fp32-level accuracy for three mma instead
// of one); otherwise hi alone, x truncated to TF32 (2^-10).
template <int N, bool kSplit>
struct Tf32Frag {
  uint32_t hi[N];
  uint32_t lo[kSplit ? N : 1];
  __device__ __forceinline__ void set(int e, float x) {
    if constexpr (kSplit) {
      tf32_split(x, hi[e], lo[e]);
    } else {
      hi[e] = tf32_truncated_bits(x);
    }
  }
};

// d += a b, m16n8k8: hi*hi, plus lo*hi and hi*lo where a and b are split (three mma with both, one
// with neither). An operand of bf16 values (exact in TF32) needs no split: its lo would be zero, so
// leaving it unsplit drops only a product of zeros, and 3xTF32's accuracy takes two mma. (Not bit
// for bit: measured, the tensor cores' sum moves the accumulator's last bits even for zero products.)
template <bool kSplitA, bool kSplitB>
__device__ __forceinline__ void mma_tf32(float (&d)[4], const Tf32Frag<4, kSplitA>& a,
                                         const Tf32Frag<2, kSplitB>& b) {
  if constexpr (kSplitA) mma_tf32(d, a.lo, b.hi[0], b.hi[1]);
  if constexpr (kSplitB) mma_tf32(d, a.hi, b.lo[0], b.lo[1]);
  mma_tf32(d, a.hi, b.hi[0], b.hi[1]);
}

}  // namespace spindle::cuda
