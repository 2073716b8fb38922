// Resident-weight wgmma kernel (sm_90a): for problems whose column tile's weights fit in shared memory
// whole (ResidentWeightBytes; a 3x3 convolution up to C = 512, a GEMM up to K = 4608 on H100, twice that K
// for N <= 128).
//
// The tensor cores idle while both consumer warpgroups of WgmmaKernel run their threshold epilogue at once
// (2.1 us per C = 512 tile against a 3.2 us k loop): they share every stage, so they run in step. Here a CTA
// keeps one column tile for its whole life and loads its weights once; each consumer warpgroup then takes
// its 64 rows of the CTA's row tiles through its own ring of 64-row activation stages, fed by its own
// producer warp, and never waits for the other, so one warpgroup's epilogue can run under the other's
// wgmmas. Unlike a ping-pong schedule of the persistent kernel's tiles, no weight byte is loaded twice.
// Measured: +8-10% at C = 128 and 512 and for the 4096^3 BMM, but a warpgroup alone runs its k loop well below
// the tensor cores' rate, so most of the overlap is lost. kCols: the columns of a CTA's tile, 256, or 128 where N <= 128 (m64n128 wgmmas:
// half the tensor work of an m64n256 whose upper half would be discarded, and half the weight bytes) or where
// 256-column tiles would leave half the SMs idle (PlanResident). A 128-column tile still fills the column
// table's 256 columns from its first (one per consumer thread, as many at once): the upper half is unused.
// The residual instances (kResidual) run the int16 stream's residual epilogue: each consumer warp copies its 16
// rows' shortcut into shared memory (cp.async) before the tile's wgmmas, and its epilogue adds it from there
// (StoreStagedResidualRows, as the band kernel's); loaded after the MMAs instead, the shortcut's latency made
// the epilogue slower than the int16 dot products plus XLA's add (docs/design/decisions.md).
#include "cuda/kernels/wgmma_resident.h"

#include <cstdint>
#include <cuda.h>

#include "cuda/binary_gemm.h"
#include "cuda/device/column_parameters.cuh"
#include "cuda/device/common.cuh"
#include "cuda/device/loaders.cuh"
#include "cuda/device/pipeline.cuh"
#include "cuda/device/sm90.cuh"
#include "cuda/device/tile_columns.cuh"
#include "cuda/device/wgmma_b1.cuh"
#include "cuda/device/wgmma_epilogue.cuh"
#include "cuda/device/wgmma_tile.cuh"

namespace jaxbnn::cuda {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A half's stage s: its offset in the rings, and its barrier in the array at bar0 ([half][stage]).
__device__ __forceinline__ int ResidentRingOffset(int half, int s) {
  return (half * kResidentStages + s) * kResidentStageBytes;
}
__device__ __forceinline__ uint32_t ResidentBarrier(uint32_t bar0, int half, int s) {
  return bar0 + 8 * (half * kResidentStages + s);
}

// The rings' barriers: a stage's full barrier takes `full_arrivals` (one expect_tx, or every cp.async
// producer thread of the half), its empty barrier the 4 warps of the consumer warpgroup.
__device__ __forceinline__ void InitResidentBarriers(uint32_t full0, uint32_t empty0, uint32_t weights_full,
                                                     int full_arrivals) {
  for (int half = 0; half < 2; ++half) {
    for (int s = 0; s < kResidentStages; ++s) {
      BarrierInit(ResidentBarrier(full0, half, s), full_arrivals);
      BarrierInit(ResidentBarrier(empty0, half, s), 4);
    }
  }
  BarrierInit(weights_full, 1);
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// The k256 steps (32 bytes of K) of K block kb that hold any of the reduction's bytes: 4 but in the last block,
// whose other steps would multiply zeros (a 3x3 convolution at C = 128 or 256 pads K to whole 1024-bit blocks: 3
// of its 8 or 12 steps), so the kernel neither loads nor multiplies them.
__device__ __forceinline__ int RealSteps(const BinaryGemmProblem& p, int kb) {
  return min(4, (p.k_words * 4 - kb * 128 + 31) / 32);
}

// A consumer warp is done with a stage.
__device__ __forceinline__ void ReleaseStage(uint32_t empty) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(empty) : "memory");
}

