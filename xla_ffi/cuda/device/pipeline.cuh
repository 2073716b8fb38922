// The stage pipeline's primitives (sm_80+): cp.async copies, mbarriers and their cp.async arrivals, and a
// position in a ring of stages.
#pragma once

#include <cstdint>

namespace jaxbnn::cuda {

template <int kBytes>
__device__ __forceinline__ void CopyAsync(uint32_t dst, const void* src, bool valid) {
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
  } else if constexpr (kBytes == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
  }
}
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }
// Waits for every cp.async copy of this thread, in a group or not.
__device__ __forceinline__ void CopyAsyncWaitAll() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// mbarriers of the stage pipelines (sm_80 has them and cp.async arrivals; try_wait is sm_90's).
__device__ __forceinline__ void BarrierInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void BarrierWait(uint32_t bar, int parity) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#else
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}
__device__ __forceinline__ void BarrierArrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once all of this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void BarrierArriveOnCopies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// A position in a ring of kStages stages: the stage and the parity of its current fill.
template <int kStages>
struct RingPosition {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void Advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};
// The same where the stage count is a launch's (kernels whose rings take the shared memory their other operands
// leave).
struct LaunchRingPosition {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void Advance(int stages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

}  // namespace jaxbnn::cuda
