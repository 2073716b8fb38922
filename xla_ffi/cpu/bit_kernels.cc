// Blocked, multi-threaded CPU bmm / bconv2d on packed bits.
//
// Both ops are one implicit GEMM: a "panel" of up to kPanelRows reduction rows (rows of `a`, or for
// bconv2d the receptive fields of a few output pixels gathered straight from the NHWC image: no im2col
// tensor is ever materialized) is reduced against the weights, 8 output columns (one FSB tile row) at a
// time, with dot = k_valid - 2 popc((x XOR w) AND mask). The mask zeroes padding bits of both operands and,
// for pad_value "zero", whole out-of-frame taps, whose k_valid then excludes them. Fused max-pool takes the
// max of the dots of a window's rows before the epilogue.
#include "cpu/bit_kernels.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats.h"
#include "cpu/popcount_kernels.h"

namespace jaxbnn::cpu {
namespace {

using formats::CeilDiv;

constexpr int64_t kTileRows = 8;         // the kernels' tile: 8 rows x 128 bits
constexpr int64_t kChunkWords = 4;       // 128 bits
constexpr int64_t kTileChunkWords = 32;  // one 8 x 128-bit tile
constexpr int64_t kWordBits = formats::kWordBits;
constexpr int64_t kPanelRows = 32;                   // reduction rows held at once (fits L1 with the tile row)
constexpr int64_t kWeightBlockBytes = 256 * 1024;    // weights swept by one task (fits L2)
constexpr int64_t kMinParallelWork = int64_t{1} << 15;  // chunk x tile-row products worth a thread hop

#if defined(__GNUC__)
#define JAXBNN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define JAXBNN_ALWAYS_INLINE inline
#endif

// Short copies and fills as plain loops: GCC expands short variable-size memcpy / fill into `rep movsb` /
// `rep stos`, whose start-up cost on AMD exceeds the copy itself.
JAXBNN_ALWAYS_INLINE void CopyWords(uint32_t* dst, const uint32_t* src, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = src[i];
}

JAXBNN_ALWAYS_INLINE void ZeroWords(uint32_t* dst, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = 0;
}

int64_t RoundUp(int64_t value, int64_t multiple) { return CeilDiv(value, multiple) * multiple; }

// Runs body(task) for every task in [0, tasks) on the calling thread and XLA's intra-op thread pool. The
// caller takes tasks too and only waits for tasks that are already running, so a busy or one-thread pool
// cannot deadlock it; helpers that start late find no task left and return at once (they only touch the
// shared state, which they keep alive).
class SharedTasks {
 public:
  SharedTasks(int64_t tasks, std::function<void(int64_t)> body) : tasks_(tasks), body_(std::move(body)) {}

  void Drain() {
    for (int64_t task; (task = next_.fetch_add(1)) < tasks_;) {
      try {
        body_(task);
      } catch (const std::exception& e) {
        RecordError(e.what());
      } catch (...) {
        RecordError("unknown error");
      }
      if (finished_.fetch_add(1) + 1 == tasks_) {
        std::lock_guard<std::mutex> lock(mutex_);
        all_finished_.notify_all();
      }
    }
  }

  // Returns the first error raised by a task, or an empty string.
  std::string WaitAll() {
    std::unique_lock<std::mutex> lock(mutex_);
    all_finished_.wait(lock, [this] { return finished_.load() >= tasks_; });
    return error_;
  }

 private:
  void RecordError(const char* what) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_.empty()) error_ = what;
  }

  const int64_t tasks_;
  const std::function<void(int64_t)> body_;
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> finished_{0};
  std::mutex mutex_;
  std::condition_variable all_finished_;
  std::string error_;
};

int64_t PoolThreads(ffi::ThreadPool* pool) {
  return pool == nullptr ? 1 : std::max<int64_t>(1, pool->num_threads());
}

void ParallelFor(ffi::ThreadPool* pool, int64_t tasks, bool parallel, std::function<void(int64_t)> body) {
  auto shared = std::make_shared<SharedTasks>(tasks, std::move(body));
  if (parallel && pool != nullptr) {
    // The calling thread is one of the workers.
    int64_t helpers = std::min(PoolThreads(pool) - 1, tasks - 1);
    for (int64_t i = 0; i < helpers; ++i) pool->Schedule([shared] { shared->Drain(); });
  }
  shared->Drain();
  std::string error = shared->WaitAll();
  if (!error.empty()) throw std::runtime_error(error);
}

// Per-thread scratch, reused across calls.
struct Scratch {
  std::vector<uint32_t> data, mask;
  std::vector<int32_t> k_valid, popcounts, dots;
};

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

