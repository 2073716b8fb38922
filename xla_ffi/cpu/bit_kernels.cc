// Blocked, multi-threaded CPU bmm / bconv2d on packed bits.
//
// Both ops are one implicit GEMM: a "panel" of up to kPanelRows reduction rows (rows of `a`, or for
// bconv2d the receptive fields of a few output pixels gathered straight from the NHWC image: no im2col
// tensor is ever materialized) is packed for the kernels (popcount_kernels.h: groups of 8 rows, chunk-major,
// padding bits cleared) and reduced against the weights, with dot = k_valid - 2 popc(x XOR w). Bits of
// out-of-frame taps are 0 in the panel; for pad_value "zero" such a tap adds popc(w_tap) = the tap popcount
// of the column to every popcount, which the dots take back. Fused max-pool takes the max of the dots of a
// window's rows before the epilogue.
#include "cpu/bit_kernels.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "common/formats.h"
#include "cpu/parallel_for.h"
#include "cpu/popcount_kernels.h"

namespace jaxbnn::cpu {
namespace {

using formats::CeilDiv;

constexpr int64_t kTileRows = 8;         // the kernels' tile: 8 rows x 128 bits
constexpr int64_t kChunkWords = 4;       // 128 bits
constexpr int64_t kTileChunkWords = 32;  // one 8 x 128-bit tile
constexpr int64_t kWordBits = formats::kWordBits;
constexpr int64_t kPanelRows = 16;                   // reduction rows held at once (fit L1)
constexpr int64_t kWeightBlockBytes = 256 * 1024;    // weights swept by one task (fits L2)
// chunk x tile-row products worth a thread hop (~2 x 512 XOR-popcounts each; 2**12 is ~4 us on one core):
// mnist-conv's 3x3 layers at batch 1 take 30 and 21 us on two cores, 48 and 31 on one.
constexpr int64_t kMinParallelWork = int64_t{1} << 12;

#if defined(__GNUC__)
#define JAXBNN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define JAXBNN_ALWAYS_INLINE inline
#endif

int64_t RoundUp(int64_t value, int64_t multiple) { return CeilDiv(value, multiple) * multiple; }

// Where a conv panel row reads the image: image b, top-left input coordinate (y0, x0) of its receptive field.
struct RowOrigin {
  int64_t b, y0, x0;
};

// Per-thread scratch, reused across calls.
struct Scratch {
  std::vector<uint32_t> panel;     // PackedPanel words
  std::vector<uint32_t> line;      // one conv panel row, contiguous
  std::vector<int32_t> k_valid;    // per panel row: the reduction elements that count
  std::vector<uint8_t> excluded;   // per panel row: some taps are out of frame and excluded ("zero" padding)
  std::vector<RowOrigin> origins;  // per conv panel row
  std::vector<int32_t> dots;       // panel rows x a strip's columns
};

// At least `size` elements; never shrinks, so that alternating task sizes do not re-initialize memory.
template <class T>
T* Grow(std::vector<T>& vector, int64_t size) {
  if (static_cast<int64_t>(vector.size()) < size) vector.resize(size);
  return vector.data();
}

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Weights in the kernels' tile (rows/8, chunks, 8, 4). Other FSB tile shapes are copied into it; bits past
// the matrix stay 0 (and are masked anyway).
const uint32_t* KernelTiles(const uint32_t* tiles, int64_t rows, int64_t k_words, int64_t tile_rows,
                            int64_t tile_words, int64_t k_tiles, std::vector<uint32_t>& storage) {
  if (tile_rows == kTileRows && tile_words == kChunkWords) return tiles;
  int64_t chunks = CeilDiv(k_words, kChunkWords);
  storage.assign(CeilDiv(rows, kTileRows) * chunks * kTileChunkWords, 0);
  for (int64_t row = 0; row < rows; ++row) {
    const uint32_t* src_tile_row = tiles + (row / tile_rows) * k_tiles * tile_rows * tile_words;
    uint32_t* dst_tile_row = storage.data() + (row / kTileRows) * chunks * kTileChunkWords;
    for (int64_t word = 0; word < k_words; ++word) {
      dst_tile_row[(word / kChunkWords) * kTileChunkWords + (row % kTileRows) * kChunkWords + word % kChunkWords] =
          src_tile_row[((word / tile_words) * tile_rows + row % tile_rows) * tile_words + word % tile_words];
    }
  }
  return storage.data();
}

// One reduction row of a packed panel being filled: word w lies at base[(w / 4) * 32 + w % 4].
class PanelRow {
 public:
  PanelRow(uint32_t* panel, int64_t chunks, int64_t row)
      : base_(panel + ((row / kGroupRows) * chunks * kGroupRows + row % kGroupRows) * kChunkWords) {}

