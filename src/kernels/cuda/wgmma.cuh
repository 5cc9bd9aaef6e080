// Hopper's warpgroup matrix multiply (wgmma, sm_90a) with its operands in shared memory (A also from
// registers), for the kernels that use it: the operand layout, its descriptor, and the fence /
// commit / wait steps.
//
// Operands use the no-swizzle "core matrix" layout: a core matrix is 8 rows of 16 bytes (8 bf16)
// stored as 128 contiguous bytes. For a [rows][cols] bf16 matrix with cols a multiple of 8,
// core_offset() lays the core matrices of one 8-row group side by side along the columns, and the
// groups one after another: element (r, c) at (r / 8) * cols * 16 + (c / 8) * 128 + (r % 8) * 16 +
// (c % 8) * 2. So 16-byte unit u of an 8-row group at byte 16 u, a copy of contiguous units fills it
// contiguously. In a descriptor, the leading byte offset is the distance between core matrices
// adjacent along K, the stride byte offset between those adjacent along M (or N); that holds for
// operands stored K-major and, with the transpose bit, MN-major.
//
// Accumulators of m64nNk16 (fp32, N / 2 per thread): warp w of the warpgroup holds rows 16 w + l / 4
// and 16 w + l / 4 + 8 (l the lane), d[4 j + 2 h + e] = (row 16 w + l / 4 + 8 h, column 8 j + 2 (l % 4)
// + e): mma.sync's m16n8 layout once per n8 block.
#pragma once

#include <cstdint>

#include "kernels/cuda/mma.cuh"  // fence_async_shared
#include "kernels/cuda/wgmma_descriptor.h"

// wgmma exists only in sm_90a code; the build's portable compute_90 PTX gets a trap instead (the
// H200 runs the sm_90a machine code).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPINDLE_WGMMA(...) asm volatile(__VA_ARGS__)
#else
#define SPINDLE_WGMMA(...) __trap()
#endif

namespace spindle::cuda {

__device__ __forceinline__ uint32_t core_offset(int row, int col, int cols) {
  return static_cast<uint32_t>((row / 8) * cols * 16 + (col / 8) * 128 + (row % 8) * 16 + (col % 8) * 2);
}

// Before the first wgmma that reads or writes accumulators the threads last touched.
__device__ __forceinline__ void wgmma_fence() { SPINDLE_WGMMA("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  SPINDLE_WGMMA("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  SPINDLE_WGMMA("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}

// A barrier of warpgroup `group`'s 128 threads alone (barrier 0 is __syncthreads').
__device__ __forceinline__ void warpgroup_barrier(int group) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(group + 1) : "memory");
}

// Keeps the compiler from moving accesses to an accumulator across the asynchronous wgmma.
__device__ __forceinline__ void wgmma_hold(float& r) { asm volatile("" : "+f"(r)::"memory"); }
template <int N>
__device__ __forceinline__ void wgmma_hold(float (&r)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) wgmma_hold(r[j]);
}
template <int M, int N>
__device__ __forceinline__ void wgmma_hold(float (&r)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i) wgmma_hold(r[i]);
}

// d (+)= A [64 x 16] B [16 x 32], bf16 in, fp32 accumulate; `accumulate` false overwrites d.
// TransA: A stored MN-major (its 64 rows contiguous within each 8-column piece) instead of K-major.
template <int TransA>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], uint64_t a, uint64_t b, bool accumulate) {
  SPINDLE_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(TransA));
}

// The output operands of an m64n64k16 accumulator, d[0 .. 31], for the asm statements below.
#define SPINDLE_WGMMA_ACCUMULATORS_32(d)                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),           \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),            \
      "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),            \
      "+f"(d[30]), "+f"(d[31])

// d (+)= A [64 x 16] B [16 x 64], bf16 in, fp32 accumulate; `accumulate` false overwrites d.
// TransA, TransB: that operand stored MN-major instead of K-major.
template <int TransA = 0, int TransB = 0>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
  SPINDLE_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n"
      "}\n"
      : SPINDLE_WGMMA_ACCUMULATORS_32(d)
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(TransA), "n"(TransB));
}

// d (+)= A [64 x 16] B [16 x 64] with A in registers (the m16n8k16 A fragment of each warp's 16 rows:
// a[0] row l / 4, columns 2 (l % 4) and + 1; a[1] the same 8 rows down; a[2], a[3] the same 8
// columns on), B from shared memory; TransB: B stored MN-major. wgmma reads a asynchronously: its
// registers must hold their values until the wgmma_wait that covers it (wgmma_hold_fragment).
template <int TransB = 0>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                                   bool accumulate) {
  SPINDLE_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n"
      "}\n"
      : SPINDLE_WGMMA_ACCUMULATORS_32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)), "n"(TransB));
}

// Keeps a register operand of an asynchronous wgmma unchanged (and its registers unreused) until here.
template <int M, int N>
__device__ __forceinline__ void wgmma_hold_fragment(uint32_t (&r)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i) {
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
  }
}

// d (+)= A [64 x 16] B [16 x 128], bf16 in, fp32 accumulate; `accumulate` false overwrites d.
// TransA, TransB: that operand stored MN-major instead of K-major.
template <int TransA = 0, int TransB = 0>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t a, uint64_t b, bool accumulate) {
  SPINDLE_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "
      "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "
      "%62, %63}, "
      "%64, %65, p, 1, 1, %67, %68;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(TransA), "n"(TransB));
}

}  // namespace spindle::cuda
