// What rate can an mma.sync b1 k loop that reads its fragments from shared memory by ldmatrix reach on
// this GPU (session 26: the mma.sync engine's k loop ran at ~55% of the ceiling probe's BMMA rate with no
// global loads at all)? No global memory in the loop: a CTA per SM cycles over three stages of shared
// memory in the engine's core-matrix layout, in the warp tile shapes and fragment schedules an engine
// could use, with or without a CTA barrier per 1024-bit K block (the cp.async pipeline's barrier). A
// measuring tool: the results are garbage by design, only the times count.
// Build (repository root): nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
//   benchmarks/mma_kloop_probe.cu -o mma_kloop_probe
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "probe_check.cuh"

constexpr int kStages = 3;
constexpr int kRowGroupBytes = 8 * 128;  // 8 rows x one 1024-bit K block: the engine's stages until
                                          // session 31 (its A stages are now 128-byte swizzled rows)

__device__ __forceinline__ uint32_t StageOffset(int row, int chunk) {
  return (row / 8) * kRowGroupBytes + chunk * 128 + (row % 8) * 16;
}

enum Mode : int {
  kSingleBuffer = 0,  // the engine's schedule: all of step ks's fragments, then its mma
  kDoubleBuffer = 1,  // step ks + 1's fragments loaded between step ks's mma rows
  kMmaOnly = 2,       // fragments loaded once: the tensor cores' rate for this tile shape
  kLdmatrixOnly = 3,  // the ldmatrix of the engine's schedule, no mma: shared-memory read rate
};

template <int kWarps, int kWarpCols>
struct Tile {
  static constexpr int kColWarps = kWarps / 2, kRows = 128, kCols = kColWarps * kWarpCols;
  static constexpr int kFrags = kWarpCols / 8;
  static constexpr int kStageBytes = (kRows + kCols) * 128;
  struct Fragments {
    uint32_t a[4][4], b[kFrags][2];
  };
};

template <int kFrags>
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], uint32_t stage, int warp_row, int mf, int ks, int lane) {
  const int row = warp_row + mf * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(stage + StageOffset(row, 2 * ks + lane / 16)));
}

__device__ __forceinline__ void LoadBPair(uint32_t (&b0)[2], uint32_t (&b1)[2], uint32_t stage_b, int warp_col, int np,
                                          int ks, int lane) {
  const int m = lane / 8;
  const int col = warp_col + (2 * np + m / 2) * 8 + lane % 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b0[0]), "=r"(b0[1]), "=r"(b1[0]), "=r"(b1[1])
               : "r"(stage_b + StageOffset(col, 2 * ks + m % 2)));
}

