// The dense-tap kernel: convolutions of at most 32 channels (UsesDenseTaps) on the mma.sync engine.
#include "cuda/kernels/dense_taps.h"

#include <cstdint>

#include "cuda/binary_gemm.h"
#include "cuda/device/border.cuh"
#include "cuda/device/column_parameters.cuh"
#include "cuda/device/common.cuh"
#include "cuda/device/epilogue.cuh"
#include "cuda/device/geometry.cuh"
#include "cuda/device/loaders.cuh"
#include "cuda/device/pipeline.cuh"
#include "cuda/device/threshold_bits.cuh"
#include "cuda/device/tile_columns.cuh"

namespace jaxbnn::cuda {

// The k256 steps of a dense-tap K block: 8 words each.
__device__ __forceinline__ int DenseTapSteps(const BinaryGemmProblem& p) { return (p.kh * p.kw * p.c + 255) / 256; }

// Packs the C low bits of every tap's word in order, least significant bit first, then zeros: filter_row(fkh)
// returns the filter row's tap reader (its set-up once a filter row), whose call with fkw returns the word of
// tap (fkh, fkw); store(j, word) receives words 0 .. `words` - 1. Returns the popcount of the stored words.
template <class FilterRow, class Store>
__device__ __forceinline__ int PackDenseTaps(const BinaryGemmProblem& p, int words, FilterRow&& filter_row, Store&& store) {
  const uint32_t mask = ~0u >> (32 - p.c);  // C in 1 .. 32
  uint64_t pending = 0;  // gathered bits not yet stored, the next one at bit `bits`
  int bits = 0, word = 0, popc = 0;
  auto put = [&](uint32_t w) {
    store(word++, w);
    popc += __popc(w);
  };
  const int row_width = p.kw * p.c;
  for (int fkh = 0; fkh < p.kh; ++fkh) {
    const auto tap_word = filter_row(fkh);
    if (row_width <= 32) {
      // a filter row's bits fit one word (7x7 at C = 3: 21): its taps are gathered in 32 bits, and the word
      // store's test and block run once a filter row instead of once a tap, where they were ~12 of ~26
      // instructions
      uint32_t row_bits = 0;
      int shift = 0;
#pragma unroll 4
      for (int fkw = 0; fkw < p.kw; ++fkw, shift += p.c) row_bits |= (tap_word(fkw) & mask) << shift;
      pending |= static_cast<uint64_t>(row_bits) << bits;
      bits += row_width;
      if (bits >= 32) {
        put(static_cast<uint32_t>(pending));
        pending >>= 32;
        bits -= 32;
      }
      continue;
    }
#pragma unroll 4
    for (int fkw = 0; fkw < p.kw; ++fkw) {
      pending |= static_cast<uint64_t>(tap_word(fkw) & mask) << bits;
      bits += p.c;
      if (bits >= 32) {
        put(static_cast<uint32_t>(pending));
        pending >>= 32;
        bits -= 32;
      }
    }
  }
  if (bits > 0) put(static_cast<uint32_t>(pending));
  while (word < words) put(0u);
  return popc;
}

// The popcount of a row's first `chunks` 16-byte chunks of K words (swizzled by `swizzle`), read back.
__device__ __forceinline__ int ChunksPopcount(const uint8_t* row_words, int swizzle, int chunks) {
  int popc = 0;
#pragma unroll
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const uint4 v = *reinterpret_cast<const uint4*>(row_words + ((16 * chunk) ^ swizzle));
    popc += __popc(v.x) + __popc(v.y) + __popc(v.z) + __popc(v.w);
  }
  return popc;
}