// Consumer thread ctid's column of the tile: its parameters, and its bound added to the border classes.
// narrow_stream without the table: row 0 of the table as the narrow residual epilogue reads it, 2 popc(b).
__device__ __forceinline__ void StageTileColumn(const BinaryGemmProblem& p, TileColumns<kWgCols>& cols, int col0,
                                                int ctid, bool class_bounds, bool narrow_stream) {
  FillTileColumn<kWgCols>(p, cols, col0, ctid);
  if (class_bounds) AddBoundsToClasses(p, cols, ctid);
  if (narrow_stream && !p.correction_table) cols.correction[0][ctid] = 2 * cols.popc_b[ctid];
}
// The popc(a) of a warpgroup's rows (this thread's rows g and g + 8: row_popc[0], [2]) for its epilogue.
__device__ __forceinline__ void StoreRowPopcounts(int* popc_a, const int (&row_popc)[4], int half, int wtid) {
  if (wtid % 4 == 0) {
    const int r = 64 * half + 16 * (wtid / 32) + wtid % 32 / 4;
    popc_a[r] = row_popc[0];
    popc_a[r + 8] = row_popc[2];
  }
}

// The producer of the cp.async instance (kCoreMatrices: no TMA box takes the tiles): warps 0-1 feed half 0's
// ring, 2-3 half 1's, copying into 128-byte swizzled rows as a TMA box of rows would put them
// (LoadActivationStage's copies keep a row's place modulo 8 only with 8 or more rows between a thread's
// copies); thread 0 also brings the weights.
template <int kCols>
__device__ __forceinline__ void ProduceCopiedStages(const BinaryGemmProblem& p, const CUtensorMap& w_map,
                                                    const LaunchDivisors& div, int m_tiles, int ctas_per_column,
                                                    int first_tile, int col0, int k_blocks, int4* origins,
                                                    uint32_t base, uint32_t weights, uint32_t full0, uint32_t empty0,
                                                    uint32_t weights_full, int tid) {
  const int warp = tid / 32;
  const int half = warp / 2, ptid = tid % 64;
  if (tid == 0) {
    BarrierArriveExpectBytes(weights_full, kCols / 8 * p.w_k_tiles * 128);
    TensorCopy3d(weights, w_map, 0, 0, col0 / 8, weights_full);
  }
  RingPosition<kResidentStages> at;
  bool first_round = true;  // the ring's stages have not been filled yet
  for (int tile_m = first_tile; tile_m < m_tiles; tile_m += ctas_per_column) {
    // the half's copies of the previous tile are issued before its rows' origins are replaced
    asm volatile("bar.sync %0, 64;\n" ::"r"(5 + half) : "memory");
    origins[64 * half + ptid] = RowOrigin(p, tile_m, kWgRows, 64 * half + ptid);
    asm volatile("bar.sync %0, 64;\n" ::"r"(5 + half) : "memory");
    for (int kb = 0; kb < k_blocks; ++kb) {
      if (!first_round) BarrierWait(ResidentBarrier(empty0, half, at.stage), at.phase ^ 1);
      LoadActivationStage<64, 4, 64, ALayout::kSwizzledRows>(p, div, origins + 64 * half,
                                                             base + ResidentRingOffset(half, at.stage), kb, ptid);
      BarrierArriveOnCopies(ResidentBarrier(full0, half, at.stage));
      at.Advance();
      if (at.stage == 0) first_round = false;
    }
  }
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  CopyAsyncWait<0>();
}

