// The CUDA-core engine (any GPU): AND + POPC over a stage, the baseline of the tensor-core engines.
#pragma once

#include <cstdint>

#include "cuda/device/common.cuh"
#include "cuda/device/loaders.cuh"

namespace jaxbnn::cuda {

struct SimtEngine {
  static constexpr int kRows = 64, kCols = 64, kStages = 3, kThreads = 256;
  static constexpr bool kDirectStore = false;
  static constexpr ALayout kALayout = ALayout::kCoreMatrices;
  struct Accumulators {
    int v[4][4];  // rows ty + 16 i, columns tx + 16 j: conflict-free 16-byte shared loads
    __device__ void Double() {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) v[i][j] *= 2;
    }
  };

  // after_step as in MmaSyncEngine, every step's call ahead of the popcounts: a CUDA-core k loop has no
  // tensor work to issue the copies behind.
  template <class AfterStep>
  __device__ static void Compute(Accumulators& acc, const uint8_t* stage, uint32_t, int tid, AfterStep&& after_step) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) after_step(ks);
    const int ty = tid / 16, tx = tid % 16;
    const uint8_t* sa = stage;
    const uint8_t* sb = stage + kRows * 128;
#pragma unroll 2
    for (int chunk = 0; chunk < 8; ++chunk) {
      uint4 a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = *reinterpret_cast<const uint4*>(sa + StageOffset(ty + 16 * i, chunk));
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = *reinterpret_cast<const uint4*>(sb + StageOffset(tx + 16 * j, chunk));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc.v[i][j] += __popc(a[i].x & b[j].x) + __popc(a[i].y & b[j].y) + __popc(a[i].z & b[j].z) +
                         __popc(a[i].w & b[j].w);
        }
      }
    }
  }

  __device__ static void Store(const Accumulators& acc, int* tile, int ld, int tid) {
    const int ty = tid / 16, tx = tid % 16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) tile[(ty + 16 * i) * ld + tx + 16 * j] = acc.v[i][j];
    }
  }
};

}  // namespace jaxbnn::cuda