struct GemmShape {
  int64_t outputs;          // output rows: bmm rows, or pooled output pixels
  int64_t rows_per_output;  // reduction rows max-pooled into one output row (1 without pooling)
  int64_t n;                // output columns
  int64_t chunks;           // 128-bit chunks per reduction row
  const uint32_t* tiles;    // kernel tiles (ceil(n/8), chunks, 8, 4)
};

// dot >= threshold, or dot <= threshold where flip (branch-free).
JAXBNN_ALWAYS_INLINE uint32_t ThresholdBit(int32_t dot, int32_t threshold, uint8_t flip) {
  const uint32_t at_least = dot >= threshold, at_most = dot <= threshold;
  return flip ? at_most : at_least;
}

template <Epilogue kEpilogue>
struct OutputWriter {
  const EpilogueData& epilogue;
  void* out;
  int64_t n;

  // Writes the dots of columns [col_begin, col_end) (col_begin a multiple of 32) of output `row`: one
  // contiguous run per row, so rows whose stride is a multiple of 4 KiB do not thrash one L1 set.
  JAXBNN_ALWAYS_INLINE void WriteRow(int64_t row, int64_t col_begin, int64_t col_end, const int32_t* dots) const {
    const int64_t width = col_end - col_begin;
    if constexpr (kEpilogue == Epilogue::kInt32) {
      int32_t* dst = static_cast<int32_t*>(out) + row * n + col_begin;
      for (int64_t i = 0; i < width; ++i) dst[i] = dots[i];
    } else if constexpr (kEpilogue == Epilogue::kAffine) {
      // Exactly float(dot) * scale + bias: the module is built with -ffp-contract=off (no fused multiply-add).
      float* dst = static_cast<float*>(out) + row * n + col_begin;
      const float* scale = epilogue.scale + col_begin;
      const float* bias = epilogue.bias + col_begin;
      for (int64_t i = 0; i < width; ++i) dst[i] = static_cast<float>(dots[i]) * scale[i] + bias[i];
    } else {
      uint32_t* dst = static_cast<uint32_t*>(out) + row * CeilDiv(n, kWordBits) + col_begin / kWordBits;
      const int32_t* threshold = epilogue.threshold + col_begin;
      const uint8_t* flip = epilogue.flip + col_begin;
      for (int64_t word = 0; word * kWordBits < width; ++word) {
        const int64_t bits_in_word = std::min(kWordBits, width - word * kWordBits);
        uint32_t bits = 0;  // padding bits past n stay 0
        for (int64_t i = 0; i < bits_in_word; ++i) {
          const int64_t c = word * kWordBits + i;
          bits |= ThresholdBit(dots[c], threshold[c], flip[c]) << i;
        }
        dst[word] = bits;
      }
    }
  }
};

// Source: fills the panel for output rows [first, first + count) and returns its view; see BmmRows,
// ConvRows.
template <Epilogue kEpilogue, class Source>
void RunGemm(const Source& source, const GemmShape& shape, const EpilogueData& epilogue, void* out,
             ffi::ThreadPool* pool) {
  if (shape.outputs == 0 || shape.n == 0) return;
  const int64_t window = shape.rows_per_output;
  const int64_t outputs_per_panel = std::max<int64_t>(1, kPanelRows / window);
  const int64_t panels = CeilDiv(shape.outputs, outputs_per_panel);
  const int64_t tile_rows_total = CeilDiv(shape.n, kTileRows);
  const int64_t threads = PoolThreads(pool);
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
  const TileRowPopcountFn tile_row_popcount = TileRowPopcountFor(ActiveIsa());
  const OutputWriter<kEpilogue> writer{epilogue, out, shape.n};

  auto task = [&](int64_t index) {
    const int64_t first = (index % panels) * outputs_per_panel;
    const int64_t count = std::min(outputs_per_panel, shape.outputs - first);
    const int64_t col_begin = (index / panels) * block;
    const int64_t col_end = std::min(shape.n, col_begin + block);
    Scratch& scratch = ThreadScratch();
    const PanelView panel = source.Fill(first, count, scratch);
    const int rows = static_cast<int>(count * window);
    scratch.popcounts.resize(rows * kTileRows);
    // Dots of the task's columns, one padded row per output (padding keeps rows off the same L1 set).
    const int64_t dots_stride = RoundUp(col_end - col_begin, kTileRows) + 16;
    scratch.dots.resize(count * dots_stride);
    const int32_t* k_valid = scratch.k_valid.data();
    for (int64_t tile = col_begin / kTileRows; tile * kTileRows < col_end; ++tile) {
      tile_row_popcount(panel, rows, shape.tiles + tile * shape.chunks * kTileChunkWords, shape.chunks,
                        scratch.popcounts.data());
      for (int64_t o = 0; o < count; ++o) {
        // Max-pool: the max over the window's rows of dot = k_valid - 2 popcount.
        const int32_t* popcounts = scratch.popcounts.data() + o * window * kTileRows;
        const int32_t* valid = k_valid + o * window;
        int32_t* dots = scratch.dots.data() + o * dots_stride + (tile * kTileRows - col_begin);
        for (int64_t i = 0; i < kTileRows; ++i) dots[i] = valid[0] - 2 * popcounts[i];
        for (int64_t r = 1; r < window; ++r) {  // no-op without pooling (window 1)
          for (int64_t i = 0; i < kTileRows; ++i) {
            dots[i] = std::max(dots[i], valid[r] - 2 * popcounts[r * kTileRows + i]);
          }
        }
      }
    }
    for (int64_t o = 0; o < count; ++o) {
      writer.WriteRow(first + o, col_begin, col_end, scratch.dots.data() + o * dots_stride);
    }
  };
  ParallelFor(pool, panels * column_blocks, parallel, task);
}

