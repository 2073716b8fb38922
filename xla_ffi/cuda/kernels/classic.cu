// ---------------------------------------------------------------------------------------------------
// mma.sync and CUDA-core engines: classic multistage cp.async pipeline, all threads load and compute.
#include "cuda/kernels/classic.h"

#include <cstdint>

#include "cuda/binary_gemm.h"
#include "cuda/device/column_parameters.cuh"
#include "cuda/device/common.cuh"
#include "cuda/device/epilogue.cuh"
#include "cuda/device/geometry.cuh"
#include "cuda/device/loaders.cuh"
#include "cuda/device/pipeline.cuh"
#include "cuda/device/tile_columns.cuh"
#include "cuda/device/tile_schedule.cuh"

namespace jaxbnn::cuda {

template <class Engine, int kVec, bool kResidual, bool kDoubled = false>
__global__ void __launch_bounds__(Engine::kThreads, 1) ClassicKernel(const BinaryGemmProblem p,
                                                                      const LaunchDivisors div, int m_tiles,
                                                                      int n_tiles, const ResidualOperands residual) {
  constexpr int kRows = Engine::kRows, kCols = Engine::kCols, kStages = Engine::kStages;
  constexpr int kThreads = Engine::kThreads, kLd = kCols + 4;
  constexpr int kStageA = kRows * 128, kStageBytes = (kRows + kCols) * 128;
  static_assert(kRows * kLd * 4 <= kStages * kStageBytes, "the epilogue tile (StoreDirect: its scratch) reuses the stages");
  extern __shared__ __align__(1024) uint8_t smem[];
  int4* origins = reinterpret_cast<int4*>(smem + kStages * kStageBytes);
  int* popc_a = reinterpret_cast<int*>(origins + kRows);
  auto& cols = *reinterpret_cast<TileColumns<kCols>*>(popc_a + kRows);
  int8_t* row_class = reinterpret_cast<int8_t*>(&cols + 1);  // EpilogueRowClass (StoreDirect)
  const int tid = threadIdx.x;
  int tile_m, tile_n;
  TileCoordinates(blockIdx.x, m_tiles, n_tiles, tile_m, tile_n);
  const int col0 = tile_n * kCols;
  if (tid == 0) {
    const uint32_t bars = SmemAddress(smem) + ClassicBarrierOffset<Engine>();
    for (int s = 0; s < kStages; ++s) {
      BarrierInit(bars + 8 * s, kThreads);                  // "full": every thread, once its copies landed
      BarrierInit(bars + 8 * (kStages + s), kThreads);  // "empty": every thread, once it read the stage
    }
  }
  const bool direct_bits = Engine::kDirectStore && p.pool_h * p.pool_w == 1 && p.epilogue == Epilogue::kBits;
  // The rows' set-up on the last threads, the columns' on the first, and a table's classes split over every
  // thread: on the same few warps, one after the other, they took 2.0 us of a C = 128 tile's 5.7 (1.3 us
  // split; 1.5 -> 1.05 us for BMM; clock64 trace).
  static_assert(kRows <= kThreads, "a thread per row of the set-up");
  if (const int r = tid - (kThreads - kRows); r >= 0) {
    const int4 origin = RowOrigin(p, tile_m, kRows, r);
    origins[r] = origin;
    if (direct_bits) row_class[r] = EpilogueRowClass(p, origin);
  }
  SetUpTileColumns<kCols, kThreads>(p, cols, col0, tid, direct_bits, p.edge_table);
  __syncthreads();

  const uint32_t base = SmemAddress(smem);
  const uint32_t full0 = base + ClassicBarrierOffset<Engine>(), empty0 = full0 + 8 * kStages;
  const int k_blocks = (p.k_words + kKBlockWords - 1) / kKBlockWords;
  const WeightStageLoader<kCols, kThreads> weights(p, col0 / 8, tid);
  auto load = [&](int kb) {
    const uint32_t stage = base + (kb % kStages) * kStageBytes;
    LoadActivationStage<kRows, kVec, kThreads, Engine::kALayout, false, kDoubled>(p, div, origins, stage, kb, tid);
    weights.Load(stage + kStageA, kb);
  };
  for (int s = 0; s < kStages - 1 && s < k_blocks; ++s) {
    load(s);
    BarrierArriveOnCopies(full0 + 8 * s);
  }
  typename Engine::Accumulators acc = {};
  int row_popc = 0;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const int s = kb % kStages;
    BarrierWait(full0 + 8 * s, (kb / kStages) & 1);  // every thread's copies of stage kb landed
    // K block kb + kStages - 1's copies go into the stage that K block kb - 1 used, once every thread has
    // released it (its "empty" barrier): the activations behind step 1's mma, the weights behind step 3's.
    // A warp thus starts a block while others finish the last one. With a CTA barrier per K block instead
    // (and the copies behind steps 0-2), mma.sync at 16384^3 ran 14% slower; with these barriers, copies
    // behind steps 0-2 or 1-3 cost 7% and 5%, and all of them behind step 3 spilled registers.
    const bool loads = kb + kStages - 1 < k_blocks;
    const int ns = (kb + kStages - 1) % kStages;
    const uint32_t next = base + ns * kStageBytes;
    Engine::Compute(acc, smem + s * kStageBytes, base + s * kStageBytes, tid, [&](int ks) {
      if (!loads) return;
      if (ks == 1) {
        if (kb >= 1) BarrierWait(empty0 + 8 * ns, ((kb - 1) / kStages) & 1);
        LoadActivationStage<kRows, kVec, kThreads, Engine::kALayout, false, kDoubled>(p, div, origins, next,
                                                                                    kb + kStages - 1, tid);
      }
      if (ks == 3) {
        weights.Load(next + kStageA, kb + kStages - 1);
        BarrierArriveOnCopies(full0 + 8 * ns);
      }
    });
    row_popc += StageRowPopcount<kRows, kThreads, Engine::kALayout>(smem + s * kStageBytes, tid);
    if constexpr (kDoubled) {
      if (kb + 1 == p.doubled_k_blocks) acc.Double();
    }
    // Every thread arrives: with one arrival per warp after __syncwarp, compute-sanitizer's racecheck
    // reported the other lanes' reads as racing with the next fill's copies.
    BarrierArrive(empty0 + 8 * s);
  }
  row_popc = CombineRowPopcount<kRows, kThreads>(row_popc);
  if (const int row = RowOfPopcount<kRows, kThreads>(tid); row >= 0) popc_a[row] = row_popc;
  if constexpr (Engine::kDirectStore) {
    if (p.pool_h * p.pool_w == 1) {
      __syncthreads();
      if constexpr (kResidual) {
        if (NarrowStream(p)) {
          Engine::template StoreDirectResidual<true>(acc, p, residual, popc_a, origins, cols, tile_m, col0, tid);
        } else {
          Engine::template StoreDirectResidual<false>(acc, p, residual, popc_a, origins, cols, tile_m, col0, tid);
        }
      } else {
        Engine::StoreDirect(acc, p, popc_a, origins, row_class, reinterpret_cast<int*>(smem), cols, tile_m, col0, tid);
      }
      return;
    }
  }
  __syncthreads();
  int* acc_tile = reinterpret_cast<int*>(smem);
  Engine::Store(acc, acc_tile, kLd, tid);
  __syncthreads();
  if constexpr (kResidual) {
    if (NarrowStream(p)) {
      StoreResidualTile<kRows, kCols, kLd, kThreads, true>(p, residual, acc_tile, popc_a, cols, origins, tile_m, col0,
                                                           tid);
    } else {
      StoreResidualTile<kRows, kCols, kLd, kThreads, false>(p, residual, acc_tile, popc_a, cols, origins, tile_m, col0,
                                                            tid);
    }
  } else {
    StoreTile<kRows, kCols, kLd, kThreads>(p, acc_tile, popc_a, cols, origins, tile_m, col0, tid);
  }
}

template <class Engine>
const void* ClassicKernelInstance(bool aligned, bool residual, bool doubled) {
  if (doubled) {
    return reinterpret_cast<const void*>(aligned ? ClassicKernel<Engine, 4, false, true>
                                                 : ClassicKernel<Engine, 1, false, true>);
  }
  return reinterpret_cast<const void*>(
      residual ? (aligned ? ClassicKernel<Engine, 4, true> : ClassicKernel<Engine, 1, true>)
               : (aligned ? ClassicKernel<Engine, 4, false> : ClassicKernel<Engine, 1, false>));
}
template const void* ClassicKernelInstance<MmaSyncNarrow>(bool, bool, bool);
template const void* ClassicKernelInstance<MmaSyncWide>(bool, bool, bool);
template const void* ClassicKernelInstance<SimtEngine>(bool, bool, bool);

}  // namespace jaxbnn::cuda