  // Words [0, count) from src, the last one ANDed with last_mask (clears the padding bits of a row), then
  // zeros to the end of the row's `chunks` chunks.
  JAXBNN_ALWAYS_INLINE void Put(const uint32_t* src, int64_t count, uint32_t last_mask, int64_t chunks) const {
    const int64_t whole = count / kChunkWords * kChunkWords;
    for (int64_t i = 0; i < whole; i += kChunkWords) std::memcpy(At(i), src + i, kChunkWords * 4);
    for (int64_t i = whole; i < chunks * kChunkWords; ++i) *At(i) = i < count ? src[i] : 0;
    if (count > 0) *At(count - 1) &= last_mask;
  }

 private:
  JAXBNN_ALWAYS_INLINE uint32_t* At(int64_t word) const {
    return base_ + (word / kChunkWords) * kGroupRows * kChunkWords + word % kChunkWords;
  }

  uint32_t* base_;
};

// Mask of the bits of a chunked row that belong to the reduction, or empty when that is every bit: the
// weights may hold anything in the others.
std::vector<uint32_t> WeightMask(int64_t chunks, int64_t runs, int64_t run_words, int64_t run_bits) {
  if (run_bits % kWordBits == 0 && runs * run_words == chunks * kChunkWords) return {};
  std::vector<uint32_t> mask(chunks * kChunkWords, 0u);
  for (int64_t run = 0; run < runs; ++run) {
    for (int64_t word = 0; word < run_words; ++word) {
      mask[run * run_words + word] = word + 1 == run_words ? formats::LastWordMask(run_bits) : ~0u;
    }
  }
  return mask;
}

struct GemmShape {
  int64_t outputs;          // output rows: bmm rows, or pooled output pixels
  int64_t rows_per_output;  // reduction rows max-pooled into one output row (1 without pooling)
  int64_t n;                // output columns
  int64_t chunks;           // 128-bit chunks per reduction row
  const uint32_t* tiles;    // kernel tiles (ceil(n/8), chunks, 8, 4)
};

// Source: packs the panel for output rows [first, first + count) (setting k_valid and excluded per panel
// row) and adds the excluded taps back into a row's dots; see BmmRows, ConvRows.
template <class Source>
void RunGemm(const Source& source, const GemmShape& shape, const EpilogueData& epilogue, void* out,
             ffi::ThreadPool* pool) {
  if (shape.outputs == 0 || shape.n == 0) return;
  const int64_t window = shape.rows_per_output;
  const int64_t outputs_per_panel = std::max<int64_t>(1, kPanelRows / window);
  const int64_t panels = CeilDiv(shape.outputs, outputs_per_panel);
  const int64_t threads = PoolThreads(pool);
  const int64_t tile_rows_total = CeilDiv(shape.n, kTileRows);
  const bool parallel =
      threads > 1 && shape.outputs * window * tile_rows_total * std::max<int64_t>(1, shape.chunks) >= kMinParallelWork;

  // Columns per task: a multiple of 32 (one writer per packed output word) whose weights stay in L2; split
  // further when there are too few panels to keep every thread busy.
  const int64_t column_bytes = std::max<int64_t>(1, shape.chunks * kChunkWords * 4);
  int64_t block = std::max<int64_t>(kWordBits, kWeightBlockBytes / column_bytes / kWordBits * kWordBits);
  if (parallel && panels * CeilDiv(shape.n, block) < 4 * threads) {
    block = std::max<int64_t>(kWordBits, RoundUp(CeilDiv(shape.n, CeilDiv(4 * threads, panels)), kWordBits));
  }
  block = std::min(block, RoundUp(shape.n, kWordBits));
  const int64_t column_blocks = CeilDiv(shape.n, block);
  const Isa isa = ActiveIsa();
  const PanelDotsFn panel_dots = PanelDotsFor(isa);
  const FinishStripFn finish_strip = FinishStripFor(isa);

  auto task = [&](int64_t index) {
    const int64_t first = (index % panels) * outputs_per_panel;
    const int64_t count = std::min(outputs_per_panel, shape.outputs - first);
    const int64_t col_begin = (index / panels) * block;
    const int64_t col_end = std::min(shape.n, col_begin + block);
    const int64_t width = col_end - col_begin;
    Scratch& scratch = ThreadScratch();
    const PackedPanel panel = source.Fill(first, count, scratch);
    // int32 dots go straight into the output when the task's columns are whole 8-column tiles (the kernels
    // write whole tiles); else strip by strip into L1 scratch rows (padded so that they do not share L1 sets),
    // each strip's epilogue right after its dots.
    if (epilogue.kind == Epilogue::kInt32 && window == 1 && width % kTileRows == 0) {
      int32_t* const dots = static_cast<int32_t*>(out) + first * shape.n + col_begin;
      panel_dots(panel, shape.tiles + (col_begin / kTileRows) * shape.chunks * kTileChunkWords,
                 CeilDiv(width, kTileRows), dots, shape.n);
      for (int64_t row = 0; row < panel.rows; ++row) {
        if (scratch.excluded[row]) source.AddExcludedTaps(scratch, row, col_begin, width, dots + row * shape.n);
      }
      return;
    }
    constexpr int64_t stride = kStripCols + 16;
    int32_t* const dots = Grow(scratch.dots, panel.rows * stride);
    for (int64_t strip = col_begin; strip < col_end; strip += kStripCols) {
      const int64_t strip_width = std::min(kStripCols, col_end - strip);
      panel_dots(panel, shape.tiles + (strip / kTileRows) * shape.chunks * kTileChunkWords,
                 CeilDiv(strip_width, kTileRows), dots, stride);
      for (int64_t row = 0; row < panel.rows; ++row) {
        if (scratch.excluded[row]) source.AddExcludedTaps(scratch, row, strip, strip_width, dots + row * stride);
      }
      finish_strip(Strip{dots, stride, count, window, first, strip, strip_width, shape.n, out}, epilogue);
    }
  };
  ParallelFor(pool, panels * column_blocks, parallel, task);
}

// Rows of `a`, packed with their padding bits cleared.
struct BmmRows {
  const uint32_t* a;
  int64_t k_words, chunks;
  int32_t k;
  const uint32_t* weight_mask;

