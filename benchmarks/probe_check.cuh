// CHECK_CUDA for the standalone measuring probes of benchmarks/ (kloop_probe.cu, mma_kloop_probe.cu): a
// failed CUDA call prints where and why, and ends the probe.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    cudaError_t e = (x);                                                                 \
    if (e != cudaSuccess) {                                                              \
      printf("CUDA error %s at line %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)
