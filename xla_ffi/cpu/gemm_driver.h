// The implicit GEMM driver of the CPU bit kernels (binary, ternary and mixed products).
//
// A task packs a "panel" of up to kPanelRows reduction rows (rows of a matrix, or the receptive fields of a
// few output pixels gathered straight from the NHWC image: no im2col tensor is ever materialized) and runs
// a panel kernel over a block of output columns whose weights stay in L2; fused max-pool takes the max of
// the dots of a window's rows before the epilogue writes them. Panels are packed for the kernels in groups
// of 8 rows, chunk-major (popcount_kernels.h), with the bit planes of an operand side by side in each chunk.
#ifndef JAXBNN_XLA_FFI_CPU_GEMM_DRIVER_H_
#define JAXBNN_XLA_FFI_CPU_GEMM_DRIVER_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/checks.h"
#include "common/formats.h"
#include "cpu/epilogue.h"
#include "cpu/parallel_for.h"
#include "cpu/popcount_kernels.h"

namespace jaxbnn::cpu::gemm {

using formats::CeilDiv;

inline constexpr int64_t kTileRows = 8;         // the kernels' tile: 8 rows x 128 bits
inline constexpr int64_t kChunkWords = 4;       // 128 bits
inline constexpr int64_t kTileChunkWords = 32;  // one 8 x 128-bit tile
inline constexpr int64_t kWordBits = formats::kWordBits;
// Reduction rows packed at once: 64 rather than 16 spreads a task's set-up (origins, scratch, dispatch) over
// 4x the rows: -6 to -10% on mnist-conv's 3x3 layers at batch 256, no change at batch 1 or on the TNN layers
// of ResNet-18, whose 64-row panel (3x3 x 512 channels, two planes: 74 KB) outgrows L1 (decisions.md).
inline constexpr int64_t kPanelRows = 64;
inline constexpr int64_t kWeightBlockBytes = 256 * 1024;  // weights swept by one task (fits L2)
// chunk x tile-row products worth a thread hop (~2 x 512 XOR-popcounts each in a binary product, more in a
// ternary or mixed one): about 3 us of one core's work for a panel of one row, whose weights are swept for that
// row alone (mnist-conv's 6272 -> 256 dense layer at batch 1, 1,568 of them, takes ~4 us). Run serial, that
// dense layer made mnist-conv's whole forward at batch 1 take 46-48 us instead of 38-39 (decisions.md).
inline constexpr int64_t kMinParallelWork = 1536;

#if defined(__GNUC__)
#define JAXBNN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define JAXBNN_ALWAYS_INLINE inline
#endif

inline int64_t RoundUp(int64_t value, int64_t multiple) { return CeilDiv(value, multiple) * multiple; }

// Where a conv panel row reads the image: image b, top-left input coordinate (y0, x0) of its receptive field.
struct RowOrigin {
  int64_t b, y0, x0;
};

// Per-thread scratch, reused across calls.
struct Scratch {
  std::vector<uint32_t> panel;     // packed panel words
  std::vector<uint32_t> line;      // one conv panel row, each of its planes contiguous
  std::vector<int32_t> row_term;   // per panel row: its term of the dot products (e.g. the elements that count)
  std::vector<uint8_t> excluded;   // per panel row: some taps are out of frame and excluded ("zero" padding)
  std::vector<RowOrigin> origins;  // per conv panel row
  std::vector<int32_t> dots;       // panel rows x a strip's columns
  std::vector<const uint32_t*> row_base;     // per lane kernel row: where its words are read
  std::vector<const int64_t*> row_offsets;   // per lane kernel row: its words' offsets from there
  std::vector<const int32_t*> row_correction;  // per lane kernel row: its correction row, or null
  std::vector<int64_t> correction_index;     // per lane kernel row: its correction row's index, or -1
  std::vector<int64_t> correction_keys;      // per correction row: the in-frame tap rectangle it is for (4 each)
  std::vector<int32_t> corrections;          // correction rows of a task, n columns each
  std::vector<uint8_t> tables;               // per table kernel row: its nibbles' tables (popcount_kernels.h)
};

// At least `size` elements; never shrinks, so that alternating task sizes do not re-initialize memory.
template <class T>
T* Grow(std::vector<T>& vector, int64_t size) {
  if (static_cast<int64_t>(vector.size()) < size) vector.resize(size);
  return vector.data();
}

inline Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Rows [first_row, first_row + rows) of FSB weights in the kernels' tile (rows/8, chunks, 8, 4): the tiles
// themselves where they already are that (default tile, first_row a multiple of 8), else a copy in
// `storage`. Bits past the matrix stay 0 (and are masked anyway).
inline const uint32_t* KernelTiles(const uint32_t* tiles, int64_t first_row, int64_t rows, int64_t k_words,
                                   int64_t tile_rows, int64_t tile_words, int64_t k_tiles,
                                   std::vector<uint32_t>& storage) {
  const int64_t chunks = CeilDiv(k_words, kChunkWords);
  if (tile_rows == kTileRows && tile_words == kChunkWords && first_row % kTileRows == 0) {
    return tiles + first_row / kTileRows * chunks * kTileChunkWords;
  }
  storage.assign(CeilDiv(rows, kTileRows) * chunks * kTileChunkWords, 0);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t src_row = first_row + row;
    const uint32_t* src_tile_row = tiles + (src_row / tile_rows) * k_tiles * tile_rows * tile_words;
    uint32_t* dst_tile_row = storage.data() + (row / kTileRows) * chunks * kTileChunkWords;
    for (int64_t word = 0; word < k_words; ++word) {
      dst_tile_row[(word / kChunkWords) * kTileChunkWords + (row % kTileRows) * kChunkWords + word % kChunkWords] =
          src_tile_row[((word / tile_words) * tile_rows + src_row % tile_rows) * tile_words + word % tile_words];
    }
  }
  return storage.data();
}