  PackedPanel Fill(int64_t first, int64_t count, Scratch& scratch) const {
    int32_t* k_valid = Grow(scratch.k_valid, count);
    uint8_t* excluded = Grow(scratch.excluded, count);
    uint32_t* panel = Grow(scratch.panel, RoundUp(count, kGroupRows) * chunks * kChunkWords);
    const uint32_t last_mask = formats::LastWordMask(k);
    for (int64_t r = 0; r < count; ++r) {
      k_valid[r] = k;
      excluded[r] = 0;
      const PanelRow row(panel, chunks, r);
      row.Put(a + (first + r) * k_words, k_words, last_mask, chunks);
    }
    return PackedPanel{panel, count, chunks, k_valid, weight_mask};
  }

  void AddExcludedTaps(const Scratch&, int64_t, int64_t, int64_t, int32_t*) const {}  // bmm excludes nothing
};

// Receptive fields of pooled output pixels, gathered from the NHWC image: panel row (o * window + wy *
// pool_w + wx) is the conv output pixel (oy * pool_h + wy, ox * pool_w + wx) of output o. Tap t = dy * kw +
// dx occupies words [t * c_words, (t + 1) * c_words), as in the weight matrix.
struct ConvRows {
  const Bconv2dProblem& p;
  const uint32_t* x;
  const int32_t* tap_popcount;  // (kh * kw, o)
  int64_t chunks;
  const uint32_t* weight_mask;
  AddDoubledFn add_doubled;

  bool InFrame(int64_t iy, int64_t ix) const { return iy >= 0 && iy < p.height && ix >= 0 && ix < p.width; }
  const uint32_t* Pixel(int64_t b, int64_t iy, int64_t ix) const {
    return x + ((b * p.height + iy) * p.width + ix) * p.c_words;
  }