__device__ __forceinline__ void Mma(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int kWarps, int kWarpCols, int kMode, bool kBarrier>
__global__ void __launch_bounds__(32 * kWarps, 1) KLoop(const uint4* source, int* out, int k_blocks) {
  using T = Tile<kWarps, kWarpCols>;
  constexpr int kFrags = T::kFrags;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int i = tid; i < kStages * T::kStageBytes / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = source[i];
  __syncthreads();
  uint32_t base;
  asm("{ .reg .u64 p; cvta.to.shared.u64 p, %1; cvt.u32.u64 %0, p; }" : "=r"(base) : "l"(smem));
  const int warp_row = (warp / T::kColWarps) * 64, warp_col = (warp % T::kColWarps) * kWarpCols;
  int acc[4][kFrags][4] = {};
  typename T::Fragments f[2];
  auto load = [&](typename T::Fragments& g, int kb, int ks) {
    const uint32_t stage = base + (kb % kStages) * T::kStageBytes;
#pragma unroll
    for (int mf = 0; mf < 4; ++mf) LoadA<kFrags>(g.a[mf], stage, warp_row, mf, ks, lane);
#pragma unroll
    for (int np = 0; np < kFrags / 2; ++np) LoadBPair(g.b[2 * np], g.b[2 * np + 1], stage + T::kRows * 128, warp_col, np, ks, lane);
  };
  // Across a barrier a block's first fragments wait for it (the pipeline's stage may not have landed).
  constexpr bool kLoadAfterBarrier = kMode == kDoubleBuffer && kBarrier;
  if (kMode == kMmaOnly || (kMode == kDoubleBuffer && !kBarrier)) load(f[0], 0, 0);
  for (int kb = 0; kb < k_blocks; ++kb) {
    if (kBarrier) __syncthreads();
    if (kLoadAfterBarrier) load(f[0], kb, 0);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if constexpr (kMode == kSingleBuffer || kMode == kLdmatrixOnly) load(f[0], kb, ks);
      if constexpr (kMode == kLdmatrixOnly) {  // keep the loads live without the tensor cores
#pragma unroll
        for (int mf = 0; mf < 4; ++mf) acc[mf][0][0] ^= f[0].a[mf][0] ^ f[0].a[mf][3];
#pragma unroll
        for (int nf = 0; nf < kFrags; ++nf) acc[0][nf][1] ^= f[0].b[nf][0] ^ f[0].b[nf][1];
        continue;
      }
      const int cur = kMode == kDoubleBuffer ? ks % 2 : 0;
      const bool prefetch = kMode == kDoubleBuffer && !(kLoadAfterBarrier && ks == 3);
      const uint32_t next_stage = base + ((ks == 3 ? kb + 1 : kb) % kStages) * T::kStageBytes;
      const uint32_t next_stage_b = next_stage + T::kRows * 128;
      const int next_ks = (ks + 1) % 4;
#pragma unroll
      for (int mf = 0; mf < 4; ++mf) {
        if (prefetch) {  // one A fragment and 1-2 B pairs of step ks + 1 before each row of step ks's mma
          LoadA<kFrags>(f[cur ^ 1].a[mf], next_stage, warp_row, mf, next_ks, lane);
#pragma unroll
          for (int np = mf; np < kFrags / 2; np += 4)
            LoadBPair(f[cur ^ 1].b[2 * np], f[cur ^ 1].b[2 * np + 1], next_stage_b, warp_col, np, next_ks, lane);
        }
#pragma unroll
        for (int nf = 0; nf < kFrags; ++nf) Mma(acc[mf][nf], f[cur].a[mf], f[cur].b[nf]);
      }
    }
  }
  int sum = 0;
#pragma unroll
  for (int mf = 0; mf < 4; ++mf)
#pragma unroll
    for (int nf = 0; nf < kFrags; ++nf) sum += acc[mf][nf][0] + acc[mf][nf][1] + acc[mf][nf][2] + acc[mf][nf][3];
  out[blockIdx.x * blockDim.x + tid] = sum;
}

// Packed accumulators (session 36): 16 warps of 64 x 64 in a 256 x 256 CTA tile at 128 registers. A warp's
// 128 sums fit 64 registers as 16-bit halves: register [mf][q][r] holds fragment (mf, q)'s sum in one half and
// (mf, q + 4)'s in the other. mma.sync adds only into the low half (a sum stays below 2^16 for K < 65536 bits,
// so nothing carries), so each step runs the low half's mma, swaps the halves (one PRMT), then the other's,
// alternating the order from step to step: one swap per register and step, 2 ALU instructions per mma.
// kSwap = false leaves the swaps out (wrong sums, the swaps' cost).
constexpr int kPackedRows = 256, kPackedCols = 256, kPackedStageBytes = (kPackedRows + kPackedCols) * 128;

__device__ __forceinline__ void SwapHalves(int& v) {
  asm volatile("prmt.b32 %0, %0, %0, 0x1032;\n" : "+r"(v));
}