// The kernels' tiles of output columns [0, rows) (KernelTiles) as a lane kernel reads them (popcount_kernels.h,
// LaneDotsFn): (ceil(rows / 8), k_words, 2, 8), in `storage`: word k of a tile row's 8 columns as its low nibbles
// (w & 0x0f0f0f0f) then its high nibbles ((w >> 4) & 0x0f0f0f0f), the bits outside the reduction cleared with
// `weight_mask` (null: every bit counts) first.
inline const uint32_t* LaneTiles(const uint32_t* kernel_tiles, int64_t rows, int64_t k_words,
                                 const uint32_t* weight_mask, std::vector<uint32_t>& storage) {
  const int64_t chunks = CeilDiv(k_words, kChunkWords), tiles = CeilDiv(rows, kTileRows);
  storage.resize(tiles * k_words * kLaneWordNibbles * kTileRows);
  for (int64_t t = 0; t < tiles; ++t) {
    const uint32_t* tile_row = kernel_tiles + t * chunks * kTileChunkWords;
    for (int64_t word = 0; word < k_words; ++word) {
      const uint32_t mask = weight_mask == nullptr ? ~0u : weight_mask[word];
      const uint32_t* chunk = tile_row + (word / kChunkWords) * kTileChunkWords + word % kChunkWords;
      uint32_t* lanes = storage.data() + (t * k_words + word) * kLaneWordNibbles * kTileRows;
      for (int64_t i = 0; i < kTileRows; ++i) {
        const uint32_t w = chunk[i * kChunkWords] & mask;
        lanes[i] = w & kLowNibbles;
        lanes[kTileRows + i] = (w >> 4) & kLowNibbles;
      }
    }
  }
  return storage.data();
}

// One bit plane of one reduction row of a packed panel of kPlanes planes being filled: word w of the plane
// lies at base[(w / 4) * 8 * kPlanes * 4 + w % 4].
template <int kPlanes = 1>
class PanelRow {
 public:
  PanelRow(uint32_t* panel, int64_t chunks, int64_t row, int plane = 0)
      : base_(panel +
              (((row / kGroupRows) * chunks * kGroupRows + row % kGroupRows) * kPlanes + plane) * kChunkWords) {}

  // Words [0, count) from src, the last one ANDed with last_mask (clears the padding bits of a row), then
  // zeros to the end of the row's `chunks` chunks.
  JAXBNN_ALWAYS_INLINE void Put(const uint32_t* src, int64_t count, uint32_t last_mask, int64_t chunks) const {
    const int64_t whole = count / kChunkWords * kChunkWords;
    for (int64_t i = 0; i < whole; i += kChunkWords) std::memcpy(At(i), src + i, kChunkWords * 4);
    for (int64_t i = whole; i < chunks * kChunkWords; ++i) *At(i) = i < count ? src[i] : 0;
    if (count > 0) *At(count - 1) &= last_mask;
  }

