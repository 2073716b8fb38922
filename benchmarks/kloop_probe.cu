// What holds one warpgroup's k loop below the tensor cores' rate (session 11: the resident kernel's k loop
// runs at ~60% of the ceiling probe's rate even with the other warpgroup idle). This rebuilds that k loop
// from the probe's loop one piece at a time: operands that move (A through a ring of stages, B through
// the resident weights as ResidentWgmmaKernel lays them), the wait depth, the row popcounts, a producer
// warp with full/empty barriers, the threshold epilogue, a second consumer warpgroup. A measuring tool:
// the results are garbage by design, only the times count.
// Build (repository root): nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Ixla_ffi \
//   benchmarks/kloop_probe.cu -o kloop_probe
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "cuda/wgmma_b1.cuh"
#include "probe_check.cuh"

constexpr int kStageBytes = 64 * 128;         // 64 rows x one K block of 1024 bits
constexpr int kRingStages = 6;                // consumers x stages at most
constexpr int kK = 4608;                      // a 3x3 C = 512 convolution
constexpr int kBlocksPerTile = 5;             // K blocks of 1024 bits per tile, as the kernel runs K = 4608
constexpr int kWeightBytes = 256 * kK / 8;    // one 256-column tile's weights
constexpr int kWeightSlack = 1024;            // the last K block's k256 steps read past the weights
constexpr int kSourceStages = 256;            // the producer cycles over 2 MB of global memory (L2-resident)
constexpr int kThreads = 384;                 // a producer warpgroup and two consumer warpgroups

// Where the row popcounts (popc(a) of the AND-popc correction) are computed.
enum PopcMode : int {
  kNoPopcounts = 0,
  kConsumerLoads = 1,  // the consumer warpgroup loads each stage after issuing its wgmmas (the kernel's way)
  kHelperWarp = 2,     // a warp of the producer warpgroup loads each stage, and releases it too
  kOnesWgmma = 3,      // one m64n8k256 wgmma per k256 step against an all-ones B: popc(a) in the accumulators
  kDeferredLoads = 4,  // the consumer loads each stage after issuing its wgmmas and counts it one batch later
};

// What the tile's epilogue does.
enum EpilogueMode : int {
  kNoEpilogue = 0,
  kOneBoundsRow = 1,    // both rows of a thread compare with one bounds row (no border classes)
  kClassBoundsRows = 2, // each row with its own bounds row (StoreBitsRows<true, 8>: a border class per row)
  kHalfEpilogue = 3,    // kOneBoundsRow over half the columns: what an epilogue of half the cost would buy
};

struct Variant {
  const char* name;
  int consumers;   // consumer warpgroups that run the k loop (1 or 2)
  int wait;        // wgmma.wait_group depth after each K block's batch (0 or 1)
  bool move_a;     // A from the ring's stages in turn (else always the first stage)
  bool swizzle_a;  // A as 128-byte swizzled rows (TMA's kSwizzledRows), else core matrices
  int b_mode;      // 0: one fixed 8 KB B; 1: the resident FSB rows (SBO = K bytes); 2: laid out per K block
  int popc;        // PopcMode
  bool pipeline;   // a producer warp refills the stages; full / empty barriers
  bool copies;     // the producer's refills are bulk copies of 8 KB (else it only arrives on the barrier)
  int epilogue;    // EpilogueMode
  bool stagger;    // warpgroup 1 starts after warpgroup 0's first k loop (ResidentWgmmaKernel's schedule)
  bool early;      // wait for the next stage's data before waiting for the tensor cores, not after
  int stages;      // ring stages per consumer warpgroup
};

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint64_t Descriptor(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}
__device__ __forceinline__ void BarrierWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT;\n}\n" ::"r"(
          bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void BarrierArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

template <int kWait>
__device__ __forceinline__ void WaitGroup() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kWait) : "memory");
}