// The producer of the TMA instances: warp `half` feeds consumer warpgroup half's ring, a stage per K block of
// each of the CTA's row tiles: one box of 64 swizzled rows (kSwizzledRows), or one box of a_box_bytes of a
// tap's channels per lane: the boxes of the block's real steps only (RealSteps).
template <ALayout kLayout>
__device__ __forceinline__ void ProduceBoxedStages(const BinaryGemmProblem& p, const CUtensorMap& a_map,
                                                   const LaunchDivisors& div, int m_tiles, int ctas_per_column,
                                                   int first_tile, int k_blocks, int a_box_bytes, int a_box_log2,
                                                   uint32_t base, uint32_t full0, uint32_t empty0, int half, int lane) {
  const int a_boxes = 128 >> a_box_log2, tap_bytes = p.cw * 4;
  RingPosition<kResidentStages> at;
  bool first_round = true;  // the ring's stages have not been filled yet
  for (int tile_m = first_tile; tile_m < m_tiles; tile_m += ctas_per_column) {
    const int first = tile_m * kWgRows + 64 * half;  // the half's first output pixel
    const int image = Quotient(first, div.image_pixels), in_image = first - image * div.image_pixels.divisor;
    const int oh0 = Quotient(in_image, div.out_w), ow0 = in_image - oh0 * p.out_w;
    for (int kb = 0; kb < k_blocks; ++kb) {
      // box `lane`: a_box_bytes of one tap's channel bytes (where the tap reads its pixel twice, of the stored
      // bytes it reads); boxes past K start past them (zeros)
      const int k_byte = kb * 128 + lane * a_box_bytes;
      const int tap = Quotient(k_byte, div.tap_bytes);
      const int fkh = Quotient(tap, div.kw), fkw = tap - fkh * p.kw;
      const int channel_byte = k_byte < p.k_words * 4 ? StoredByte(p, k_byte - tap * tap_bytes) : p.x_cw * 4;
      const int boxes = min(a_boxes, (RealSteps(p, kb) * 32 + a_box_bytes - 1) >> a_box_log2);
      if (!first_round) BarrierWait(ResidentBarrier(empty0, half, at.stage), at.phase ^ 1);
      const uint32_t stage = base + ResidentRingOffset(half, at.stage), full = ResidentBarrier(full0, half, at.stage);
      if (lane == 0) {
        const bool whole = kLayout == ALayout::kSwizzledRows;  // (a_boxes boxes make a stage)
        BarrierArriveExpectBytes(full, whole ? kResidentStageBytes : boxes * 64 * a_box_bytes);
      }
      if constexpr (kLayout == ALayout::kSwizzledRows) {
        if (lane == 0) TensorCopy(stage, a_map, kb * 128, first, full);
      } else if (lane < boxes) {
        // the input pixels of the half's output pixels (every stride-th: the map's element strides) shifted by
        // the tap; pixels out of the frame or past the batch arrive as zeros
        TensorCopy4d(stage + lane * 64 * a_box_bytes, a_map, channel_byte, p.stride_w * ow0 + fkw - p.pad_left,
                     p.stride_h * oh0 + fkh - p.pad_top, image, full);
      }
      at.Advance();
      if (at.stage == 0) first_round = false;
    }
  }
}