template <class Source>
void DispatchEpilogue(const Source& source, const GemmShape& shape, const EpilogueData& epilogue, void* out,
                      ffi::ThreadPool* pool) {
  switch (epilogue.kind) {
    case Epilogue::kInt32: return RunGemm<Epilogue::kInt32>(source, shape, epilogue, out, pool);
    case Epilogue::kAffine: return RunGemm<Epilogue::kAffine>(source, shape, epilogue, out, pool);
    case Epilogue::kThreshold: return RunGemm<Epilogue::kThreshold>(source, shape, epilogue, out, pool);
  }
}

// Rows of `a`, read in place when they already span whole chunks, else copied and zero-extended.
struct BmmRows {
  const uint32_t* a;
  int64_t k_words, row_words;
  int32_t k;
  const uint32_t* mask;  // one row: the first k bits set

  PanelView Fill(int64_t first, int64_t count, Scratch& scratch) const {
    scratch.k_valid.assign(count, k);
    if (k_words == row_words) return PanelView{a + first * k_words, mask, row_words, 0};
    scratch.data.resize(count * row_words);
    for (int64_t r = 0; r < count; ++r) {
      uint32_t* dst = scratch.data.data() + r * row_words;
      CopyWords(dst, a + (first + r) * k_words, k_words);
      ZeroWords(dst + k_words, row_words - k_words);
    }
    return PanelView{scratch.data.data(), mask, row_words, 0};
  }
};

// Receptive fields of pooled output pixels, gathered from the NHWC image: panel row (o * window + wy *
// pool_w + wx) is the conv output pixel (oy * pool_h + wy, ox * pool_w + wx) of output o. Tap t = dy * kw +
// dx occupies words [t * c_words, (t + 1) * c_words), as in the weight matrix.
struct ConvRows {
  const Bconv2dProblem& p;
  const uint32_t* x;
  int64_t row_words;
  const uint32_t* mask;  // one row: the first c bits of every tap set

  bool InFrame(int64_t iy, int64_t ix) const { return iy >= 0 && iy < p.height && ix >= 0 && ix < p.width; }
  const uint32_t* Pixel(int64_t b, int64_t iy, int64_t ix) const {
    return x + ((b * p.height + iy) * p.width + ix) * p.c_words;
  }