template <int kMode, bool kBarrier, bool kSwap>
__global__ void __launch_bounds__(512, 1) KLoopPacked(const uint4* source, int* out, int k_blocks) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int i = tid; i < kStages * kPackedStageBytes / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = source[i];
  __syncthreads();
  uint32_t base;
  asm("{ .reg .u64 p; cvta.to.shared.u64 p, %1; cvt.u32.u64 %0, p; }" : "=r"(base) : "l"(smem));
  const int warp_row = (warp / 4) * 64, warp_col = (warp % 4) * 64;
  int acc[4][4][4] = {};
  uint32_t a[4][4], b[8][2];
  auto load = [&](int kb, int ks) {
    const uint32_t stage = base + (kb % kStages) * kPackedStageBytes;
#pragma unroll
    for (int mf = 0; mf < 4; ++mf) LoadA<8>(a[mf], stage, warp_row, mf, ks, lane);
#pragma unroll
    for (int np = 0; np < 4; ++np) LoadBPair(b[2 * np], b[2 * np + 1], stage + kPackedRows * 128, warp_col, np, ks, lane);
  };
  if (kMode == kMmaOnly) load(0, 0);
  for (int kb = 0; kb < k_blocks; ++kb) {
    if (kBarrier) __syncthreads();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (kMode != kMmaOnly) load(kb, ks);
      const int first = ks % 2 == 0 ? 0 : 4;
#pragma unroll
      for (int mf = 0; mf < 4; ++mf)
#pragma unroll
        for (int q = 0; q < 4; ++q) Mma(acc[mf][q], a[mf], b[first + q]);
      if (kSwap) {
#pragma unroll
        for (int mf = 0; mf < 4; ++mf)
#pragma unroll
          for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int r = 0; r < 4; ++r) SwapHalves(acc[mf][q][r]);
      }
#pragma unroll
      for (int mf = 0; mf < 4; ++mf)
#pragma unroll
        for (int q = 0; q < 4; ++q) Mma(acc[mf][q], a[mf], b[4 - first + q]);
    }
  }
  int sum = 0;
#pragma unroll
  for (int mf = 0; mf < 4; ++mf)
#pragma unroll
    for (int q = 0; q < 4; ++q) sum += acc[mf][q][0] + acc[mf][q][1] + acc[mf][q][2] + acc[mf][q][3];
  out[blockIdx.x * blockDim.x + tid] = sum;
}

// The best of five timed launches (after a short warm-up) of a k-loop kernel over `k_blocks` K blocks, one
// CTA per SM, in ms.
float BestOfFiveMs(void (*kernel)(const uint4*, int*, int), int threads, int smem, const uint4* source, int* out,
                   int sms, int k_blocks) {
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<sms, threads, smem>>>(source, out, 64);  // warm-up
  CHECK_CUDA(cudaGetLastError());
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  float best_ms = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK_CUDA(cudaEventRecord(start));
    kernel<<<sms, threads, smem>>>(source, out, k_blocks);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (ms < best_ms) best_ms = ms;
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return best_ms;
}

template <int kMode, bool kBarrier, bool kSwap>
void RunPacked(const char* name, const uint4* source, int* out, int sms, double clock_hz) {
  const int k_blocks = 2048;
  const double seconds =
      BestOfFiveMs(KLoopPacked<kMode, kBarrier, kSwap>, 512, kStages * kPackedStageBytes, source, out, sms, k_blocks) * 1e-3;
  const double ops = 2.0 * sms * k_blocks * kPackedRows * kPackedCols * 1024.0;
  const double ldmatrix_bytes = static_cast<double>(sms) * k_blocks * 16 * 4 * 8 * 512;
  printf("%-44s 16 warps of 64 x 64, 256 x 256 tile, packed: %8.1f TOPS", name, ops / seconds / 1e12);
  if (kMode != kMmaOnly) printf("; ldmatrix %6.1f bytes per SM clock", ldmatrix_bytes / seconds / sms / clock_hz);
  printf("\n");
}