// Whole-word taps (C = 32, where the gather is the word layout itself): row r's K block of `words` words at
// `row_words` (swizzled by `swizzle`) by one 4-byte cp.async a tap, zero-filled outside the frame, zeros past
// the last tap; then the row's popcount, read back. Every copy is in flight at once: in PackDenseTaps each
// load waited for its use before the next one issued (15% of the kernel's stall samples, its gather a third,
// at MNIST conv's 64C3, batch 1024; ncu). Returns the popcount of the row's words.
//
// kKh x kKw: a filter size fixed at compile time (0 x 0: the problem's), for which the taps unroll: a tap is a
// copy from its filter row's base at a constant offset, predicated on its row's and column's frame tests, and
// the zeros past the taps and the popcounts are whole chunks where they can be. The runtime form took ~400 of
// the kernel's ~1,030 instructions a warp a tile at MNIST conv's 64C3 (ncu, source lines), ~18 a tap.
template <int kKh, int kKw>
__device__ __forceinline__ int GatherWholeWordTaps(const BinaryGemmProblem& p, int words, const int4& o,
                                                   uint8_t* row_words, int swizzle) {
  const uint32_t row_address = SmemAddress(row_words);
  if constexpr (kKh > 0) {
    constexpr int kTaps = kKh * kKw, kWords = 8 * ((kTaps + 7) / 8);  // whole k256 steps (DenseTapSteps at C = 32)
    bool column_in[kKw];
#pragma unroll
    for (int fkw = 0; fkw < kKw; ++fkw) column_in[fkw] = static_cast<unsigned>(o.z + fkw) < static_cast<unsigned>(p.in_w);
#pragma unroll
    for (int fkh = 0; fkh < kKh; ++fkh) {
      const bool row_in = o.w && static_cast<unsigned>(o.y + fkh) < static_cast<unsigned>(p.in_h);
      // the filter row's first tap where the row is in frame (a tap outside the frame copies no byte: src-size 0),
      // else the tensor's first word
      const uint32_t* taps = p.x + (row_in ? o.x + fkh * p.in_w : 0);
#pragma unroll
      for (int fkw = 0; fkw < kKw; ++fkw) {
        const int t = fkh * kKw + fkw;
        CopyAsync<4>(row_address + ((4 * t) ^ swizzle), taps + fkw, row_in && column_in[fkw]);
      }
    }
    constexpr int kZeroChunk = (kTaps + 3) / 4;  // the first chunk past the taps
#pragma unroll
    for (int t = kTaps; t < 4 * kZeroChunk; ++t) *reinterpret_cast<uint32_t*>(row_words + ((4 * t) ^ swizzle)) = 0u;
#pragma unroll
    for (int chunk = kZeroChunk; chunk < kWords / 4; ++chunk) {
      *reinterpret_cast<uint4*>(row_words + ((16 * chunk) ^ swizzle)) = make_uint4(0u, 0u, 0u, 0u);
    }
    CopyAsyncWaitAll();
    return ChunksPopcount(row_words, swizzle, kZeroChunk);  // the chunks past the taps are zeros
  } else {
    int t = 0;
    for (int fkh = 0; fkh < p.kh; ++fkh) {
      const bool row_in = o.w && static_cast<unsigned>(o.y + fkh) < static_cast<unsigned>(p.in_h);
      const uint32_t* taps = p.x + (o.x + fkh * p.in_w);
#pragma unroll 4
      for (int fkw = 0; fkw < p.kw; ++fkw, ++t) {
        const bool in = row_in && static_cast<unsigned>(o.z + fkw) < static_cast<unsigned>(p.in_w);
        CopyAsync<4>(row_address + ((4 * t) ^ swizzle), in ? taps + fkw : p.x, in);
      }
    }
    for (; t < words; ++t) *reinterpret_cast<uint32_t*>(row_words + ((4 * t) ^ swizzle)) = 0u;
    CopyAsyncWaitAll();
    return ChunksPopcount(row_words, swizzle, words / 4);
  }
}

// Column c's 2-D prefix sums of its tap terms C - 2 popc_tap (0 past N), built once per CTA:
// prefix[(i (kw + 1) + j) kCols + c] sums the taps (i', j') with i' < i, j' < j.
template <int kCols>
__device__ __forceinline__ void BuildDenseBorderPrefix(const BinaryGemmProblem& p, int16_t* prefix, int col0, int c) {
  const int side = p.kw + 1, col = col0 + c;
  for (int j = 0; j < side; ++j) prefix[j * kCols + c] = 0;
  for (int i = 0; i < p.kh; ++i) {
    int row_sum = 0;
    prefix[((i + 1) * side) * kCols + c] = 0;
#pragma unroll 4
    for (int j = 0; j < p.kw; ++j) {
      row_sum += col < p.n ? p.c - 2 * p.tap_popc[(i * p.kw + j) * p.n + col] : 0;
      prefix[((i + 1) * side + j + 1) * kCols + c] = static_cast<int16_t>(prefix[(i * side + j + 1) * kCols + c] + row_sum);
    }
  }
}