  PackedPanel Fill(int64_t first, int64_t count, Scratch& scratch) const {
    const int64_t window = p.pool_h * p.pool_w, taps = p.kh * p.kw;
    const int64_t rows = count * window;
    const int64_t row_words = chunks * kChunkWords;
    const uint32_t last_mask = formats::LastWordMask(p.c);
    uint32_t* panel = Grow(scratch.panel, RoundUp(rows, kGroupRows) * row_words);
    int32_t* k_valid = Grow(scratch.k_valid, rows);
    uint8_t* excluded = Grow(scratch.excluded, rows);
    RowOrigin* origins = Grow(scratch.origins, rows);
    Origins(first, count, origins);
    // Each receptive field is gathered into one contiguous line (its padding words past k_words stay 0),
    // masked, then copied into the panel a whole chunk at a time: cheaper than placing the few words of each
    // tap in the panel's chunk-interleaved layout one by one.
    uint32_t* line = Grow(scratch.line, row_words);
    std::fill(line, line + row_words, 0u);
    const int64_t run = p.kw * p.c_words;
    for (int64_t r = 0; r < rows; ++r) {
      const auto [b, y0, x0] = origins[r];
      int64_t in_frame = 0;
      for (int64_t dy = 0; dy < p.kh; ++dy) {
        const int64_t iy = y0 + dy;
        uint32_t* dst = line + dy * run;
        if (iy >= 0 && iy < p.height && x0 >= 0 && x0 + p.kw <= p.width) {
          // The kw taps of this kernel row are contiguous in both the image and the line.
          const uint32_t* src = Pixel(b, iy, x0);
          for (int64_t i = 0; i < run; ++i) dst[i] = src[i];
          in_frame += p.kw;
          continue;
        }
        for (int64_t dx = 0; dx < p.kw; ++dx, dst += p.c_words) {
          if (InFrame(iy, x0 + dx)) {
            const uint32_t* src = Pixel(b, iy, x0 + dx);
            for (int64_t i = 0; i < p.c_words; ++i) dst[i] = src[i];
            ++in_frame;
          } else {
            // Out of frame: bits 0 (-1 inputs). With pad_value "one" they count; with "zero" the dots drop them.
            for (int64_t i = 0; i < p.c_words; ++i) dst[i] = 0;
          }
        }
      }
      if (last_mask != ~0u) {
        for (int64_t word = p.c_words - 1; word < p.k_words; word += p.c_words) line[word] &= last_mask;
      }
      PanelRow(panel, chunks, r).Put(line, row_words, ~0u, chunks);
      const int64_t counted = p.pad_one ? taps : in_frame;
      k_valid[r] = static_cast<int32_t>(counted * p.c);
      excluded[r] = counted < taps;
    }
    return PackedPanel{panel, rows, chunks, k_valid, weight_mask};
  }

  // An excluded tap t read as 0 bits added popc(w_t) = tap_popcount[t, col] to the popcount of every
  // column: take it back.
  void AddExcludedTaps(const Scratch& scratch, int64_t row, int64_t col_begin, int64_t width, int32_t* dots) const {
    const auto [b, y0, x0] = scratch.origins[row];
    constexpr int64_t kBatch = 16;
    const int32_t* taps[kBatch];
    int64_t count = 0;
    for (int64_t dy = 0; dy < p.kh; ++dy) {
      for (int64_t dx = 0; dx < p.kw; ++dx) {
        if (InFrame(y0 + dy, x0 + dx)) continue;
        taps[count++] = tap_popcount + (dy * p.kw + dx) * p.o + col_begin;
        if (count == kBatch) add_doubled(dots, taps, count, width), count = 0;
      }
    }
    if (count > 0) add_doubled(dots, taps, count, width);
  }

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
};

}  // namespace

void RunBmm(const BmmProblem& problem, const uint32_t* a, const uint32_t* b_tiles, const EpilogueData& epilogue,
            void* out, ffi::ThreadPool* pool) {
  const int64_t chunks = CeilDiv(problem.k_words, kChunkWords);
  const std::vector<uint32_t> weight_mask = WeightMask(chunks, 1, problem.k_words, problem.k);
  std::vector<uint32_t> tile_storage;
  const uint32_t* tiles = KernelTiles(b_tiles, problem.n, problem.k_words, problem.tile_rows, problem.tile_words,
                                      problem.k_tiles, tile_storage);
  BmmRows rows{a, problem.k_words, chunks, static_cast<int32_t>(problem.k),
               weight_mask.empty() ? nullptr : weight_mask.data()};
  RunGemm(rows, GemmShape{problem.m, 1, problem.n, chunks, tiles}, epilogue, out, pool);
}

void RunBconv2d(const Bconv2dProblem& problem, const uint32_t* x, const uint32_t* w_tiles,
                const int32_t* w_tap_popcount, const EpilogueData& epilogue, void* out, ffi::ThreadPool* pool) {
  const int64_t chunks = CeilDiv(problem.k_words, kChunkWords);
  const std::vector<uint32_t> weight_mask =
      WeightMask(chunks, problem.kh * problem.kw, problem.c_words, problem.c);
  std::vector<uint32_t> tile_storage;
  const uint32_t* tiles = KernelTiles(w_tiles, problem.o, problem.k_words, problem.tile_rows, problem.tile_words,
                                      problem.k_tiles, tile_storage);
  ConvRows rows{problem, x, w_tap_popcount, chunks, weight_mask.empty() ? nullptr : weight_mask.data(),
                AddDoubledFor(ActiveIsa())};
  const int64_t outputs = problem.batch * problem.out_h * problem.out_w;
  RunGemm(rows, GemmShape{outputs, problem.pool_h * problem.pool_w, problem.o, chunks, tiles}, epilogue,
                   out, pool);
}

}  // namespace jaxbnn::cpu