template <int kWarps, int kWarpCols, int kMode, bool kBarrier>
void Run(const char* name, const uint4* source, int* out, int sms, double clock_hz) {
  using T = Tile<kWarps, kWarpCols>;
  const int k_blocks = 4096;
  const double seconds = BestOfFiveMs(KLoop<kWarps, kWarpCols, kMode, kBarrier>, 32 * kWarps, kStages * T::kStageBytes,
                                      source, out, sms, k_blocks) * 1e-3;
  const double ops = 2.0 * sms * k_blocks * T::kRows * T::kCols * 1024.0;
  const double ldmatrix_bytes = static_cast<double>(sms) * k_blocks * kWarps * 4 * (4 + T::kFrags / 2) * 512;
  const bool loads = kMode != kMmaOnly;
  printf("%-44s %2d warps of 64 x %2d, %3d x %3d tile: %8.1f TOPS%s", name, kWarps, kWarpCols, T::kRows, T::kCols,
         kMode == kLdmatrixOnly ? 0.0 : ops / seconds / 1e12, loads ? "" : "\n");
  if (loads) printf("; ldmatrix %6.1f bytes per SM clock\n", ldmatrix_bytes / seconds / sms / clock_hz);
}

int main() {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  int clock_khz;
  CHECK_CUDA(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const int sms = prop.multiProcessorCount;
  printf("device %s, %d SMs, %.0f MHz; one CTA per SM, 4096 K blocks of 1024 bits from 3 shared-memory stages\n",
         prop.name, sms, clock_khz / 1e3);
  constexpr int kSourceBytes = kStages * kPackedStageBytes;
  uint8_t* source;
  int* out;
  CHECK_CUDA(cudaMalloc(&source, kSourceBytes));
  CHECK_CUDA(cudaMalloc(&out, sms * 512 * sizeof(int)));
  uint8_t* host = static_cast<uint8_t*>(malloc(kSourceBytes));
  for (int i = 0; i < kSourceBytes; ++i) host[i] = static_cast<uint8_t>(rand());
  CHECK_CUDA(cudaMemcpy(source, host, kSourceBytes, cudaMemcpyHostToDevice));
  free(host);
  const uint4* src = reinterpret_cast<const uint4*>(source);
  const double hz = clock_khz * 1e3;
  Run<16, 32, kMmaOnly, false>("mma only (the tensor cores' rate)", src, out, sms, hz);
  Run<8, 64, kMmaOnly, false>("mma only (the tensor cores' rate)", src, out, sms, hz);
  Run<16, 32, kLdmatrixOnly, true>("ldmatrix only, barrier per K block", src, out, sms, hz);
  Run<8, 64, kLdmatrixOnly, true>("ldmatrix only, barrier per K block", src, out, sms, hz);
  Run<16, 32, kLdmatrixOnly, false>("ldmatrix only, no barrier", src, out, sms, hz);
  Run<16, 32, kSingleBuffer, true>("engine's schedule, barrier (MmaSyncWide)", src, out, sms, hz);
  Run<16, 32, kSingleBuffer, false>("engine's schedule, no barrier", src, out, sms, hz);
  Run<16, 32, kDoubleBuffer, true>("double-buffered, barrier (v52b)", src, out, sms, hz);
  Run<16, 32, kDoubleBuffer, false>("double-buffered, no barrier", src, out, sms, hz);
  Run<8, 64, kSingleBuffer, true>("engine's schedule, barrier", src, out, sms, hz);
  Run<8, 64, kDoubleBuffer, true>("double-buffered, barrier (v52a)", src, out, sms, hz);
  Run<8, 64, kDoubleBuffer, false>("double-buffered, no barrier", src, out, sms, hz);
  Run<8, 32, kSingleBuffer, true>("engine's schedule, barrier (MmaSyncNarrow)", src, out, sms, hz);
  Run<8, 32, kDoubleBuffer, false>("double-buffered, no barrier", src, out, sms, hz);
  RunPacked<kMmaOnly, false, true>("mma only, swaps", src, out, sms, hz);
  RunPacked<kMmaOnly, false, false>("mma only, no swaps", src, out, sms, hz);
  RunPacked<kSingleBuffer, true, true>("engine's schedule, barrier, swaps", src, out, sms, hz);
  RunPacked<kSingleBuffer, true, false>("engine's schedule, barrier, no swaps", src, out, sms, hz);
  RunPacked<kSingleBuffer, false, true>("engine's schedule, no barrier, swaps", src, out, sms, hz);
  CHECK_CUDA(cudaFree(source));
  CHECK_CUDA(cudaFree(out));
  return 0;
}