  // `runs` runs of `run` words back to back from word 0, run i read from src + i * stride (a receptive field
  // wholly in frame, straight from the image's rows), then zeros to the end of the row's `chunks` chunks.
  JAXBNN_ALWAYS_INLINE void PutRuns(const uint32_t* src, int64_t stride, int64_t runs, int64_t run,
                                    int64_t chunks) const {
    int64_t word = 0;
    for (int64_t i = 0; i < runs; ++i, src += stride) {
      for (int64_t j = 0; j < run; ++j, ++word) *At(word) = src[j];
    }
    for (; word < chunks * kChunkWords; ++word) *At(word) = 0;
  }

  // PutRuns of a 3 x 3 field of c_words whole channel words a tap, for a row of ceil(9 c_words / 4) chunks, where
  // c_words is 1, 2, 4, 8 or 16: unrolled, every address a constant offset (mnist-conv batch 256 -10% a forward,
  // decisions.md). False, nothing written, for other widths.
  JAXBNN_ALWAYS_INLINE bool PutThreeByThree(const uint32_t* src, int64_t stride, int64_t c_words) const {
    switch (c_words) {
      case 1: PutRunsFixed<3, 3>(src, stride); return true;
      case 2: PutRunsFixed<3, 6>(src, stride); return true;
      case 4: PutRunsFixed<3, 12>(src, stride); return true;
      case 8: PutRunsFixed<3, 24>(src, stride); return true;
      case 16: PutRunsFixed<3, 48>(src, stride); return true;
      default: return false;
    }
  }

 private:
  template <int64_t kRuns, int64_t kRun>
  JAXBNN_ALWAYS_INLINE void PutRunsFixed(const uint32_t* src, int64_t stride) const {
    constexpr int64_t kWords = kRuns * kRun, kChunks = (kWords + kChunkWords - 1) / kChunkWords;
#pragma GCC unroll 16
    for (int64_t i = 0; i < kRuns; ++i) {
#pragma GCC unroll 48
      for (int64_t j = 0; j < kRun; ++j) *At(i * kRun + j) = src[i * stride + j];
    }
#pragma GCC unroll 16
    for (int64_t word = kWords; word < kChunks * kChunkWords; ++word) *At(word) = 0;
  }

  JAXBNN_ALWAYS_INLINE uint32_t* At(int64_t word) const {
    return base_ + (word / kChunkWords) * kGroupRows * kPlanes * kChunkWords + word % kChunkWords;
  }

  uint32_t* base_;
};

// Mask of the bits of a chunked row that belong to the reduction, or empty when that is every bit: the
// weights may hold anything in the others.
inline std::vector<uint32_t> WeightMask(int64_t chunks, int64_t runs, int64_t run_words, int64_t run_bits) {
  if (run_bits % kWordBits == 0 && runs * run_words == chunks * kChunkWords) return {};
  std::vector<uint32_t> mask(chunks * kChunkWords, 0u);
  for (int64_t run = 0; run < runs; ++run) {
    for (int64_t word = 0; word < run_words; ++word) {
      mask[run * run_words + word] = word + 1 == run_words ? formats::LastWordMask(run_bits) : ~0u;
    }
  }
  return mask;
}

// The receptive fields of a convolution's panel rows: panel row (o * window + wy * pool_w + wx) is the conv
// output pixel (oy * pool_h + wy, ox * pool_w + wx) of pooled output o. Tap t = dy * kw + dx occupies words
// [t * c_words, (t + 1) * c_words) of a row, as in the weight matrix.
struct ConvWindows {
  const Bconv2dProblem& p;

  bool InFrame(int64_t iy, int64_t ix) const { return iy >= 0 && iy < p.height && ix >= 0 && ix < p.width; }
  // Every tap of the receptive field at `origin` is in frame.
  bool FieldInFrame(const RowOrigin& origin) const {
    return origin.y0 >= 0 && origin.y0 + p.kh <= p.height && origin.x0 >= 0 && origin.x0 + p.kw <= p.width;
  }
  // The kw taps of kernel row dy are all in frame (and contiguous in the image and in a panel row).
  bool RowInFrame(const RowOrigin& origin, int64_t dy) const {
    const int64_t iy = origin.y0 + dy;
    return iy >= 0 && iy < p.height && origin.x0 >= 0 && origin.x0 + p.kw <= p.width;
  }
  int64_t Pixel(int64_t b, int64_t iy, int64_t ix) const { return (b * p.height + iy) * p.width + ix; }
  int64_t PixelOffset(int64_t b, int64_t iy, int64_t ix) const { return Pixel(b, iy, ix) * p.c_words; }