// One K block's wgmmas of a consumer warpgroup: its 64-row stage against the resident weights, and against 8
// all-ones columns for its rows' popcounts (as the band kernel): counted from the stages by the consumers (LDS
// and POPC between the wgmmas and the wait) they cost C = 512 8%; these wgmmas gain less (C = 512 unchanged,
// C = 256 +4%, one-padded C = 512 +3.5%); producer warps counting the stages instead made C = 512 27% slower.
// The first block's first step replaces the accumulators. kSteps: the block's real steps (RealSteps), each
// count a straight sequence (a loop leaving at the first step past K, ptxas injected twice as many warpgroup
// arrives, C7519).
template <ALayout kLayout, int kCols, int kSteps>
__device__ __forceinline__ void IssueResidentSteps(const BinaryGemmProblem& p, int (&acc)[kCols / 2],
                                                   int (&row_popc)[4], uint32_t stage_a, uint32_t weights,
                                                   uint64_t desc_ones, const uint32_t (&tap_row_step)[4],
                                                   int a_box_bytes, int kb) {
  constexpr bool kCopies = kLayout == ALayout::kCoreMatrices;
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    uint64_t desc_a;
    if constexpr (kLayout == ALayout::kSwizzledRows || kCopies) {
      desc_a = SwizzledOperandDescriptor(stage_a + ks * 32);
    } else if constexpr (kLayout == ALayout::kChunkSlabs) {
      desc_a = OperandDescriptor(stage_a + ks * 2 * 64 * 16, 64 * 16, 128);
    } else {
      desc_a = SwizzledOperandDescriptor(stage_a + tap_row_step[ks], a_box_bytes);
    }
    // the weights: FSB tiles as they lie in global memory, a row tile's K tiles contiguous
    const uint64_t desc_b = OperandDescriptor(weights + (kb * 8 + 2 * ks) * 128, 128, p.w_k_tiles * 128);
    if constexpr (kCols == kWgCols) {
      wgmma_m64n256k256_and_popc(acc, desc_a, desc_b, (kb | ks) != 0);
    } else {
      wgmma_m64n128k256_and_popc(acc, desc_a, desc_b, (kb | ks) != 0);
    }
    wgmma_m64n8k256_and_popc(row_popc, desc_a, desc_ones, (kb | ks) != 0);
  }
}
template <ALayout kLayout, int kCols>
__device__ __forceinline__ void IssueResidentWgmmas(const BinaryGemmProblem& p, int (&acc)[kCols / 2],
                                                    int (&row_popc)[4], uint32_t stage_a, uint32_t weights,
                                                    uint64_t desc_ones, const uint32_t (&tap_row_step)[4],
                                                    int a_box_bytes, int kb) {
  switch (RealSteps(p, kb)) {  // (the same for the whole warpgroup)
    case 4:
      IssueResidentSteps<kLayout, kCols, 4>(p, acc, row_popc, stage_a, weights, desc_ones, tap_row_step, a_box_bytes, kb);
      break;
    case 3:
      IssueResidentSteps<kLayout, kCols, 3>(p, acc, row_popc, stage_a, weights, desc_ones, tap_row_step, a_box_bytes, kb);
      break;
    case 2:
      IssueResidentSteps<kLayout, kCols, 2>(p, acc, row_popc, stage_a, weights, desc_ones, tap_row_step, a_box_bytes, kb);
      break;
    default:
      IssueResidentSteps<kLayout, kCols, 1>(p, acc, row_popc, stage_a, weights, desc_ones, tap_row_step, a_box_bytes, kb);
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// grid: n_tiles x ctas_per_column CTAs; CTA b takes column tile b / ctas_per_column and row tiles
// b % ctas_per_column, + ctas_per_column, ... a_map: the activations in 64-row boxes (ActivationLayout); the
// cp.async instance (kCoreMatrices: ProduceCopiedStages) has none. Producer warps 0 and 1 feed the rings of
// consumer warpgroups 0 and 1 by TMA boxes, warp 2 brings the weights as one TMA box of the column tile's
// kCols / 8 row tiles (zeros past N), as they lie in shared memory (one box brings them sooner than a bulk
// copy per row tile). A programmatic dependent launch, as WgmmaKernel: no global access before
// `griddepcontrol.wait`.
//
// Each consumer thread fills column ctid of the column table and parameters: warpgroup 1 before it waits
// (barrier 1); warpgroup 0 behind its second K block's wgmmas, letting warpgroup 1 go then (barrier 4), so
// warpgroup 1 starts two K blocks late. Started a whole k loop late (so that each one's epilogue would run
// under the other's wgmmas), warpgroup 1 idled ~3 us at every CTA's start, and the stagger did not last
// (C = 512: the k loops overlapped 60%); one K block late: C = 256 +4%, C = 512 +1%; two: C = 512, BMM
// 4096^3 +1-2% more. The row corrections are computed at the last K block, not the first: between the first
// block's wgmmas and the next block's, the two warps' RowCorrection made C = 512 "zero" 4% slower; at the
// last they run while the tile's last wgmmas finish (producer warps computing them, handed over through an
// mbarrier, gained 3%).
template <ALayout kLayout, int kCols, bool kResidual>
__global__ void __launch_bounds__(kWgThreads, 1)
    ResidentWgmmaKernel(const BinaryGemmProblem p, const __grid_constant__ CUtensorMap a_map,
                        const __grid_constant__ CUtensorMap w_map, const LaunchDivisors div, int m_tiles,
                        int ctas_per_column, const ResidualOperands residual) {
  static_assert(kCols == kWgCols || kCols == kWgCols / 2, "m64n256 or m64n128 wgmmas");
  constexpr bool kCopies = kLayout == ALayout::kCoreMatrices;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - SmemAddress(smem_raw) % 1024) % 1024;
  // the rings (1024-aligned: the swizzled boxes), the weights, then the rest; the last K block's k256 steps
  // past K read weight bytes past the last row tile, which land in `cols` (their activations are zeros)
  const int weight_bytes = ResidentWeightBytes(p.w_k_tiles, kCols);
  auto& cols = *reinterpret_cast<TileColumns<kWgCols>*>(smem + kResidentRingBytes + weight_bytes);
  int* popc_a = reinterpret_cast<int*>(&cols + 1);
  auto* barriers = reinterpret_cast<uint64_t*>(popc_a + kWgRows);
  int8_t* row_correction = reinterpret_cast<int8_t*>(barriers + 4 * kResidentStages + 1);
  // B of the popc(a) wgmmas: 8 columns of all ones (2 core matrices of k256), 16-byte aligned
  uint32_t* ones = reinterpret_cast<uint32_t*>(smem + ((reinterpret_cast<uint8_t*>(row_correction) + kWgRows - smem + 15) & ~15));
  int4* origins = reinterpret_cast<int4*>(ones + 64);  // kCopies only (kResidentOriginBytes)
  // kResidual: the tile's StreamColumns, then each consumer warp's shortcut stage (ResidentStagedBytes)
  auto& stream = *reinterpret_cast<StreamColumns<kCols>*>(origins + kWgRows);
  uint8_t* stages = reinterpret_cast<uint8_t*>(&stream + 1);
  const uint32_t base = SmemAddress(smem), weights = base + kResidentRingBytes;
  const uint32_t full0 = SmemAddress(barriers);                  // [half][stage]: the stage landed
  const uint32_t empty0 = full0 + 2 * kResidentStages * 8;    // [half][stage]: its 4 warps read it
  const uint32_t weights_full = empty0 + 2 * kResidentStages * 8;
  const int tid = threadIdx.x;
  const int tile_n = blockIdx.x / ctas_per_column, first_tile = blockIdx.x % ctas_per_column;
  const int col0 = tile_n * kCols;
  const int k_blocks = (p.k_words + kKBlockWords - 1) / kKBlockWords;
  const int a_box_bytes = kLayout == ALayout::kChunkSlabs ? 16 : kLayout == ALayout::kTapRows ? TapRowBytes(p.x_cw) : 128;
  const int a_box_log2 = __ffs(a_box_bytes) - 1;
  if (tid == 0) {
    if (!kCopies) PrefetchTensorMap(a_map);  // (the cp.async instance has no activation map)
    PrefetchTensorMap(w_map);
    InitResidentBarriers(full0, empty0, weights_full, kCopies ? 64 : 1);  // cp.async: every producer thread of a half
  }
  if (tid < 64) ones[tid] = 0xFFFFFFFFu;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // for the wgmmas
  __syncthreads();
  // a programmatic dependent launch, as WgmmaKernel: no global access before this
  asm volatile("griddepcontrol.wait;\n" ::: "memory");

  if (tid < 128) {  // producer warps: 0 and 1 feed the rings of consumer warpgroups 0 and 1, 2 the weights
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    const int warp = tid / 32, lane = tid % 32;
    if constexpr (kCopies) {
      ProduceCopiedStages<kCols>(p, w_map, div, m_tiles, ctas_per_column, first_tile, col0, k_blocks, origins, base,
                                 weights, full0, empty0, weights_full, tid);
      return;
    }
    if (warp == 3) return;
    if (warp == 2) {
      if (lane == 0) {
        BarrierArriveExpectBytes(weights_full, kCols / 8 * p.w_k_tiles * 128);
        TensorCopy3d(weights, w_map, 0, 0, col0 / 8, weights_full);
      }
    } else {
      ProduceBoxedStages<kLayout>(p, a_map, div, m_tiles, ctas_per_column, first_tile, k_blocks, a_box_bytes,
                                              a_box_log2, base, full0, empty0, warp, lane);
    }
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int ctid = tid - 128, half = ctid / 128, wtid = ctid % 128;
  const uint32_t tile_bar = 2 + half;  // named barrier of this warpgroup alone
  uint32_t tap_row_step[4];            // kTapRows: where k256 step ks starts in a 64-row stage
  TapRowSteps<64>(a_box_bytes, a_box_log2, tap_row_step);
  const bool class_bounds = p.epilogue == Epilogue::kBits && p.correction_table;
  // kResidual: the table's entries hold 2 popc(b) too, as the narrow residual epilogue reads them
  if (p.correction_table) FillCorrectionTable<kWgCols>(p, cols, col0, ctid, 0, 1, false, {}, kResidual);
  if (p.edge_table) FillEdgeTable<kWgCols>(p, cols, col0, ctid);
  // (read by the other warpgroup after the column table's barriers 1 and 4 below)
  if (kResidual && ctid < kCols) FillStreamColumn(p, stream, col0, ctid, residual.planes);
  [[maybe_unused]] uint8_t* stage = stages + (ctid / 32) * kStagedWarpBytes<kCols>;
  const int fill_kb = half == 0 ? min(1, k_blocks - 1) : -1;
  if (half == 1 && first_tile < m_tiles) {  // (a CTA without tiles: nothing to wait for)
    StageTileColumn(p, cols, col0, ctid, class_bounds, kResidual);
    asm volatile("bar.arrive 1, 256;\n" ::: "memory");
    asm volatile("bar.sync 4, 256;\n" ::: "memory");
  }
  BarrierWait(weights_full, 0);
  RingPosition<kResidentStages> at;
  for (int tile_m = first_tile; tile_m < m_tiles; tile_m += ctas_per_column) {
    const bool first_tile_of_cta = tile_m == first_tile;
    // the previous epilogue is done with this warpgroup's popc_a and row corrections
    asm volatile("bar.sync %0, 128;\n" ::"r"(tile_bar) : "memory");
    int acc[kCols / 2];
    int row_popc[4];  // popc(a) of this thread's rows g and g + 8: row_popc[0], [2]
    int previous_stage = 0;
    const uint64_t desc_ones = OperandDescriptor(SmemAddress(ones), 128, 256);
    if constexpr (kResidual) {  // the shortcut of the warp's 16 rows, copied while the tile's wgmmas run
      StageWarpShortcut<kCols>(p, residual, div, stage, tile_m, col0, half, wtid);
    }
    for (int kb = 0; kb < k_blocks; ++kb) {
      BarrierWait(ResidentBarrier(full0, half, at.stage), at.phase);
      // cp.async wrote the activations through the generic proxy; the tensor cores read through the async one.
      if constexpr (kCopies) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      const uint32_t stage_a = base + ResidentRingOffset(half, at.stage);
      IssueResidentWgmmas<kLayout, kCols>(p, acc, row_popc, stage_a, weights, desc_ones, tap_row_step, a_box_bytes,
                                          kb);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      if (first_tile_of_cta && kb == fill_kb) {
        StageTileColumn(p, cols, col0, ctid, class_bounds, kResidual);
        asm volatile("bar.arrive 4, 256;\n" ::: "memory");
      }
      if (kb == k_blocks - 1 && !p.pad_one && wtid < 64) {
        row_correction[64 * half + wtid] = RowCorrection(p, div, tile_m, 64 * half + wtid);
      }
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      if (kb > 0 && wtid % 32 == 0) ReleaseStage(ResidentBarrier(empty0, half, previous_stage));
      previous_stage = at.stage;
      at.Advance();
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    if (wtid % 32 == 0) ReleaseStage(ResidentBarrier(empty0, half, previous_stage));
    StoreRowPopcounts(popc_a, row_popc, half, wtid);
    if (first_tile_of_cta && half == 0) {
      asm volatile("bar.sync 1, 256;\n" ::: "memory");  // warpgroup 1's columns are staged too
    } else {
      asm volatile("bar.sync %0, 128;\n" ::"r"(tile_bar) : "memory");
    }
    if constexpr (kResidual) {
      WaitStagedShortcut();
      StoreStagedResidualAccumulators(p, residual, acc, popc_a, row_correction, cols, stage, stream, tile_m,
                                      col0, half, wtid);
    } else {
      StoreAccumulators(p, acc, popc_a, row_correction, cols, tile_m, col0, half, wtid, p.n - col0 <= kWgCols / 2);
    }
  }
#endif
}

template <bool kResidual>
const void* ResidentInstanceOf(ALayout layout, int cols) {
  const bool narrow = cols == kWgCols / 2;
  const auto kernel =
      layout == ALayout::kCoreMatrices ? ResidentWgmmaKernel<ALayout::kCoreMatrices, kWgCols / 2, kResidual>  // narrow only
      : layout == ALayout::kSwizzledRows
          ? (narrow ? ResidentWgmmaKernel<ALayout::kSwizzledRows, kWgCols / 2, kResidual>
                    : ResidentWgmmaKernel<ALayout::kSwizzledRows, kWgCols, kResidual>)
      : layout == ALayout::kChunkSlabs
          ? (narrow ? ResidentWgmmaKernel<ALayout::kChunkSlabs, kWgCols / 2, kResidual>
                    : ResidentWgmmaKernel<ALayout::kChunkSlabs, kWgCols, kResidual>)
          : (narrow ? ResidentWgmmaKernel<ALayout::kTapRows, kWgCols / 2, kResidual>
                    : ResidentWgmmaKernel<ALayout::kTapRows, kWgCols, kResidual>);
  return reinterpret_cast<const void*>(kernel);
}

const void* ResidentWgmmaKernelInstance(ALayout layout, int cols, bool residual) {
  return residual ? ResidentInstanceOf<true>(layout, cols) : ResidentInstanceOf<false>(layout, cols);
}

}  // namespace jaxbnn::cuda