// d += popc(A AND B) for a 64 x 8 tile; with B all ones, d holds popc(A's row) in all 8 columns.
__device__ __forceinline__ void wgmma_m64n8k256_and_popc(int (&d)[4], uint64_t desc_a, uint64_t desc_b,
                                                         int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k256.s32.b1.b1.and.popc {%0, %1, %2, %3}, %4, %5, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The threshold epilogue's work (StoreBitsRows): compare 4 acc + v0 with a bound per column, pack the bits
// over the quad, one 32-bit word per 32 columns and row.
template <bool kClassBounds, int kWords = 8>
__device__ __forceinline__ void ThresholdEpilogue(const int (&acc)[128], const int* bounds, uint32_t* out, int v0,
                                                  int wtid) {
  const int t = wtid % 4;
  uint32_t words[2][kWords] = {};
#pragma unroll
  for (int j = 0; j < 4 * kWords; ++j) {
    const uint32_t bit0 = 1u << (8 * (j % 4));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int2 bound = *reinterpret_cast<const int2*>(&bounds[(kClassBounds ? 256 * h : 0) + 8 * j + 2 * t]);
      const int x0 = 4 * acc[4 * j + 2 * h] + v0, x1 = 4 * acc[4 * j + 2 * h + 1] + v0;
      words[h][j / 4] |= (x0 >= bound.x ? bit0 : 0u) | (x1 >= bound.y ? bit0 << 1 : 0u);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int wd = 0; wd < kWords; ++wd) {
      uint32_t v = words[h][wd] << (2 * t);
      v |= __shfl_xor_sync(0xffffffffu, v, 1);
      v |= __shfl_xor_sync(0xffffffffu, v, 2);
      if (t == (wd & 3)) out[(h * 8 + wd) * 128 + wtid] = v;
    }
  }
}

// smem: [rings: consumers x stages][weights][bounds: 2 rows of 256 ints][barriers: full, empty per stage][256 bytes of ones]
constexpr int kRingBytes = kRingStages * kStageBytes;
constexpr int kBoundsOffset = kRingBytes + kWeightBytes + kWeightSlack;
constexpr int kBarrierOffset = kBoundsOffset + 2048;
constexpr int kOnesOffset = kBarrierOffset + 256;
constexpr int kSmemBytes = 1024 + kOnesOffset + 256;