  // Origins of the panel rows of outputs [first, first + count), stepping through the pixels (divisions
  // only for the first one: they would cost more than gathering a row).
  void Origins(int64_t first, int64_t count, RowOrigin* origins) const {
    int64_t b = first / (p.out_h * p.out_w);
    int64_t oy = first % (p.out_h * p.out_w) / p.out_w, ox = first % p.out_w;
    for (int64_t o = 0; o < count; ++o) {
      for (int64_t wy = 0; wy < p.pool_h; ++wy) {
        for (int64_t wx = 0; wx < p.pool_w; ++wx) {
          *origins++ = RowOrigin{b, (oy * p.pool_h + wy) * p.stride_h - p.pad_top,
                                 (ox * p.pool_w + wx) * p.stride_w - p.pad_left};
        }
      }
      if (++ox == p.out_w) {
        ox = 0;
        if (++oy == p.out_h) oy = 0, ++b;
      }
    }
  }

  // The "zero" padding correction of a row: adds, through add_rows, the rows of `tap_terms` ((kh * kw, o))
  // of its out-of-frame taps, columns [col_begin, col_begin + width), to its dots; 16 taps a call.
  void AddExcludedTapTerms(const RowOrigin& origin, const int32_t* tap_terms, int64_t col_begin, int64_t width,
                           AddRowsFn add_rows, int32_t* dots) const {
    constexpr int64_t kBatch = 16;
    const int32_t* rows[kBatch];
    int64_t count = 0;
    for (int64_t dy = 0; dy < p.kh; ++dy) {
      for (int64_t dx = 0; dx < p.kw; ++dx) {
        if (InFrame(origin.y0 + dy, origin.x0 + dx)) continue;
        rows[count++] = tap_terms + (dy * p.kw + dx) * p.o + col_begin;
        if (count == kBatch) add_rows(dots, rows, count, width), count = 0;
      }
    }
    if (count > 0) add_rows(dots, rows, count, width);
  }

  // Before a task's lane kernel rows are made: no correction rows yet, no row with one.
  void BeginCorrections(int64_t rows, Scratch& scratch) const {
    scratch.correction_keys.clear();
    scratch.correction_index.assign(rows, -1);
  }

  // For a lane kernel row whose field at `origin` has out-of-frame taps excluded: the index of its correction row in
  // scratch.corrections (p.o columns), `factor` times the sum of the rows of `tap_terms` ((kh * kw, o)) of those
  // taps; made if the task has none yet for its rectangle of taps in frame (scratch.correction_keys).
  int64_t CorrectionRow(const RowOrigin& origin, const int32_t* tap_terms, int32_t factor, Scratch& scratch) const {
    const int64_t key[4] = {std::clamp<int64_t>(-origin.y0, 0, p.kh), std::clamp<int64_t>(p.height - origin.y0, 0, p.kh),
                            std::clamp<int64_t>(-origin.x0, 0, p.kw), std::clamp<int64_t>(p.width - origin.x0, 0, p.kw)};
    std::vector<int64_t>& keys = scratch.correction_keys;
    const int64_t known = static_cast<int64_t>(keys.size()) / 4;
    for (int64_t i = 0; i < known; ++i) {
      if (std::equal(key, key + 4, keys.begin() + 4 * i)) return i;
    }
    keys.insert(keys.end(), key, key + 4);
    int32_t* row = Grow(scratch.corrections, (known + 1) * p.o) + known * p.o;
    std::fill(row, row + p.o, 0);
    for (int64_t dy = 0; dy < p.kh; ++dy) {
      for (int64_t dx = 0; dx < p.kw; ++dx) {
        if (dy >= key[0] && dy < key[1] && dx >= key[2] && dx < key[3]) continue;  // in frame
        const int32_t* tap = tap_terms + (dy * p.kw + dx) * p.o;
        for (int64_t c = 0; c < p.o; ++c) row[c] += factor * tap[c];
      }
    }
    return known;
  }