// A field's out-of-frame sum (of C - 2 popc_tap) for DenseBorderRowBounds where it has no prefix sums: from
// the edge table; a corner field whose block the table lacks (AlexNet's conv1: 49 corner blocks) takes its
// row and column strips less the block, summed from at most (top + bottom) x (left + right) taps' popcounts
// (16 there, not ExcludedTapsOf's loop over all 121); without the edge table (a filter larger than the
// frame), ExcludedTapsOf.
template <int kCols>
__device__ __forceinline__ int DenseExcludedTaps(const BinaryGemmProblem& p, const TileColumns<kCols>& cols,
                                                 FrameExcess e, int lc, int col) {
  if (col >= p.n) return 0;  // the column's bound is unreachable
  const EdgeRowsOfField edge = EdgeRowsOf(p, e);
  if (edge.usable) return EdgeCorrection(cols, edge, lc);
  if (!p.edge_table) return ExcludedTapsOf(p, cols, e, lc, col);
  const int strips = EdgeCorrection(cols, EdgeRowsOf(p, {e.top, e.bottom, 0, 0}), lc) +
                     EdgeCorrection(cols, EdgeRowsOf(p, {0, 0, e.left, e.right}), lc);
  const int i0 = e.top > 0 ? 0 : p.kh - e.bottom, i1 = e.top > 0 ? e.top : p.kh;
  const int j0 = e.left > 0 ? 0 : p.kw - e.right, j1 = e.left > 0 ? e.left : p.kw;
  int block = 0;
  for (int i = i0; i < i1; ++i) {
    for (int j = j0; j < j1; ++j) block += p.c - 2 * p.tap_popc[(i * p.kw + j) * p.n + col];
  }
  return strips - block;
}

// The dense-tap kernel's border rows (no class table: 7x7 at stride 2 has 144 excess classes, the table takes
// 25): every border row's bounds in StoreDirectBits' scratch rows, in BorderRowBounds' form. Warp w takes rows
// w, w + kWarps, ...: a ballot of their classes, then a border row at a time, a column pair a lane (the rows
// and pairs of a loop over every (row, column pair) that tested each row's class took ~130 instructions a
// warp a tile at MNIST conv's 64C3, where a seventh of the rows are border rows). Up to 7x7 from the prefix
// sums, four reads per row and column (BorderRowBounds loaded every excluded tap's popcount for every column
// of a border row: at ResNet-18's conv1, batch 256, that took 2.5 of the dense kernel's 3.4 ms); larger
// filters from the edge table (DenseExcludedTaps; kEdgeBorders). Called by every thread of the CTA.
template <class Engine, bool kEdgeBorders>
__device__ __forceinline__ void DenseBorderRowBounds(const BinaryGemmProblem& p, const TileColumns<Engine::kCols>& cols,
                                                     const int16_t* prefix, const int4* origins,
                                                     const int8_t* row_class, int* scratch, int col0, int tid) {
  constexpr int kRows = Engine::kRows, kCols = Engine::kCols, kWarps = Engine::kThreads / 32;
  static_assert(kRows % (32 * kWarps) == 0 && kCols % 2 == 0, "whole ballots of rows, column pairs");
  const int side = p.kw + 1, warp = tid / 32, lane = tid % 32;
  auto corner = [&](int i, int j, int lc) -> int { return prefix[(i * side + j) * kCols + lc]; };
  for (int group = 0; group < kRows / (32 * kWarps); ++group) {
    const int first = group * 32 * kWarps + warp;  // the group's rows first + kWarps i, i < 32
    uint32_t border = __ballot_sync(0xffffffffu, row_class[first + kWarps * lane] != 0);
    while (border != 0) {
      const int r = first + kWarps * (__ffs(border) - 1);
      border &= border - 1;
      const int4 o = origins[r];
      const FrameExcess e = ExcessOf(p, o.y, o.z);
      const int i0 = e.top, i1 = p.kh - e.bottom, j0 = e.left, j1 = p.kw - e.right;
      for (int lc = 2 * lane; lc < kCols; lc += 64) {
        int bound[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          int excluded;
          if constexpr (kEdgeBorders) {
            excluded = DenseExcludedTaps(p, cols, e, lc + k, col0 + lc + k);
          } else {
            const int inside =
                corner(i1, j1, lc + k) - corner(i0, j1, lc + k) - corner(i1, j0, lc + k) + corner(i0, j0, lc + k);
            excluded = corner(p.kh, p.kw, lc + k) - inside;
          }
          const int plain = cols.bound[lc + k];  // columns past N keep their unreachable bound
          bound[k] = plain == kUnreachableBound ? plain : plain + excluded;
        }
        StoreRowBounds(p, scratch + r * kCols, lc, bound[0], bound[1]);
      }
    }
  }
}