template <int kWait, int kPopc, bool kPipeline, int kEpilogue>
__global__ void __launch_bounds__(kThreads, 1)
    KLoop(Variant v, int tiles, const uint8_t* source, uint32_t* out, int* sink) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - SmemAddress(smem_raw) % 1024) % 1024;
  const uint32_t base = SmemAddress(smem), weights = base + kRingBytes, ones = base + kOnesOffset;
  const int* bounds = reinterpret_cast<const int*>(smem + kBoundsOffset);
  const uint32_t full0 = base + kBarrierOffset, empty0 = full0 + kRingStages * 8;
  const int tid = threadIdx.x;
  for (int i = tid; i < kBarrierOffset / 4; i += kThreads) {
    reinterpret_cast<uint32_t*>(smem)[i] = (i + 1) * 2654435761u ^ blockIdx.x;
  }
  for (int i = tid; i < 64; i += kThreads) reinterpret_cast<uint32_t*>(smem + kOnesOffset)[i] = ~0u;
  if (tid == 0) {
    for (int i = 0; i < kRingStages; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(full0 + 8 * i));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(empty0 + 8 * i),
                   "r"(kPopc == kHelperWarp ? 5 : 4));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int warp = tid / 32, lane = tid % 32;
  if (tid < 128) {  // warps 0 and 1 feed consumer warpgroups 0 and 1; warps 2 and 3 are their popcount helpers
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");  // registers as ResidentWgmmaKernel splits them
    const int half = warp % 2;
    if (!kPipeline || half >= v.consumers) return;
    if (warp >= 2 && kPopc != kHelperWarp) return;
    if (warp < 2 && lane != 0) return;
    int stage = 0, popc_sum = 0;
    uint32_t phase = 0;
    bool first_round = true;
    for (int i = 0; i < tiles * kBlocksPerTile; ++i) {
      const uint32_t full = full0 + 8 * (half * v.stages + stage), empty = empty0 + 8 * (half * v.stages + stage);
      if (warp >= 2) {  // the helper: the stage's row popcounts, then its release
        BarrierWait(full, phase);
        const uint8_t* s = smem + (half * v.stages + stage) * kStageBytes;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const uint4 x = *reinterpret_cast<const uint4*>(s + (j * 32 + lane) * 16);
          popc_sum += __popc(x.x) + __popc(x.y) + __popc(x.z) + __popc(x.w);
        }
        __syncwarp();
        if (lane == 0) BarrierArrive(empty);
      } else {
        if (!first_round) BarrierWait(empty, phase ^ 1);
        if (v.copies) {
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(full), "r"(kStageBytes)
                       : "memory");
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                  base + (half * v.stages + stage) * kStageBytes),
              "l"(source + static_cast<size_t>((blockIdx.x * 7 + i) % kSourceStages) * kStageBytes), "r"(kStageBytes),
              "r"(full)
              : "memory");
        } else {
          BarrierArrive(full);
        }
      }
      if (++stage == v.stages) {
        stage = 0;
        phase ^= 1;
        first_round = false;
      }
    }
    if (popc_sum == 0x7fffffff) sink[0] = popc_sum;
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int ctid = tid - 128, half = ctid / 128, wtid = ctid % 128;
  if (half >= v.consumers) return;
  const bool stagger = v.stagger && v.consumers == 2;
  if (stagger && half == 1) asm volatile("bar.sync 1, 256;\n" ::: "memory");
  const uint32_t ring = base + half * v.stages * kStageBytes;
  // descriptor fields other than the start address: A as 128-byte swizzled rows (a k256 step 32 bytes
  // along the row) or core matrices (LBO 128, SBO 1024: a k256 step is two core matrices); B as one fixed
  // 8 KB block (SBO 256), the resident FSB rows (SBO = K bytes) or per K block (SBO 1024; 4 K blocks fit,
  // the fifth reads the first's)
  const uint64_t a_fields = v.swizzle_a ? Descriptor(0, 16, 1024) | 1ull << 62 : Descriptor(0, 128, 1024);
  const uint32_t a_step = !v.move_a ? 0 : v.swizzle_a ? 32 : 256;  // fixed: the same 2 KB every time
  const uint64_t b_fields = Descriptor(0, 128, v.b_mode == 0 ? 256 : v.b_mode == 1 ? kK / 8 : 1024);
  const uint32_t b_block_step = v.b_mode == 0 ? 0 : v.b_mode == 1 ? 1024 : 32 * 1024;
  const uint32_t b_step = v.b_mode == 0 ? 0 : 256;
  const uint64_t desc_ones = Descriptor(ones, 128, 256);
  int acc[128], row_popc[4];
  uint4 pending[4] = {};  // kDeferredLoads: the previous stage's words, counted after the next batch is issued
  int popc_sum = 0, stage = 0, previous = 0;
  uint32_t phase = 0;
  for (int tile = 0; tile < tiles; ++tile) {
    for (int kb = 0; kb < kBlocksPerTile; ++kb) {
      const uint32_t full = full0 + 8 * (half * v.stages + stage);
      if (kPipeline && (kb == 0 || !v.early)) BarrierWait(full, phase);
      const uint32_t a = v.move_a ? ring + stage * kStageBytes : ring;
      // branch-free descriptors: a branch between two wgmmas makes ptxas serialize them
      uint64_t desc_a[4], desc_b[4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        desc_a[ks] = Descriptor(a + ks * a_step, 0, 0) | a_fields;
        desc_b[ks] = Descriptor(weights + (v.b_mode == 2 ? kb % 4 : kb) * b_block_step + ks * b_step, 0, 0) | b_fields;
      }
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        wgmma_m64n256k256_and_popc(acc, desc_a[ks], desc_b[ks], (kb | ks) != 0);
        if constexpr (kPopc == kOnesWgmma) wgmma_m64n8k256_and_popc(row_popc, desc_a[ks], desc_ones, (kb | ks) != 0);
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      if constexpr (kPopc == kConsumerLoads || kPopc == kDeferredLoads) {
        const uint8_t* s = smem + (a - base);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if constexpr (kPopc == kDeferredLoads) {
            popc_sum += __popc(pending[i].x) + __popc(pending[i].y) + __popc(pending[i].z) + __popc(pending[i].w);
          }
          const uint4 x = *reinterpret_cast<const uint4*>(s + (i * 128 + wtid) * 16);
          if constexpr (kPopc == kDeferredLoads) {
            pending[i] = x;
          } else {
            popc_sum += __popc(x.x) + __popc(x.y) + __popc(x.z) + __popc(x.w);
          }
        }
      }
      if (kPipeline && v.early && kb + 1 < kBlocksPerTile) {
        const int next = stage + 1 == v.stages ? 0 : stage + 1;
        BarrierWait(full0 + 8 * (half * v.stages + next), next == 0 ? phase ^ 1 : phase);
      }
      WaitGroup<kWait>();
      if constexpr (kPipeline) {
        const int released = kWait == 0 ? stage : previous;
        if ((kWait == 0 || kb > 0) && lane == 0) BarrierArrive(empty0 + 8 * (half * v.stages + released));
      }
      previous = stage;
      if (++stage == v.stages) {
        stage = 0;
        phase ^= 1;
      }
    }
    WaitGroup<0>();
    if constexpr (kPopc == kDeferredLoads) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        popc_sum += __popc(pending[i].x) + __popc(pending[i].y) + __popc(pending[i].z) + __popc(pending[i].w);
        pending[i] = make_uint4(0, 0, 0, 0);
      }
    }
    if (kPipeline && kWait > 0 && lane == 0) BarrierArrive(empty0 + 8 * (half * v.stages + previous));
    if (stagger && half == 0 && tile == 0) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
    if constexpr (kPopc == kOnesWgmma) popc_sum += row_popc[0] + row_popc[2];
    if constexpr (kEpilogue != kNoEpilogue) {
      ThresholdEpilogue<kEpilogue == kClassBoundsRows, kEpilogue == kHalfEpilogue ? 4 : 8>(acc, bounds, out + (blockIdx.x * 2 + half) * 16 * 128, popc_sum, wtid);
    }
  }
  int s = popc_sum;