  // The lane kernel rows' correction rows, once a task's rows are made (the correction rows may move as they grow):
  // row r's is scratch.corrections' row scratch.correction_index[r], or null where that is -1.
  const int32_t* const* CorrectionPointers(int64_t rows, Scratch& scratch) const {
    const int32_t** correction = Grow(scratch.row_correction, rows);
    const int32_t* corrections = scratch.corrections.data();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t index = scratch.correction_index[r];
      correction[r] = index < 0 ? nullptr : corrections + index * p.o;
    }
    return correction;
  }
};

struct GemmShape {
  int64_t outputs;          // output rows: bmm rows, or pooled output pixels
  int64_t rows_per_output;  // reduction rows max-pooled into one output row (1 without pooling)
  int64_t n;                // output columns
  int64_t chunks;           // 128-bit chunks per reduction row
  int64_t column_bytes;     // bytes of weights per output column (all its planes)
};

// A product's chunk x tile-row products, which kMinParallelWork weighs against a thread hop (a chain of
// products, RunBmmChain, weighs its products' together: one hop serves them all).
inline int64_t GemmWork(const GemmShape& shape) {
  return shape.outputs * shape.rows_per_output * CeilDiv(shape.n, kTileRows) * std::max<int64_t>(1, shape.chunks);
}

// Whether a kernel max-pools each output's window of rows and adds the rows' excluded-tap corrections itself (its
// dots are the outputs'): a kernel says so with `static constexpr bool kPoolsWindows = true`.
template <class Kernel, class = void>
struct PoolsWindows : std::false_type {};
template <class Kernel>
struct PoolsWindows<Kernel, std::void_t<decltype(Kernel::kPoolsWindows)>> : std::bool_constant<Kernel::kPoolsWindows> {};

// Whether a kernel would rather have a product's rows split over the threads than its columns (it makes data per
// row on each task): `static constexpr bool kSplitsRowsFirst = true`.
template <class Kernel, class = void>
struct SplitsRowsFirst : std::false_type {};
template <class Kernel>
struct SplitsRowsFirst<Kernel, std::void_t<decltype(Kernel::kSplitsRowsFirst)>>
    : std::bool_constant<Kernel::kSplitsRowsFirst> {};
// The thinnest panels such a kernel's rows are split into (a multiple of the table kernel's 4-row blocks).
inline constexpr int64_t kSplitRows = 16;

// The tasks of one product: panels of output rows x blocks of output columns, count() of them, task i run by
// operator()(i). Source: Fill(first, count, scratch) packs the panel of output rows [first, first + count)
// (setting scratch.excluded per panel row) and returns it (a struct with `rows`); AddExcludedTaps(scratch, row,
// col_begin, width, dots) corrects a row whose excluded flag is set. Kernel: kernel(panel, col_begin, tiles,
// dots, stride) writes the dots of `tiles` 8-column tiles from column col_begin, row r at dots + r * stride
// (a kernel that PoolsWindows: output row r, and the source has no AddExcludedTaps).
// `parallel`: the tasks will run on several threads, so the columns are split finer where panels are few.
template <class Source, class Kernel>
class GemmTasks {
 public:
  GemmTasks(const Source& source, const Kernel& kernel, const GemmShape& shape, const EpilogueData& epilogue,
            void* out, int64_t threads, bool parallel)
      : source_(source), kernel_(kernel), shape_(shape), epilogue_(epilogue), out_(out),
        window_(shape.rows_per_output), outputs_per_panel_(std::max<int64_t>(1, kPanelRows / window_)),
        finish_strip_(FinishStripFor(ActiveIsa())) {
    if (shape.outputs == 0 || shape.n == 0) return;
    // A kernel that makes per-row data for each task (the table kernel's tables) takes thinner panels first.
    if (SplitsRowsFirst<Kernel>::value && parallel && window_ == 1) {
      const int64_t wanted = 4 * threads;
      if (CeilDiv(shape.outputs, outputs_per_panel_) < wanted) {
        outputs_per_panel_ = std::max<int64_t>(kSplitRows, RoundUp(CeilDiv(shape.outputs, wanted), kSplitRows));
      }
    }
    panels_ = CeilDiv(shape.outputs, outputs_per_panel_);
    // Columns per task: a multiple of 32 (one writer per packed output word) whose weights stay in L2; split
    // further when there are too few panels to keep every thread busy.
    const int64_t column_bytes = std::max<int64_t>(1, shape.column_bytes);
    block_ = std::max<int64_t>(kWordBits, kWeightBlockBytes / column_bytes / kWordBits * kWordBits);
    if (parallel && panels_ * CeilDiv(shape.n, block_) < 4 * threads) {
      block_ = std::max<int64_t>(kWordBits, RoundUp(CeilDiv(shape.n, CeilDiv(4 * threads, panels_)), kWordBits));
    }
    block_ = std::min(block_, RoundUp(shape.n, kWordBits));
    column_blocks_ = CeilDiv(shape.n, block_);
  }