// The dense-tap kernel: persistent CTAs of 4 warps (128 x 64 tiles in MmaSyncDenseTaps' engine), three an SM,
// so that one CTA's gather runs under the others' mma and epilogues. CTA b keeps column tile b /
// ctas_per_column: its parameters, gathered weights (thread c: column c) and border prefix sums are set up
// once, then it takes row tiles b % ctas_per_column, + ctas_per_column, ...: thread r gathers row r into the
// K block and counts its bits, one mma.sync pass of DenseTapSteps steps, the engine's epilogues. One tile a
// CTA re-gathered the weights in every tile (0.27 of 0.95 ms at ResNet-18's conv1 with "one" padding) and
// rebuilt the prefix sums. kEdgeBorders: the instance for the problems whose border rows come from
// the edge table (DenseBorderBounds but not DensePrefixSums); the other one has none of that code, which in one
// instance for both cost ResNet-18's conv1 1.5%. kResidual: the residual epilogue's instance.
template <class Engine, bool kEdgeBorders, bool kResidual>
__global__ void __launch_bounds__(Engine::kThreads, kDenseTapCtasPerSm)
    DenseTapKernel(const BinaryGemmProblem p, const LaunchDivisors div, int m_tiles, int ctas_per_column,
                   const ResidualOperands residual) {
  constexpr int kRows = Engine::kRows, kCols = Engine::kCols, kThreads = Engine::kThreads;
  using Smem = DenseTapSmem<Engine>;
  static_assert(kRows == kThreads && kCols <= kThreads, "a thread per row and per column");
  extern __shared__ __align__(1024) uint8_t smem[];
  int4* origins = reinterpret_cast<int4*>(smem + Engine::kStages * Smem::kStage);
  int* popc_a = reinterpret_cast<int*>(origins + kRows);
  auto& cols = *reinterpret_cast<TileColumns<kCols>*>(popc_a + kRows);
  int8_t* row_class = reinterpret_cast<int8_t*>(&cols + 1);
  int16_t* prefix = reinterpret_cast<int16_t*>(smem + Smem::kPrefix);
  uint8_t* stage = smem + Smem::kStage;
  int* scratch = reinterpret_cast<int*>(smem);
  const int tid = threadIdx.x;
  const int col0 = (blockIdx.x / ctas_per_column) * kCols;
  const int steps = DenseTapSteps(p);
  const bool direct_bits = p.pool_h * p.pool_w == 1 && p.epilogue == Epilogue::kBits;
  const bool prefix_sums = !kEdgeBorders && DensePrefixSums<Engine>(p), border_bounds = kEdgeBorders || prefix_sums;

  SetUpTileColumns<kCols, kThreads>(p, cols, col0, tid, direct_bits, p.edge_table && !prefix_sums);
  if (tid < kCols) {
    const int c = tid, n = col0 + tid;
    // FSB tiles: K word t (= tap t, one word per tap) of column n; columns past N stay zero
    const uint32_t* w = p.w + static_cast<size_t>(n / 8) * p.w_k_tiles * 32 + (n % 8) * 4;
    PackDenseTaps(
        p, 8 * steps,
        [&](int fkh) {
          return [&, fkh](int fkw) -> uint32_t {
            const int t = fkh * p.kw + fkw;
            return n < p.n ? __ldg(w + (t / 4) * 32 + t % 4) : 0u;
          };
        },
        [&](int j, uint32_t word) {
          *reinterpret_cast<uint32_t*>(smem + Smem::kWeights + StageOffset(c, j / 4) + (j % 4) * 4) = word;
        });
    if (prefix_sums) BuildDenseBorderPrefix<kCols>(p, prefix, col0, c);
  }

  // row r (thread r in every tile): its place in its pool window, and its K block's line in A
  static_assert(Engine::kALayout == ALayout::kSwizzledRows, "A's rows are 128-byte swizzled lines");
  const int r = tid;
  const WindowRow window_row = WindowRowOf(p, kRows, r);
  const int pooled_per_tile = kRows / (p.pool_h * p.pool_w);
  uint8_t* row_words = stage + r * 128;
  const int swizzle = (r % 8) * 16;
  for (int tile_m = blockIdx.x % ctas_per_column; tile_m < m_tiles; tile_m += ctas_per_column) {
    // row r: its origin, class and K block (every word the k loop reads, zeros past the taps), and its bits.
    // Below 32 channels the gather is most of the kernel's instructions (84% at ResNet-18's conv1, ncu): a
    // filter row's address and frame test are set up once, a tap's frame test is one compare (the columns in
    // frame are a range), and a word's place in A's swizzled rows, ChunkOffset(r, j / 4) + (j % 4) * 4, is
    // one XOR. The origin comes from the launch's divisors: RowOrigin's runtime divisions took ~220 of a
    // warp's ~1,150 instructions a tile at MNIST conv's 64C3 (ncu).
    const int4 o = RowOrigin(p, div, window_row, tile_m, pooled_per_tile);
    origins[r] = o;
    if (direct_bits) row_class[r] = EpilogueRowClass(p, o);
    if (p.c == 32) {
      popc_a[r] = p.kh == 3 && p.kw == 3 ? GatherWholeWordTaps<3, 3>(p, 8 * steps, o, row_words, swizzle)
                                         : GatherWholeWordTaps<0, 0>(p, 8 * steps, o, row_words, swizzle);
    } else {
      const int first_in = max(0, -o.z);
      const unsigned in_count = max(0, min(p.kw, p.in_w - o.z) - first_in);
      popc_a[r] = PackDenseTaps(
          p, 8 * steps,
          [&](int fkh) {
            const unsigned row_count = o.w && static_cast<unsigned>(o.y + fkh) < static_cast<unsigned>(p.in_h) ? in_count : 0;
            // tap (fkh, 0) (outside the frame at its left border), opaque to the compiler: it otherwise rebuilt the
            // 64-bit address of every tap from the ints (four instructions and a reload of p.x)
            const uint32_t* taps;
            asm("mov.b64 %0, %1;\n" : "=l"(taps) : "l"(p.x + (o.x + fkh * p.in_w)));
            return [=](int fkw) -> uint32_t {
              return static_cast<unsigned>(fkw - first_in) < row_count ? __ldg(taps + fkw) : 0u;
            };
          },
          [&](int j, uint32_t word) { *reinterpret_cast<uint32_t*>(row_words + ((4 * j) ^ swizzle)) = word; });
    }
    __syncthreads();
    typename Engine::Accumulators acc = {};
    Engine::Compute(acc, stage, SmemAddress(stage), tid, [](int) {}, steps);
    if constexpr (kResidual) {  // (unpooled)
      if (NarrowStream(p)) {
        Engine::template StoreDirectResidual<true>(acc, p, residual, popc_a, origins, cols, tile_m, col0, tid);
      } else {
        Engine::template StoreDirectResidual<false>(acc, p, residual, popc_a, origins, cols, tile_m, col0, tid);
      }
    } else if (p.pool_h * p.pool_w == 1) {
      // every thread passes the barrier; the tile's border rows decide whether their bounds are filled
      if (__syncthreads_or(border_bounds && row_class[tid] != 0)) {
        DenseBorderRowBounds<Engine, kEdgeBorders>(p, cols, prefix, origins, row_class, scratch, col0, tid);
        __syncthreads();
        Engine::template StoreDirect<true>(acc, p, popc_a, origins, row_class, scratch, cols, tile_m, col0, tid);
      } else {
        Engine::StoreDirect(acc, p, popc_a, origins, row_class, scratch, cols, tile_m, col0, tid);
      }
    } else {
      __syncthreads();
      Engine::Store(acc, scratch, kCols + 4, tid);
      __syncthreads();
      StoreTile<kRows, kCols, kCols + 4, kThreads>(p, scratch, popc_a, cols, origins, tile_m, col0, tid);
    }
    __syncthreads();  // the next tile's rows overwrite origins, popc_a and A, which the epilogue read
  }
}

const void* DenseTapKernelInstance(bool edge_borders, bool residual) {
  return residual       ? reinterpret_cast<const void*>(DenseTapKernel<MmaSyncDenseTaps, false, true>)
         : edge_borders ? reinterpret_cast<const void*>(DenseTapKernel<MmaSyncDenseTaps, true, false>)
                        : reinterpret_cast<const void*>(DenseTapKernel<MmaSyncDenseTaps, false, false>);
}

}  // namespace jaxbnn::cuda