  PanelView Fill(int64_t first, int64_t count, Scratch& scratch) const {
    const int64_t window = p.pool_h * p.pool_w, taps = p.kh * p.kw;
    const int64_t rows = count * window;
    scratch.data.resize(rows * row_words);
    scratch.k_valid.resize(rows);
    bool any_excluded = false;
    for (int64_t row = 0; row < rows; ++row) {
      int64_t b, y0, x0;
      Origin(first, row, &b, &y0, &x0);
      uint32_t* dst = scratch.data.data() + row * row_words;
      int64_t in_frame = 0;
      for (int64_t dy = 0; dy < p.kh; ++dy) {
        const int64_t iy = y0 + dy;
        uint32_t* tap_row = dst + dy * p.kw * p.c_words;
        if (iy >= 0 && iy < p.height && x0 >= 0 && x0 + p.kw <= p.width) {
          // The kw taps of this kernel row are contiguous in both the image and the panel.
          CopyWords(tap_row, Pixel(b, iy, x0), p.kw * p.c_words);
          in_frame += p.kw;
          continue;
        }
        for (int64_t dx = 0; dx < p.kw; ++dx) {
          uint32_t* tap = tap_row + dx * p.c_words;
          if (InFrame(iy, x0 + dx)) {
            CopyWords(tap, Pixel(b, iy, x0 + dx), p.c_words);
            ++in_frame;
          } else {
            // Out of frame: bits 0 (-1 inputs). With pad_value "one" they count; with "zero" the mask drops them.
            ZeroWords(tap, p.c_words);
          }
        }
      }
      ZeroWords(dst + p.k_words, row_words - p.k_words);
      const int64_t counted = p.pad_one ? taps : in_frame;
      scratch.k_valid[row] = static_cast<int32_t>(counted * p.c);
      any_excluded |= counted < taps;
    }
    if (!any_excluded) return PanelView{scratch.data.data(), mask, row_words, 0};

    // Some rows skip taps: give every row its own mask.
    scratch.mask.resize(rows * row_words);
    for (int64_t row = 0; row < rows; ++row) {
      int64_t b, y0, x0;
      Origin(first, row, &b, &y0, &x0);
      uint32_t* row_mask = scratch.mask.data() + row * row_words;
      CopyWords(row_mask, mask, row_words);
      for (int64_t dy = 0; dy < p.kh; ++dy) {
        for (int64_t dx = 0; dx < p.kw; ++dx) {
          if (!InFrame(y0 + dy, x0 + dx)) {
            uint32_t* tap = row_mask + (dy * p.kw + dx) * p.c_words;
            ZeroWords(tap, p.c_words);
          }
        }
      }
    }
    return PanelView{scratch.data.data(), scratch.mask.data(), row_words, row_words};
  }

  // Image b and the top-left input coordinate (y0, x0) of the receptive field of panel row `row`.
  void Origin(int64_t first, int64_t row, int64_t* b, int64_t* y0, int64_t* x0) const {
    const int64_t window = p.pool_h * p.pool_w;
    const int64_t output = first + row / window, in_window = row % window;
    *b = output / (p.out_h * p.out_w);
    const int64_t pixel = output % (p.out_h * p.out_w);
    const int64_t conv_y = (pixel / p.out_w) * p.pool_h + in_window / p.pool_w;
    const int64_t conv_x = (pixel % p.out_w) * p.pool_w + in_window % p.pool_w;
    *y0 = conv_y * p.stride_h - p.pad_top;
    *x0 = conv_x * p.stride_w - p.pad_left;
  }
};

}  // namespace

void RunBmm(const BmmProblem& problem, const uint32_t* a, const uint32_t* b_tiles, const EpilogueData& epilogue,
            void* out, ffi::ThreadPool* pool) {
  const int64_t chunks = CeilDiv(problem.k_words, kChunkWords);
  const int64_t row_words = chunks * kChunkWords;
  std::vector<uint32_t> mask(row_words, 0u);
  for (int64_t word = 0; word < problem.k_words; ++word) {
    mask[word] = word + 1 == problem.k_words ? formats::LastWordMask(problem.k) : ~0u;
  }
  std::vector<uint32_t> tile_storage;
  const uint32_t* tiles = KernelTiles(b_tiles, problem.n, problem.k_words, problem.tile_rows, problem.tile_words,
                                      problem.k_tiles, tile_storage);
  BmmRows rows{a, problem.k_words, row_words, static_cast<int32_t>(problem.k), mask.data()};
  DispatchEpilogue(rows, GemmShape{problem.m, 1, problem.n, chunks, tiles}, epilogue, out, pool);
}

void RunBconv2d(const Bconv2dProblem& problem, const uint32_t* x, const uint32_t* w_tiles,
                const EpilogueData& epilogue, void* out, ffi::ThreadPool* pool) {
  const int64_t chunks = CeilDiv(problem.k_words, kChunkWords);
  const int64_t row_words = chunks * kChunkWords;
  std::vector<uint32_t> mask(row_words, 0u);
  for (int64_t tap = 0; tap < problem.kh * problem.kw; ++tap) {
    for (int64_t word = 0; word < problem.c_words; ++word) {
      mask[tap * problem.c_words + word] = word + 1 == problem.c_words ? formats::LastWordMask(problem.c) : ~0u;
    }
  }
  std::vector<uint32_t> tile_storage;
  const uint32_t* tiles = KernelTiles(w_tiles, problem.o, problem.k_words, problem.tile_rows, problem.tile_words,
                                      problem.k_tiles, tile_storage);
  ConvRows rows{problem, x, row_words, mask.data()};
  const int64_t outputs = problem.batch * problem.out_h * problem.out_w;
  DispatchEpilogue(rows, GemmShape{outputs, problem.pool_h * problem.pool_w, problem.o, chunks, tiles}, epilogue,
                   out, pool);
}

}  // namespace jaxbnn::cpu