  int64_t count() const { return panels_ * column_blocks_; }

  void operator()(int64_t index) const {
    const int64_t first = (index % panels_) * outputs_per_panel_;
    const int64_t count = std::min(outputs_per_panel_, shape_.outputs - first);
    const int64_t col_begin = (index / panels_) * block_;
    const int64_t col_end = std::min(shape_.n, col_begin + block_);
    const int64_t width = col_end - col_begin;
    Scratch& scratch = ThreadScratch();
    const auto panel = source_.Fill(first, count, scratch);
    // Dots of the kernel's rows: the panel's, to be corrected and pooled here, or the outputs' (PoolsWindows).
    constexpr bool kPooled = PoolsWindows<Kernel>::value;
    const int64_t window = kPooled ? 1 : window_, dot_rows = kPooled ? count : panel.rows;
    // int32 dots go straight into the output when the task's columns are whole 8-column tiles (the kernels
    // write whole tiles); else strip by strip into L1 scratch rows (padded so that they do not share L1 sets),
    // each strip's epilogue right after its dots.
    if (epilogue_.kind == Epilogue::kInt32 && window == 1 && width % kTileRows == 0) {
      int32_t* const dots = static_cast<int32_t*>(out_) + first * shape_.n + col_begin;
      kernel_(panel, col_begin, CeilDiv(width, kTileRows), dots, shape_.n);
      if constexpr (!kPooled) {
        for (int64_t row = 0; row < dot_rows; ++row) {
          if (scratch.excluded[row]) source_.AddExcludedTaps(scratch, row, col_begin, width, dots + row * shape_.n);
        }
      }
      return;
    }
    constexpr int64_t stride = kStripCols + 16;
    int32_t* const dots = Grow(scratch.dots, dot_rows * stride);
    for (int64_t strip = col_begin; strip < col_end; strip += kStripCols) {
      const int64_t strip_width = std::min(kStripCols, col_end - strip);
      kernel_(panel, strip, CeilDiv(strip_width, kTileRows), dots, stride);
      if constexpr (!kPooled) {
        for (int64_t row = 0; row < dot_rows; ++row) {
          if (scratch.excluded[row]) source_.AddExcludedTaps(scratch, row, strip, strip_width, dots + row * stride);
        }
      }
      finish_strip_(Strip{dots, stride, count, window, first, strip, strip_width, shape_.n, out_}, epilogue_);
    }
  }

 private:
  Source source_;
  Kernel kernel_;
  GemmShape shape_;
  EpilogueData epilogue_;
  void* out_;
  int64_t window_, outputs_per_panel_;
  int64_t panels_ = 0, block_ = 0, column_blocks_ = 0;
  FinishStripFn finish_strip_;
};

// Runs one product's tasks (GemmTasks) over the pool, on its threads where the product is worth it.
template <class Source, class Kernel>
void RunGemm(const Source& source, const Kernel& kernel, const GemmShape& shape, const EpilogueData& epilogue,
             void* out, ffi::ThreadPool* pool) {
  const int64_t threads = PoolThreads(pool);
  const bool parallel = threads > 1 && GemmWork(shape) >= kMinParallelWork;
  const GemmTasks<Source, Kernel> tasks(source, kernel, shape, epilogue, out, threads, parallel);
  ParallelFor(pool, tasks.count(), parallel, [&tasks](int64_t index) { tasks(index); });
}

}  // namespace jaxbnn::cpu::gemm

#endif  // JAXBNN_XLA_FFI_CPU_GEMM_DRIVER_H_
