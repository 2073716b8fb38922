// wgmma engine (sm_90a): warp-specialized, mbarrier pipeline, clusters of two CTAs along M.
//
// The two CTAs of a cluster take row tiles 2i and 2i + 1 of one column tile, so they need the same weight
// stages: each copies half of a stage's weight rows and multicasts it into both CTAs' shared memory,
// which halves the L2 -> SM weight traffic. A stage is refilled only after the consumers of both CTAs
// released it (the "empty" barriers count the consumer warps of the whole cluster).
// Activations: one TMA tensor copy per stage (128B swizzle) when the rows of A are rows of a matrix
// (bmm, 1x1 stride-1 convolutions), else cp.async by the producer warpgroup with the implicit-GEMM
// addressing (zero fill of out-of-frame taps).
// The residual instances run the int16 stream's residual epilogue where the resident kernel cannot hold a column
// tile's weights (a 3x3 convolution past C = 512 bits of reduction a column: the side-by-side products of ternary
// layers): one tile per CTA, whose shortcut is staged in the pipeline's stages once the tile's copies have landed.
#include "cuda/kernels/wgmma_persistent.h"

#include <cstdint>
#include <cuda.h>

#include "cuda/binary_gemm.h"
#include "cuda/device/column_parameters.cuh"
#include "cuda/device/common.cuh"
#include "cuda/device/epilogue.cuh"
#include "cuda/device/geometry.cuh"
#include "cuda/device/loaders.cuh"
#include "cuda/device/pipeline.cuh"
#include "cuda/device/sm90.cuh"
#include "cuda/device/tile_columns.cuh"
#include "cuda/device/tile_schedule.cuh"
#include "cuda/device/wgmma_b1.cuh"
#include "cuda/device/wgmma_epilogue.cuh"
#include "cuda/device/wgmma_tile.cuh"

