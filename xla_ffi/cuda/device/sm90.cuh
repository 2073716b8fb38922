// sm_90a primitives: cluster barriers and ranks, TMA tensor and bulk copies (multicast too), wgmma operand
// descriptors.
#pragma once

#include <cstdint>
#include <cuda.h>

#include "cuda/device/wgmma_tile.cuh"

namespace jaxbnn::cuda {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The thread's index, read by a volatile instruction that the compiler cannot hoist out of a loop: what
// is derived from it is then recomputed in the loop instead of being kept live (or spilled) across it.
__device__ __forceinline__ int FreshThreadIndex() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  return tid;
}

// Arrives on the barrier at the same shared-memory offset in every CTA of the cluster. Default (.cta)
// release semantics, as CUTLASS's cluster barriers: .release.cluster costs a GPU-wide memory barrier.
__device__ __forceinline__ void BarrierArriveCluster(uint32_t bar) {
#pragma unroll
  for (uint32_t rank = 0; rank < kWgCluster; ++rank) {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
        "r"(rank)
        : "memory");
  }
}
__device__ __forceinline__ void BarrierArriveExpectBytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One bulk copy of `bytes` contiguous bytes into the same offset of every CTA of the cluster; completes
// its bytes on the barrier at `bar`'s offset in each of them.
__device__ __forceinline__ void BulkCopyMulticast(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  const uint16_t every_cta = (1u << kWgCluster) - 1;
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(every_cta)
      : "memory");
}
// One TMA copy of the weight box (128 bytes = one FSB tile, 8 FSB tiles of K, kWgCols / 8 / kWgCluster row
// tiles) at (FSB tile k, row tile j) of `map`, into the same offset of every CTA of the cluster; tiles past
// K or N arrive as zeros and still count towards the box's bytes.
__device__ __forceinline__ void WeightCopyMulticast(uint32_t dst, const CUtensorMap& map, int k, int j, uint32_t bar) {
  const uint16_t every_cta = (1u << kWgCluster) - 1;
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(0), "r"(k), "r"(j), "r"(bar), "h"(every_cta)
      : "memory");
}
// One TMA copy of the (128 bytes x 128 rows) box at (byte x, row y) of `map`; rows and bytes outside the
// matrix arrive as zeros and still count towards the box's bytes.
__device__ __forceinline__ void TensorCopy(uint32_t dst, const CUtensorMap& map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// One TMA copy of the (16 bytes, w, h, 1) box at (byte, x, y, image) of a 4-D `map` (NHWC bytes).
__device__ __forceinline__ void TensorCopy4d(uint32_t dst, const CUtensorMap& map, int byte, int x, int y, int image,
                                             uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(byte), "r"(x), "r"(y), "r"(image), "r"(bar)
      : "memory");
}
// One TMA copy of the (w, h, 1) box at (x, y, image) of a 3-D `map`.
__device__ __forceinline__ void TensorCopy3d(uint32_t dst, const CUtensorMap& map, int x, int y, int image,
                                             uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(image), "r"(bar)
      : "memory");
}
// Fetches a TMA descriptor (a __grid_constant__ parameter) into the TMA unit's cache ahead of its first
// copy. It depends on no buffer of the problem, so kernels issue it before `griddepcontrol.wait`, under the
// previous kernel's tail.
__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t ClusterId() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t ClusterCount() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
  return r;
}
// No-swizzle K-major descriptor: `along_k` bytes between core matrices along K (LBO), `between_groups`
// bytes between 8-row groups (SBO); the defaults are the kCoreMatrices layout.
__device__ __forceinline__ uint64_t OperandDescriptor(uint32_t addr, uint32_t along_k = 128,
                                                      uint32_t between_groups = 1024) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(along_k >> 4) << 16) |
         (static_cast<uint64_t>(between_groups >> 4) << 32);
}
// Swizzled K-major descriptor: rows of `row_bytes` (128, 64 or 32) with that swizzle (mode 1, 2 or 3 in
// bits 62-63), SBO = 8 rows between 8-row groups (LBO unused); a k256 step advances the start address by 32
// bytes within a row.
__device__ __forceinline__ uint64_t SwizzledOperandDescriptor(uint32_t addr, uint32_t row_bytes = 128) {
  const uint64_t mode = row_bytes == 128 ? 1 : row_bytes == 64 ? 2 : 3;
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(8 * row_bytes >> 4) << 32) |
         (mode << 62);
}

// One bulk copy of `bytes` contiguous bytes into this CTA's shared memory, completing on `bar`.
__device__ __forceinline__ void BulkCopy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace jaxbnn::cuda
