// SPINDLE_HOST_DEVICE: a function for both the host and the device where nvcc compiles it, a plain
// host function where the host compiler alone does (the CPU tests of the kernels' arithmetic).
#pragma once

#if defined(__CUDACC__)
#define SPINDLE_HOST_DEVICE __host__ __device__
#else
#define SPINDLE_HOST_DEVICE
#endif