namespace jaxbnn::cuda {

// The compile-time choices of WgmmaKernel<kLayout, kSteps>.
template <ALayout kLayout, int kSteps>
struct PersistentWgmmaTraits {
  static constexpr bool kTensorA = kLayout != ALayout::kCoreMatrices;  // activations by TMA boxes
  // How the activations lie in a stage: as the TMA boxes put them, and where the producer copies them
  // (kCoreMatrices), in 128-byte swizzled rows too, so that a quarter-warp copies one row's 128 contiguous
  // bytes where a tap has >= 32 bytes (LoadActivationStage; the core-matrix order requests every 32-byte
  // sector twice there).
  static constexpr ALayout kStageLayout = kTensorA ? kLayout : ALayout::kSwizzledRows;
  // The lanes of a consumer warp that arrive on a stage's "empty" barrier once all of the warp's reads
  // (wgmma and row popcounts) of it are done: one per warp, or with cp.async refills, one per thread (as in
  // ClassicKernel: with one arrival per warp after __syncwarp, racecheck reported the other lanes' popcount
  // reads as racing with the producer's next copies into the stage).
  static constexpr int kReleasingLanes = kTensorA ? 1 : 32;
  static_assert(kSteps == 4 || (kSteps > 0 && kSteps < 4 && !kTensorA), "short K blocks: cp.async instances");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Thread 0: the tensor maps' prefetch and the stages' barriers. "full": one arrival with the stage's byte
// count (TMA), or one per producer thread when its copies land plus the one that brings the weights' byte
// count (cp.async); "empty": the releasing lanes of every consumer warp of the cluster.
template <bool kTensorA, int kReleasingLanes>
__device__ __forceinline__ void InitStages(const CUtensorMap& a_map, const CUtensorMap& w_map, bool weights_by_tma,
                                           uint32_t full0, uint32_t empty0, int tid) {
  if (tid == 0) {
    if (kTensorA) PrefetchTensorMap(a_map);
    if (weights_by_tma) PrefetchTensorMap(w_map);
    for (int s = 0; s < kWgStages; ++s) {
      BarrierInit(full0 + 8 * s, kTensorA ? 1 : 129);
      BarrierInit(empty0 + 8 * s, kWgCluster * kWgConsumerWarps * kReleasingLanes);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
}

// The producer warpgroup (one warp of it for TMA activations): fills the stages of the CTA's tiles in turn,
// the activations by TMA boxes or by cp.async with the implicit-GEMM addressing (zero fill of out-of-frame
// taps), this CTA's half of the weight rows multicast into both CTAs of the cluster.
template <ALayout kLayout, int kSteps, bool kTensorA, ALayout kStageLayout, bool kDoubled>
__device__ __forceinline__ void ProduceStages(const BinaryGemmProblem& p, const CUtensorMap& a_map,
                                              const CUtensorMap& w_map, bool weights_by_tma, const LaunchDivisors& div,
                                              int m_pairs, int n_tiles, bool runs, const PairRange& schedule, int rank,
                                              int4* origins, uint32_t full0, uint32_t empty0, uint32_t base,
                                              int k_blocks, int a_box_bytes, int a_boxes, int tid) {
  int it = 0;
  for (int pair = schedule.first; pair < schedule.end; pair += schedule.step) {
    int pair_m, tile_n;
    PairCoordinates(pair, m_pairs, n_tiles, runs, pair_m, tile_n);
    const int tile_m = pair_m * kWgCluster + rank;
    const int col0 = tile_n * kWgCols;
    // Weight rows of this column tile: FSB row tiles past N are not copied; what stays in their place
    // lands in columns that are never stored.
    const int row_tiles = min(kWgCols / 8, p.w_row_tiles - col0 / 8);
    if (!kTensorA) {
      asm volatile("bar.sync 2, 128;\n" ::: "memory");  // the previous tile's copies are all issued
      origins[tid] = RowOrigin(p, tile_m, kWgRows, tid);
      asm volatile("bar.sync 2, 128;\n" ::: "memory");
    }
    // The tap boxes' origin: the tile's first output pixel (whole output rows, or a 128-pixel run of one).
    const int first = tile_m * kWgRows;
    const int image = Quotient(first, div.image_pixels), in_image = first - image * div.image_pixels.divisor;
    const int oh0 = Quotient(in_image, div.out_w), ow0 = in_image - oh0 * p.out_w;
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      const int s = it % kWgStages;
      const uint32_t full = full0 + 8 * s;
      // Box `tid` of the K block (box layouts): a_box_bytes of one tap's channel bytes (16: one chunk),
      // placed before the wait so that only the copies follow the stage's release. Boxes past K start
      // past the channel bytes: they arrive as zeros.
      const int k_byte = kb * 128 + tid * a_box_bytes, tap_bytes = p.cw * 4;
      int tap = Quotient(k_byte, div.tap_bytes), cword = 0;
      // a doubled convolution's box lies within one tap's run (ABoxTapBytes)
      if constexpr (kDoubled) DoubledReductionWord(p, k_byte / 4, tap, cword);
      const int fkh = Quotient(tap, div.kw), fkw = tap - fkh * p.kw;
      const int channel_byte =
          k_byte < p.k_words * 4 ? (kDoubled ? cword * 4 : StoredByte(p, k_byte - tap * tap_bytes)) : p.x_cw * 4;
      if (it >= kWgStages) BarrierWait(empty0 + 8 * s, ((it / kWgStages) - 1) & 1);
      const uint32_t stage = base + s * kWgStageBytes;
      // FSB tiles past K are not copied either: what stays there meets zero-filled activation words.
      const int kt0 = kb * 8, k_tiles = min(8, p.w_k_tiles - kt0);
      // by TMA: whole boxes, zeros included; by bulk copies: the FSB tiles that exist
      const uint32_t weight_bytes = weights_by_tma ? kWgCols * 128 : row_tiles * k_tiles * 128;
      if constexpr (kTensorA) {
        if (tid == 0) BarrierArriveExpectBytes(full, kWgStageA + weight_bytes);
        if constexpr (kLayout == ALayout::kSwizzledRows) {
          if (tid == 0) TensorCopy(stage, a_map, kb * 128, tile_m * kWgRows, full);
        } else if (tid < a_boxes) {
          // the input pixels of the tile's block of output pixels (every stride-th: the map's element
          // strides) shifted by the tap; pixels out of the frame or past the batch arrive as zeros
          TensorCopy4d(stage + tid * kWgRows * a_box_bytes, a_map, channel_byte,
                       p.stride_w * ow0 + fkw - p.pad_left, p.stride_h * oh0 + fkh - p.pad_top, image, full);
        }
      } else {
        // 8-byte copies where a stored pixel has an even but not a multiple-of-4 number of words (C = 64: 2)
        if (p.x_cw % 4 == 0) {
          LoadActivationStage<kWgRows, 4, 128, kStageLayout, (kSteps < 4), kDoubled>(p, div, origins, stage, kb, tid);
        } else {
          LoadActivationStage<kWgRows, 2, 128, kStageLayout, (kSteps < 4), kDoubled>(p, div, origins, stage, kb, tid);
        }
        if (tid == 0) BarrierArriveExpectBytes(full, weight_bytes);
      }
      // This CTA's half of the weight rows, 1 KB (8 FSB tiles) per 8-row tile row, into both CTAs: one TMA
      // box, or one bulk copy per row tile (each a serialized trip through the uniform datapath).
      constexpr int kRowTilesPerCta = kWgCols / 8 / kWgCluster;
      if (weights_by_tma) {
        if (tid == 0) {
          WeightCopyMulticast(stage + kWgStageA + rank * kRowTilesPerCta * kRowGroupBytes, w_map, kt0,
                              col0 / 8 + rank * kRowTilesPerCta, full);
        }
      } else if (const int j = rank * kRowTilesPerCta + tid; tid < kRowTilesPerCta && j < row_tiles) {
        BulkCopyMulticast(stage + kWgStageA + j * kRowGroupBytes,
                          p.w + (static_cast<size_t>(col0 / 8 + j) * p.w_k_tiles + kt0) * 32, k_tiles * 128, full);
      }
      if (!kTensorA) BarrierArriveOnCopies(full);
    }
  }
  // Every copy is issued: the next kernel in the stream may start its CTAs' prologue as SMs free up.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (!kTensorA) CopyAsyncWait<0>();
}

// One K block's wgmmas of a consumer warpgroup: its 64 rows of the stage (`stage_a`) against the stage's
// weights (`stage_b`), kSteps k256 steps; the first block's first step replaces the accumulators.
template <ALayout kStageLayout, int kSteps>
__device__ __forceinline__ void IssueStageWgmmas(int (&acc)[128], uint32_t stage_a, uint32_t stage_b,
                                                 const uint32_t (&tap_row_step)[4], int a_box_bytes, int kb) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    uint64_t desc_a;
    if constexpr (kStageLayout == ALayout::kSwizzledRows) {
      desc_a = SwizzledOperandDescriptor(stage_a + ks * 32);
    } else if constexpr (kStageLayout == ALayout::kChunkSlabs) {
      desc_a = OperandDescriptor(stage_a + ks * 2 * kWgRows * 16, kWgRows * 16, 128);
    } else {
      static_assert(kStageLayout == ALayout::kTapRows, "a stage layout of the wgmma kernel");
      desc_a = SwizzledOperandDescriptor(stage_a + tap_row_step[ks], a_box_bytes);
    }
    wgmma_m64n256k256_and_popc(acc, desc_a, OperandDescriptor(stage_b + ks * 256), (kb | ks) != 0);
  }
}

// The pooled epilogue of consumer warpgroup `half`: one tile per CTA, whose every copy has landed (the
// consumers waited for all of them), so the stages are free for the int32 tile; then StoreTile.
__device__ __forceinline__ void StoreStagedTile(const BinaryGemmProblem& p, uint8_t* smem, int4* origins,
                                                const int* popc_a, const TileColumns<kWgCols>& cols,
                                                const int (&acc)[128], int tile_m, int col0, int half, int ctid,
                                                int wtid) {
  int* acc_tile = reinterpret_cast<int*>(smem);
  {
    const int w = wtid / 32, lane = wtid % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < 128; i += 2) {
      const int row = 64 * half + 16 * w + g + 8 * ((i >> 1) & 1);
      const int col = 8 * (i >> 2) + 2 * t;
      *reinterpret_cast<int2*>(acc_tile + row * kWgLd + col) = make_int2(acc[i], acc[i + 1]);
    }
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  // the staged epilogue needs every row's receptive-field origin (the producer's table is for its rows)
  if (ctid < kWgRows) origins[ctid] = RowOrigin(p, tile_m, kWgRows, ctid);
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  StoreTile<kWgRows, kWgCols, kWgLd, 256>(p, acc_tile, popc_a, cols, origins, tile_m, col0, ctid);
}

// The int16 stream's residual epilogue of consumer warpgroup `half`, one tile per CTA (PlanPersistent): every copy
// of the tile has landed (the consumers waited for all of them) and both warpgroups' wgmmas are done, so the stages
// are free for each consumer warp's shortcut stage (StageShortcut) and the tile's StreamColumns, which the stages
// leave no room for beside them. The shortcut's copies are issued after the MMAs (the resident kernel issues them
// before): its latency is the price of running on the tensor cores at all (else the mma.sync engine).
__device__ __forceinline__ void StoreStagedResidualTile(const BinaryGemmProblem& p, const ResidualOperands& residual,
                                                        uint8_t* smem, const int (&acc)[128], const int* popc_a,
                                                        const int8_t* row_correction, const TileColumns<kWgCols>& cols,
                                                        const LaunchDivisors& div, int tile_m, int col0, int half,
                                                        int ctid, int wtid) {
  constexpr int kConsumerWarps = (kWgThreads - 128) / 32;
  static_assert(kConsumerWarps * kStagedWarpBytes<kWgCols> + sizeof(StreamColumns<kWgCols>) <= kWgStages * kWgStageBytes,
                "the shortcut stages and the stream columns fit the pipeline's stages");
  uint8_t* stage = smem + (ctid / 32) * kStagedWarpBytes<kWgCols>;
  auto& stream = *reinterpret_cast<StreamColumns<kWgCols>*>(smem + kConsumerWarps * kStagedWarpBytes<kWgCols>);
  StageWarpShortcut<kWgCols>(p, residual, div, stage, tile_m, col0, half, wtid);
  FillStreamColumn(p, stream, col0, ctid, residual.planes);
  asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the stream columns
  WaitStagedShortcut();
  StoreStagedResidualAccumulators(p, residual, acc, popc_a, row_correction, cols, stage, stream, tile_m, col0, half,
                                  wtid);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The persistent wgmma kernel: over tile pairs (one pair per cluster and step) unless the epilogue pools, which
// stages the tile in the pipeline's shared memory and so runs one pair per cluster. The producer warpgroup
// (ProduceStages) runs ahead into the next tile while the consumers finish the previous one's epilogue; each
// consumer warpgroup takes 64 rows of every tile: a k loop of wgmmas over the stages, with the column
// parameters (their global loads issued after the second K block's wgmmas, when the tensor cores have two
// blocks queued), the row corrections and the rows' popcounts computed under it, then the epilogue
// (StoreAccumulators straight from the accumulators, or StoreStagedTile for pools). Launched as a
// programmatic dependent with a cluster dimension of kWgCluster: the set-up before `griddepcontrol.wait`
// overlaps the previous kernel's last tiles, and every access to the problem's buffers comes after it.
// kLayout: how the activations arrive (kCoreMatrices: cp.async by the producer warpgroup; else TMA boxes
// issued by one producer warp). kSteps: the k256 steps of a K block, 4, or fewer for unpooled cp.async
// problems of one short K block (K <= 256 or <= 768 bits: ResNet's 1x1 stride-2 shortcuts, 3x3 stride-2
// convolutions of C = 64), whose stages hold zeros past K from the start, so that the producer copies only
// the words of K (a full K block was 16 copies of 8 bytes per row, most of them zero fill) and the
// consumers issue only the steps of K.
//
// Registers: 40 for the producer and 232 for each consumer fill the register file; at 224 the consumers
// spilled k_blocks and reloaded it from local memory on every K block. Plain GEMMs (kSwizzledRows) read the
// thread index afresh for the epilogue (FreshThreadIndex): ptxas hoisted what the epilogue derives from it
// out of the tile loop and spilled it (ncu, 16384^3 BMM: local-memory reloads at every tile end; +6% with
// the re-read); the convolution layouts keep it: the re-read moved their register allocation, and they ran
// 3-5% slower with it.
// kResidual: the int16 stream's residual epilogue (Epilogue::kResidualInt16, StoreStagedResidualTile), one tile pair
// per cluster as the pooled epilogue; `residual` is read by those instances only. kDoubled: the accumulators are
// doubled once the first p.doubled_k_blocks K blocks' wgmmas are done (all of them waited for: one drain of the
// tensor cores a tile).
template <ALayout kLayout, int kSteps = 4, bool kResidual = false, bool kDoubled = false>
__global__ void __launch_bounds__(kWgThreads, 1)
    WgmmaKernel(const BinaryGemmProblem p, const __grid_constant__ CUtensorMap a_map,
                const __grid_constant__ CUtensorMap w_map, bool weights_by_tma, const LaunchDivisors div,
                int m_pairs, int n_tiles, bool runs, const ResidualOperands residual) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Traits = PersistentWgmmaTraits<kLayout, kSteps>;
  constexpr bool kTensorA = Traits::kTensorA;
  constexpr ALayout kStageLayout = Traits::kStageLayout;
  constexpr int kReleasingLanes = Traits::kReleasingLanes;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - SmemAddress(smem_raw) % 1024) % 1024;
  int4* origins = reinterpret_cast<int4*>(smem + kWgStages * kWgStageBytes);
  int* popc_a = reinterpret_cast<int*>(origins + kWgRows);
  auto& cols = *reinterpret_cast<TileColumns<kWgCols>*>(popc_a + kWgRows);
  auto* barriers = reinterpret_cast<uint64_t*>(&cols + 1);
  const uint32_t full0 = SmemAddress(barriers);   // kWgStages "stage landed" barriers
  const uint32_t empty0 = full0 + kWgStages * 8;  // kWgStages "stage consumed by the cluster" barriers
  int8_t* row_correction = reinterpret_cast<int8_t*>(barriers + 2 * kWgStages);  // RowCorrection per tile row
  const int tid = threadIdx.x;
  const PairRange schedule =
      PairsOfCluster(static_cast<int>(ClusterId()), static_cast<int>(ClusterCount()), m_pairs, n_tiles, runs);
  const int rank = static_cast<int>(ClusterRank());
  const bool staged = p.pool_h * p.pool_w > 1;
  // Bytes of K per row of one activation slab (one TMA box): 16 in the chunk slabs, W in the tap rows, 128
  // (a whole stage row) in the other layouts; a power of two.
  const int a_box_bytes = kLayout == ALayout::kChunkSlabs ? 16
                          : kLayout == ALayout::kTapRows  ? (kDoubled ? ABoxTapBytes(p) : TapRowBytes(p.x_cw))
                                                          : 128;
  const int a_box_log2 = __ffs(a_box_bytes) - 1;
  const int a_boxes = 128 >> a_box_log2;           // per stage
  uint32_t tap_row_step[4];
  TapRowSteps<kWgRows>(a_box_bytes, a_box_log2, tap_row_step);
  InitStages<kTensorA, kReleasingLanes>(a_map, w_map, weights_by_tma, full0, empty0, tid);
  if constexpr (kSteps < 4) {  // the activation words past K, for good (the producer never copies them)
    for (int i = tid; i < kWgStages * kWgStageA / 16; i += kWgThreads) {
      *reinterpret_cast<uint4*>(smem + i / (kWgStageA / 16) * kWgStageBytes + i % (kWgStageA / 16) * 16) =
          make_uint4(0, 0, 0, 0);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // for the wgmmas
  }
  ClusterSync();  // the partner's barriers exist before any multicast copy or remote arrival reaches them
  asm volatile("griddepcontrol.wait;\n" ::: "memory");

  const uint32_t base = SmemAddress(smem);
  const int k_blocks = (p.k_words + kKBlockWords - 1) / kKBlockWords;
  const int warpgroup = tid / 128;
  if (warpgroup == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (kTensorA && tid >= 32) return;  // one warp issues the copies
    ProduceStages<kLayout, kSteps, kTensorA, kStageLayout, kDoubled>(
        p, a_map, w_map, weights_by_tma, div, m_pairs, n_tiles, runs, schedule, rank, origins, full0, empty0, base,
        k_blocks, a_box_bytes, a_boxes, tid);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int ctid = tid - 128;      // 0..255 over both consumer warpgroups
  const int half = warpgroup - 1;  // rows 64 * half ... of the tile
  const int wtid = ctid % 128;     // thread in its warpgroup
  auto release = [&](uint32_t s) {
    if constexpr (kReleasingLanes == 1) {
      __syncwarp();
      if (wtid % 32 != 0) return;
    }
    BarrierArriveCluster(empty0 + 8 * s);
  };
  uint32_t it = 0;  // k blocks consumed so far: stage it % kWgStages, phase (it / kWgStages) % 2
  int staged_tile_n = -1;  // the column tile whose parameters `cols` holds
  const int fill_kb = min(1, k_blocks - 1);
  // the threshold epilogue's class-bound table (StoreAccumulators): unpooled threshold problems with a table
  const bool class_bounds = p.epilogue == Epilogue::kBits && !staged && p.correction_table;
  for (int pair = schedule.first; pair < schedule.end; pair += schedule.step) {
    int pair_m, tile_n;
    PairCoordinates(pair, m_pairs, n_tiles, runs, pair_m, tile_n);
    const int tile_m = pair_m * kWgCluster + rank;
    const int col0 = tile_n * kWgCols;
    asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the previous epilogue is done with cols and popc_a
    // The border-class corrections stay while the column tile does; filled before the accumulators are live.
    const bool new_columns = tile_n != staged_tile_n;
    // kResidual: the table's entries hold 2 popc(b) too, as the narrow residual epilogue reads them
    if (new_columns && p.correction_table) FillCorrectionTable<kWgCols>(p, cols, col0, ctid, 0, 1, false, {}, kResidual);
    if (new_columns && p.edge_table) FillEdgeTable<kWgCols>(p, cols, col0, ctid);
    staged_tile_n = tile_n;
    int acc[128];
    int row_popc = 0;
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      const uint32_t s = it % kWgStages;
      BarrierWait(full0 + 8 * s, (it / kWgStages) & 1);
      // cp.async wrote the activations through the generic proxy; the tensor cores read through the async one.
      if (!kTensorA) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      // this warpgroup's 64 rows: the second half starts 64 rows in (64 x a_box_bytes in the slab layouts)
      const int half_offset = half * 64 * a_box_bytes;
      const uint32_t stage_a = base + s * kWgStageBytes + half_offset;
      const uint32_t stage_b = base + s * kWgStageBytes + kWgStageA;
      IssueStageWgmmas<kStageLayout, kSteps>(acc, stage_a, stage_b, tap_row_step, a_box_bytes, kb);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      if (kb == fill_kb && new_columns) {
        FillTileColumn<kWgCols>(p, cols, col0, ctid);
        if (class_bounds) AddBoundsToClasses(p, cols, ctid);
        // without the table: row 0 as the narrow residual epilogue reads it, 2 popc(b)
        if (kResidual && !p.correction_table) cols.correction[0][ctid] = 2 * cols.popc_b[ctid];
      }
      // each warpgroup its own 64 rows' corrections ("zero" padding; read by the unpooled epilogue only)
      if (kb == 0 && !p.pad_one && !staged && wtid < 64) {
        row_correction[64 * half + wtid] = RowCorrection(p, div, tile_m, 64 * half + wtid);
      }
      // While the tensor cores run: popc(a) of this warpgroup's 64 rows, two threads per row.
      row_popc += StageRowPopcount<64, 128, kStageLayout, kWgRows>(smem + s * kWgStageBytes + half_offset, wtid, a_box_log2);
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      if (kb > 0) release((it - 1) % kWgStages);
      if constexpr (kDoubled) {
        if (kb + 1 == p.doubled_k_blocks) {
          asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
          for (int i = 0; i < 128; ++i) acc[i] *= 2;
        }
      }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    release((it - 1) % kWgStages);
    row_popc = CombineRowPopcount<64, 128>(row_popc);
    const int epilogue_wtid = kLayout == ALayout::kSwizzledRows ? FreshThreadIndex() % 128 : wtid;
    if (const int row = RowOfPopcount<64, 128>(epilogue_wtid); row >= 0) popc_a[64 * half + row] = row_popc;
    asm volatile("bar.sync 1, 256;\n" ::: "memory");  // popc_a, row_correction, cols complete; all wgmmas done
    if constexpr (kResidual) {
      StoreStagedResidualTile(p, residual, smem, acc, popc_a, row_correction, cols, div, tile_m, col0, half, ctid, wtid);
      continue;
    }
    if (!staged) {
      // tiles of at most 128 columns (N <= 128, or the last column tile) store half the accumulators
      StoreAccumulators(p, acc, popc_a, row_correction, cols, tile_m, col0, half, epilogue_wtid,
                        p.n - col0 <= kWgCols / 2);
      continue;
    }
    StoreStagedTile(p, smem, origins, popc_a, cols, acc, tile_m, col0, half, ctid, wtid);
  }
  // The partner may still arrive on this CTA's barriers: neither CTA leaves before both are done.
  ClusterSync();
#endif
}

const void* PersistentWgmmaKernelInstance(ALayout layout, int steps, bool residual, bool doubled) {
  if (doubled) {
    const auto kernel = layout == ALayout::kSwizzledRows ? WgmmaKernel<ALayout::kSwizzledRows, 4, false, true>
                        : layout == ALayout::kChunkSlabs ? WgmmaKernel<ALayout::kChunkSlabs, 4, false, true>
                        : layout == ALayout::kTapRows    ? WgmmaKernel<ALayout::kTapRows, 4, false, true>
                                                         : WgmmaKernel<ALayout::kCoreMatrices, 4, false, true>;
    return reinterpret_cast<const void*>(kernel);
  }
  if (residual) {
    const auto kernel = layout == ALayout::kSwizzledRows ? WgmmaKernel<ALayout::kSwizzledRows, 4, true>
                        : layout == ALayout::kChunkSlabs ? WgmmaKernel<ALayout::kChunkSlabs, 4, true>
                        : layout == ALayout::kTapRows    ? WgmmaKernel<ALayout::kTapRows, 4, true>
                                                         : WgmmaKernel<ALayout::kCoreMatrices, 4, true>;
    return reinterpret_cast<const void*>(kernel);
  }
  const auto kernel = layout == ALayout::kSwizzledRows ? WgmmaKernel<ALayout::kSwizzledRows>
                      : layout == ALayout::kChunkSlabs ? WgmmaKernel<ALayout::kChunkSlabs>
                      : layout == ALayout::kTapRows    ? WgmmaKernel<ALayout::kTapRows>
                      : steps == 4                     ? WgmmaKernel<ALayout::kCoreMatrices>
                      : steps == 1                     ? WgmmaKernel<ALayout::kCoreMatrices, 1>
                                                       : WgmmaKernel<ALayout::kCoreMatrices, 3>;
  return reinterpret_cast<const void*>(kernel);
}

}  // namespace jaxbnn::cuda