#pragma unroll
  for (int i = 0; i < 128; ++i) s += acc[i];
  if (s == 0x7fffffff) sink[0] = s;
#endif
}

using KernelFn = void (*)(Variant, int, const uint8_t*, uint32_t*, int*);

// every (wait, popcount mode, pipeline, epilogue) instantiation, indexed by KernelIndex
template <size_t... I>
constexpr std::array<KernelFn, sizeof...(I)> KernelTable(std::index_sequence<I...>) {
  return {KLoop<I / 40, I / 8 % 5, I / 4 % 2 == 1, I % 4>...};
}
int KernelIndex(const Variant& v) { return v.wait * 40 + v.popc * 8 + v.pipeline * 4 + v.epilogue; }

// argv[1], if given: run only the variants whose names contain it
int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  printf("device %s, %d SMs; k loop of m64n256k256 b1 wgmmas, %d per tile (K = %d), one CTA per SM\n", prop.name,
         sms, 4 * kBlocksPerTile, kK);
  uint8_t* source;
  uint32_t* out;
  int* sink;
  CHECK_CUDA(cudaMalloc(&source, static_cast<size_t>(kSourceStages) * kStageBytes));
  CHECK_CUDA(cudaMalloc(&out, static_cast<size_t>(sms) * 2 * 16 * 128 * 4));
  CHECK_CUDA(cudaMalloc(&sink, 4));
  CHECK_CUDA(cudaMemset(source, 0x5a, static_cast<size_t>(kSourceStages) * kStageBytes));
  constexpr int N = kNoPopcounts, L = kConsumerLoads, H = kHelperWarp, W = kOnesWgmma, D = kDeferredLoads;
  constexpr int E0 = kNoEpilogue, E1 = kOneBoundsRow, E2 = kClassBoundsRows, E3 = kHalfEpilogue;
  const Variant variants[] = {
      // name                                     wg wait moveA swzA B popc  pipe copies epi stagger early stages
      {"probe: fixed A and B, wait 0", 1, 0, false, false, 0, N, false, true, E0, false, false, 3},
      {"fixed A and B, wait 1", 1, 1, false, false, 0, N, false, true, E0, false, false, 3},
      {"B: resident FSB rows (SBO = K bytes)", 1, 1, false, false, 1, N, false, true, E0, false, false, 3},
      {"B: per K block (SBO 1024)", 1, 1, false, false, 2, N, false, true, E0, false, false, 3},
      {"A: 3 stages, core matrices; B fixed", 1, 1, true, false, 0, N, false, true, E0, false, false, 3},
      {"A: 3 stages, swizzled; B fixed", 1, 1, true, true, 0, N, false, true, E0, false, false, 3},
      {"A swizzled, B FSB rows", 1, 1, true, true, 1, N, false, true, E0, false, false, 3},
      {"  + row popcounts", 1, 1, true, true, 1, L, false, true, E0, false, false, 3},
      {"  + row popcounts, deferred", 1, 1, true, true, 1, D, false, true, E0, false, false, 3},
      {"  + producer, copies (no popcounts)", 1, 1, true, true, 1, N, true, true, E0, false, false, 3},
      {"  + producer, no copies (no popcounts)", 1, 1, true, true, 1, N, true, false, E0, false, false, 3},
      {"  + popcounts, producer without copies", 1, 1, true, true, 1, L, true, false, E0, false, false, 3},
      {"the kernel's k loop (popcounts, copies)", 1, 1, true, true, 1, L, true, true, E0, false, false, 3},
      {"  with wait 0", 1, 0, true, true, 1, L, true, true, E0, false, false, 3},
      {"  with 6 stages", 1, 1, true, true, 1, L, true, true, E0, false, false, 6},
      {"  popcounts by a helper warp", 1, 1, true, true, 1, H, true, true, E0, false, false, 3},
      {"  popcounts by m64n8 wgmmas on ones", 1, 1, true, true, 1, W, true, true, E0, false, false, 3},
      {"  popcounts deferred", 1, 1, true, true, 1, D, true, true, E0, false, false, 3},
      {"  + epilogue", 1, 1, true, true, 1, L, true, true, E1, false, false, 3},
      {"  + epilogue, class bounds", 1, 1, true, true, 1, L, true, true, E2, false, false, 3},
      {"  + epilogue, m64n8 on ones", 1, 1, true, true, 1, W, true, true, E1, false, false, 3},
      {"  + epilogue, deferred", 1, 1, true, true, 1, D, true, true, E1, false, false, 3},
      {"  popcounts deferred, early wait", 1, 1, true, true, 1, D, true, true, E0, false, true, 3},
      {"  m64n8 on ones, early wait", 1, 1, true, true, 1, W, true, true, E0, false, true, 3},
      {"  + epilogue, deferred, early wait", 1, 1, true, true, 1, D, true, true, E1, false, true, 3},
      {"2 WGs: probe (fixed A and B, wait 0)", 2, 0, false, false, 0, N, false, true, E0, false, false, 3},
      {"2 WGs: the k loop", 2, 1, true, true, 1, L, true, true, E0, false, false, 3},
      {"2 WGs: the k loop, deferred", 2, 1, true, true, 1, D, true, true, E0, false, false, 3},
      {"2 WGs: the k loop, m64n8 on ones", 2, 1, true, true, 1, W, true, true, E0, false, false, 3},
      {"2 WGs: + epilogue", 2, 1, true, true, 1, L, true, true, E1, false, false, 3},
      {"2 WGs: + epilogue, staggered", 2, 1, true, true, 1, L, true, true, E1, true, false, 3},
      {"2 WGs: + epilogue, staggered, deferred", 2, 1, true, true, 1, D, true, true, E1, true, false, 3},
      {"2 WGs: + epilogue, deferred", 2, 1, true, true, 1, D, true, true, E1, false, false, 3},
      {"2 WGs: + class-bounds epilogue, staggered", 2, 1, true, true, 1, L, true, true, E2, true, false, 3},
      {"2 WGs: + class-bounds epilogue, stag., deferred", 2, 1, true, true, 1, D, true, true, E2, true, false, 3},
      {"2 WGs: the k loop, deferred, early wait", 2, 1, true, true, 1, D, true, true, E0, false, true, 3},
      {"2 WGs: + epilogue, stag., deferred, early", 2, 1, true, true, 1, D, true, true, E1, true, true, 3},
      {"2 WGs: + epilogue, deferred, early", 2, 1, true, true, 1, D, true, true, E1, false, true, 3},
      {"2 WGs: + class epilogue, stag., def., early", 2, 1, true, true, 1, D, true, true, E2, true, true, 3},
      {"2 WGs: + half epilogue, stag., deferred", 2, 1, true, true, 1, D, true, true, E3, true, false, 3},
      {"  + half epilogue, deferred", 1, 1, true, true, 1, D, true, true, E3, false, false, 3},
  };
  const auto kernels = KernelTable(std::make_index_sequence<80>());
  const int tiles = 1000;
  const double ops_per_wgmma = 2.0 * 64 * 256 * 256;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  printf("%-44s %10s %12s %10s\n", "variant", "ms", "ns/wgmma/WG", "TOPS");
  for (const Variant& v : variants) {
    if (argc > 1 && strstr(v.name, argv[1]) == nullptr) continue;
    const KernelFn kernel = kernels[KernelIndex(v)];
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    kernel<<<sms, kThreads, kSmemBytes>>>(v, tiles / 10, source, out, sink);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    float best = 1e30f;
    for (int rep = 0; rep < 5; ++rep) {
      CHECK_CUDA(cudaEventRecord(start));
      kernel<<<sms, kThreads, kSmemBytes>>>(v, tiles, source, out, sink);
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      CHECK_CUDA(cudaGetLastError());
      float ms;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (ms < best) best = ms;
    }
    const double wgmmas = static_cast<double>(tiles) * 4 * kBlocksPerTile;
    const double tops = ops_per_wgmma * wgmmas * v.consumers * sms / (best * 1e-3) / 1e12;
    printf("%-44s %10.3f %12.1f %10.1f\n", v.name, best, best * 1e6 / wgmmas, tops);
  }
  return 0;
}
