// Binary (±1 x ±1) bmm and bconv2d on packed bits, on the implicit GEMM driver (gemm_driver.h): the
// panel kernels, or the lane kernels of short reductions (popcount_kernels.h), give dot = k_valid - 2 popc(x XOR
// w). Bits of out-of-frame taps are 0; for pad_value "zero" such a tap adds popc(w_tap) = the tap popcount of
// the column to every popcount, which the dots take back.
#include "cpu/bit_kernels.h"

#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

#include "common/formats.h"
#include "cpu/gemm_driver.h"
#include "cpu/popcount_kernels.h"

namespace jaxbnn::cpu {
namespace {

using namespace gemm;

// The panel kernel of the active tier over the kernel tiles of every output column.
struct BinaryKernel {
  PanelDotsFn panel_dots;
  const uint32_t* tiles;
  int64_t chunks;

  void operator()(const PackedPanel& panel, int64_t col_begin, int64_t tiles_count, int32_t* dots,
                  int64_t stride) const {
    panel_dots(panel, tiles + (col_begin / kTileRows) * chunks * kTileChunkWords, tiles_count, dots, stride);
  }
};

// The lane kernel of the active tier over the lane tiles (LaneTiles) of every output column; it pools and
// corrects the rows itself.
struct LaneKernel {
  static constexpr bool kPoolsWindows = true;
  LaneDotsFn lane_dots;
  const uint32_t* lanes;
  int64_t k_words;

  void operator()(const LaneRows& rows, int64_t col_begin, int64_t tiles_count, int32_t* dots,
                  int64_t stride) const {
    lane_dots(rows, lanes + (col_begin / kTileRows) * k_words * kLaneWordNibbles * kTileRows, k_words, col_begin,
              tiles_count, dots, stride);
  }
};

// The table kernel of the active tier over the column nibbles (ColumnNibblesFn) of every output column; bmm's rows
// are not pooled, so its dots are the outputs'.
struct TableKernel {
  static constexpr bool kPoolsWindows = true;
  static constexpr bool kSplitsRowsFirst = true;
  TableDotsFn table_dots;
  const uint8_t* columns;
  int64_t nibbles;

  void operator()(const TableRows& rows, int64_t col_begin, int64_t tiles_count, int32_t* dots,
                  int64_t stride) const {
    table_dots(rows, columns, nibbles, col_begin, tiles_count, dots, stride);
  }
};

// bmm's products of at least this many rows run on the active tier's table kernel where it has one and the counts fit
// its 16-bit lanes: it regroups the weights on every call (ColumnNibblesFn, a pass over n * k_words words), which that
// many rows repay (decisions.md).
constexpr int64_t kTableMinRows = 64;

TableTier TableTierForBmm(int64_t m, int64_t k_words) {
  return m >= kTableMinRows && k_words > 0 && k_words * 8 <= kTableMaxNibbles ? TableTierFor(ActiveIsa())
                                                                               : TableTier{};
}

// Weights regrouped for the table kernel at least this many words a thread.
constexpr int64_t kMinParallelNibbleWords = 8192;

// The column nibbles of the kernel tiles of n columns into `storage` (this thread's, kept from call to call), the
// groups split over the pool where there are enough words.
const uint8_t* ColumnNibbles(const TableTier& tier, const uint32_t* tiles, int64_t n, int64_t k_words, int64_t k,
                             std::vector<uint8_t>& storage, ffi::ThreadPool* pool) {
  const int64_t groups = CeilDiv(n, kTableGroupCols);
  uint8_t* columns = Grow(storage, groups * k_words * 8 * kTableGroupCols);
  const uint32_t last_mask = formats::LastWordMask(k);
  const int64_t threads = PoolThreads(pool);
  const bool parallel = threads > 1 && groups > 1 && n * k_words >= 2 * kMinParallelNibbleWords;
  const int64_t tasks = parallel ? std::min(groups, threads) : 1, per_task = CeilDiv(groups, tasks);
  ParallelFor(pool, tasks, parallel, [&](int64_t task) {
    const int64_t first = task * per_task;
    tier.column_nibbles(tiles, n, k_words, last_mask, first, std::min(groups, first + per_task), columns);
  });
  return columns;
}

// The active tier's lane kernel where it has one and a reduction of k_words words is short enough to sum in its
// byte lanes at once, else null (the panel kernel).
LaneDotsFn LaneDotsForWords(int64_t k_words) { return k_words <= kLaneByteWords ? LaneDotsFor(ActiveIsa()) : nullptr; }

// A convolution's long reductions run on the lane kernel too, from this many gathered rows and up to
// kLaneConvMaxWords words: it reads the fields in frame where they lie, where the panel kernel copies each into its
// chunked layout, but it regroups the weights on every call (LaneTiles: a pass over o * k_words words). Past 62
// words it counts block by block so that four tile rows' words stay in L1; at 288 words neither kernel was faster
// (decisions.md).
constexpr int64_t kLaneMinRows = 64;
constexpr int64_t kLaneConvMaxWords = 192;

LaneDotsFn LaneDotsForConv(int64_t rows, int64_t k_words) {
  return rows >= kLaneMinRows && k_words <= kLaneConvMaxWords ? LaneDotsFor(ActiveIsa()) : LaneDotsForWords(k_words);
}

// `shape` with the weights' bytes per column as the lane kernel reads them (LaneTiles).
GemmShape LaneShape(GemmShape shape, int64_t k_words) {
  shape.column_bytes = k_words * kLaneWordNibbles * 4;
  return shape;
}

// Offsets 0, 1, ..., k_words - 1: the words of a row that lie side by side.
std::vector<int64_t> ContiguousOffsets(int64_t k_words) {
  std::vector<int64_t> offsets(k_words);
  std::iota(offsets.begin(), offsets.end(), int64_t{0});
  return offsets;
}

// Rows of `a`, packed with their padding bits cleared.
struct BmmRows {
  const uint32_t* a;
  int64_t k_words, chunks;
  int32_t k;
  const uint32_t* weight_mask;

  PackedPanel Fill(int64_t first, int64_t count, Scratch& scratch) const {
    int32_t* k_valid = Grow(scratch.row_term, count);
    uint8_t* excluded = Grow(scratch.excluded, count);
    uint32_t* panel = Grow(scratch.panel, RoundUp(count, kGroupRows) * chunks * kChunkWords);
    const uint32_t last_mask = formats::LastWordMask(k);
    for (int64_t r = 0; r < count; ++r) {
      k_valid[r] = k;
      excluded[r] = 0;
      PanelRow(panel, chunks, r).Put(a + (first + r) * k_words, k_words, last_mask, chunks);
    }
    return PackedPanel{panel, count, chunks, k_valid, weight_mask};
  }

  void AddExcludedTaps(const Scratch&, int64_t, int64_t, int64_t, int32_t*) const {}  // bmm excludes nothing
};

// Rows of `a` as the tables of their nibbles (RowTablesFn), the padding bits of the last word cleared first.
struct BmmTableRows {
  const uint32_t* a;
  int64_t k_words;
  int32_t k;
  RowTablesFn row_tables;

  TableRows Fill(int64_t first, int64_t count, Scratch& scratch) const {
    const int64_t row_bytes = k_words * 8 * 16;
    uint8_t* tables = Grow(scratch.tables, count * row_bytes);
    int32_t* k_valid = Grow(scratch.row_term, count);
    const uint32_t last_mask = formats::LastWordMask(k);
    for (int64_t r = 0; r < count; ++r) {
      row_tables(a + (first + r) * k_words, k_words, last_mask, tables + r * row_bytes);
      k_valid[r] = k;
    }
    return TableRows{tables, count, k_valid};
  }
};

// Rows of `a` for the lane kernel: read where they lie when their words hold no padding bits, else copied with
// the padding bits of the last word cleared.
struct BmmLaneRows {
  const uint32_t* a;
  int64_t k_words;
  int32_t k;
  const int64_t* contiguous;  // ContiguousOffsets

  LaneRows Fill(int64_t first, int64_t count, Scratch& scratch) const {
    int32_t* k_valid = Grow(scratch.row_term, count);
    const uint32_t** base = Grow(scratch.row_base, count);
    const int64_t** offsets = Grow(scratch.row_offsets, count);
    const uint32_t last_mask = formats::LastWordMask(k);
    uint32_t* copies = last_mask == ~0u || k_words == 0 ? nullptr : Grow(scratch.panel, count * k_words);
    for (int64_t r = 0; r < count; ++r) {
      const uint32_t* row = a + (first + r) * k_words;
      if (copies != nullptr) {
        uint32_t* copy = copies + r * k_words;
        std::copy(row, row + k_words, copy);
        copy[k_words - 1] &= last_mask;
        row = copy;
      }
      base[r] = row;
      offsets[r] = contiguous;
      k_valid[r] = k;
    }
    return LaneRows{base, offsets, count, 1, k_valid, nullptr};
  }
};

// The receptive field of a conv row whose origin is `origin` into `line` (k_words words, tap t at t * c_words):
// out-of-frame taps 0, the padding bits of each tap's last word cleared (last_mask). Returns its taps in frame.
int64_t GatherField(const ConvWindows& windows, const uint32_t* x, const RowOrigin& origin, uint32_t last_mask,
                    uint32_t* line) {
  const Bconv2dProblem& p = windows.p;
  const int64_t run = p.kw * p.c_words;
  int64_t in_frame = 0;
  for (int64_t dy = 0; dy < p.kh; ++dy) {
    const int64_t iy = origin.y0 + dy;
    uint32_t* dst = line + dy * run;
    if (windows.RowInFrame(origin, dy)) {
      const uint32_t* src = x + windows.PixelOffset(origin.b, iy, origin.x0);
      for (int64_t i = 0; i < run; ++i) dst[i] = src[i];
      in_frame += p.kw;
      continue;
    }
    for (int64_t dx = 0; dx < p.kw; ++dx, dst += p.c_words) {
      if (windows.InFrame(iy, origin.x0 + dx)) {
        const uint32_t* src = x + windows.PixelOffset(origin.b, iy, origin.x0 + dx);
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
  return in_frame;
}

// Receptive fields of pooled output pixels, gathered from the NHWC image (ConvWindows).
struct ConvRows {
  ConvWindows windows;
  const uint32_t* x;
  const int32_t* tap_popcount;  // (kh * kw, o)
  int64_t chunks;
  const uint32_t* weight_mask;
  AddRowsFn add_doubled;

  PackedPanel Fill(int64_t first, int64_t count, Scratch& scratch) const {
    const Bconv2dProblem& p = windows.p;
    const int64_t window = p.pool_h * p.pool_w, taps = p.kh * p.kw;
    const int64_t rows = count * window;
    const int64_t row_words = chunks * kChunkWords;
    const uint32_t last_mask = formats::LastWordMask(p.c);
    uint32_t* panel = Grow(scratch.panel, RoundUp(rows, kGroupRows) * row_words);
    int32_t* k_valid = Grow(scratch.row_term, rows);
    uint8_t* excluded = Grow(scratch.excluded, rows);
    RowOrigin* origins = Grow(scratch.origins, rows);
    windows.Origins(first, count, origins);
    // Each receptive field is gathered into one contiguous line (its padding words past k_words stay 0),
    // masked, then copied into the panel a whole chunk at a time: cheaper than placing the few words of each
    // tap in the panel's chunk-interleaved layout one by one.
    uint32_t* line = Grow(scratch.line, row_words);
    std::fill(line, line + row_words, 0u);
    const int64_t run = p.kw * p.c_words, image_row = windows.PixelOffset(0, 1, 0);
    const int32_t k_all = static_cast<int32_t>(taps * p.c);
    const bool three_by_three = p.kh == 3 && p.kw == 3;
    for (int64_t r = 0; r < rows; ++r) {
      const auto [b, y0, x0] = origins[r];
      if (last_mask == ~0u && windows.FieldInFrame(origins[r])) {
        // whole channel words, every tap in frame: the kernel rows' runs go straight into the panel
        const uint32_t* field = x + windows.PixelOffset(b, y0, x0);
        const PanelRow<> row(panel, chunks, r);
        if (!three_by_three || !row.PutThreeByThree(field, image_row, p.c_words)) {
          row.PutRuns(field, image_row, p.kh, run, chunks);
        }
        k_valid[r] = k_all;
        excluded[r] = 0;
        continue;
      }
      const int64_t in_frame = GatherField(windows, x, origins[r], last_mask, line);
      PanelRow(panel, chunks, r).Put(line, row_words, ~0u, chunks);
      const int64_t counted = p.pad_one ? taps : in_frame;
      k_valid[r] = static_cast<int32_t>(counted * p.c);
      excluded[r] = counted < taps;
    }
    return PackedPanel{panel, rows, chunks, k_valid, weight_mask};
  }

  // An excluded tap t read as 0 bits added popc(w_t) = tap_popcount[t, col] to the popcount of every
  // column, so -2 tap_popcount[t, col] to its dot: take it back.
  void AddExcludedTaps(const Scratch& scratch, int64_t row, int64_t col_begin, int64_t width, int32_t* dots) const {
    windows.AddExcludedTapTerms(scratch.origins[row], tap_popcount, col_begin, width, add_doubled, dots);
  }
};

// Receptive fields of pooled output pixels for the lane kernel: read straight from the NHWC image where every tap
// is in frame and whole channel words (field_offsets), else gathered (GatherField) into scratch. A row whose
// out-of-frame taps are excluded ("zero" padding) reads them as 0 bits, which added popc(w_t) = tap_popcount[t, c]
// to the popcount of column c: its correction row adds 2 tap_popcount[t, c] back, one row per rectangle of taps in
// frame, made once per task.
struct ConvLaneRows {
  ConvWindows windows;
  const uint32_t* x;
  const int32_t* tap_popcount;   // (kh * kw, o)
  const int64_t* field_offsets;  // word k of a field in frame, from its top-left tap's first word
  const int64_t* contiguous;     // ContiguousOffsets, for a gathered field

  LaneRows Fill(int64_t first, int64_t count, Scratch& scratch) const {
    const Bconv2dProblem& p = windows.p;
    const int64_t rows = count * p.pool_h * p.pool_w, taps = p.kh * p.kw;
    const uint32_t last_mask = formats::LastWordMask(p.c);
    int32_t* k_valid = Grow(scratch.row_term, rows);
    RowOrigin* origins = Grow(scratch.origins, rows);
    const uint32_t** base = Grow(scratch.row_base, rows);
    const int64_t** offsets = Grow(scratch.row_offsets, rows);
    uint32_t* gathered = Grow(scratch.panel, rows * p.k_words);
    windows.Origins(first, count, origins);
    windows.BeginCorrections(rows, scratch);
    const int32_t k_all = static_cast<int32_t>(taps * p.c);
    for (int64_t r = 0; r < rows; ++r) {
      const RowOrigin& origin = origins[r];
      if (last_mask == ~0u && windows.FieldInFrame(origin)) {
        base[r] = x + windows.PixelOffset(origin.b, origin.y0, origin.x0);
        offsets[r] = field_offsets;
        k_valid[r] = k_all;
        continue;
      }
      uint32_t* line = gathered + r * p.k_words;
      const int64_t in_frame = GatherField(windows, x, origin, last_mask, line);
      base[r] = line;
      offsets[r] = contiguous;
      const int64_t counted = p.pad_one ? taps : in_frame;
      k_valid[r] = static_cast<int32_t>(counted * p.c);
      if (counted < taps) scratch.correction_index[r] = windows.CorrectionRow(origin, tap_popcount, 2, scratch);
    }
    return LaneRows{base, offsets, rows, p.pool_h * p.pool_w, k_valid, windows.CorrectionPointers(rows, scratch)};
  }
};

}  // namespace

void RunBmm(const BmmProblem& problem, const uint32_t* a, const uint32_t* b_tiles, const EpilogueData& epilogue,
            void* out, ffi::ThreadPool* pool) {
  const int64_t chunks = CeilDiv(problem.k_words, kChunkWords);
  const std::vector<uint32_t> weight_mask = WeightMask(chunks, 1, problem.k_words, problem.k);
  std::vector<uint32_t> tile_storage;
  const uint32_t* tiles = KernelTiles(b_tiles, 0, problem.n, problem.k_words, problem.tile_rows,
                                      problem.tile_words, problem.k_tiles, tile_storage);
  const GemmShape shape{problem.m, 1, problem.n, chunks, chunks * kChunkWords * 4};
  const uint32_t* mask = weight_mask.empty() ? nullptr : weight_mask.data();
  if (const TableTier table = TableTierForBmm(problem.m, problem.k_words); table.dots != nullptr) {
    thread_local std::vector<uint8_t> nibble_storage;
    const uint8_t* columns =
        ColumnNibbles(table, tiles, problem.n, problem.k_words, problem.k, nibble_storage, pool);
    GemmShape table_shape = shape;
    table_shape.column_bytes = problem.k_words * 8;
    RunGemm(BmmTableRows{a, problem.k_words, static_cast<int32_t>(problem.k), table.row_tables},
            TableKernel{table.dots, columns, problem.k_words * 8}, table_shape, epilogue, out, pool);
    return;
  }
  if (const LaneDotsFn lane_dots = LaneDotsForWords(problem.k_words)) {
    std::vector<uint32_t> lane_storage;
    const uint32_t* lanes = LaneTiles(tiles, problem.n, problem.k_words, mask, lane_storage);
    const std::vector<int64_t> contiguous = ContiguousOffsets(problem.k_words);
    RunGemm(BmmLaneRows{a, problem.k_words, static_cast<int32_t>(problem.k), contiguous.data()},
            LaneKernel{lane_dots, lanes, problem.k_words}, LaneShape(shape, problem.k_words), epilogue, out, pool);
    return;
  }
  RunGemm(BmmRows{a, problem.k_words, chunks, static_cast<int32_t>(problem.k), mask},
          BinaryKernel{PanelDotsFor(ActiveIsa()), tiles, chunks}, shape, epilogue, out, pool);
}

void RunBmmChain(const std::vector<ChainLayer>& layers, const uint32_t* a, void* out, ffi::ThreadPool* pool) {
  const int64_t count = static_cast<int64_t>(layers.size());
  const int64_t m = layers[0].problem.m;
  if (m == 0) return;
  struct Weights {
    std::vector<uint32_t> mask, tile_storage;
    const uint32_t* tiles;
    int64_t chunks;
    const uint8_t* columns = nullptr;  // ColumnNibbles, where a round of this layer takes the table kernel
  };
  std::vector<Weights> weights(count);
  thread_local std::vector<std::vector<uint8_t>> nibble_storage;  // per layer, kept from call to call
  if (static_cast<int64_t>(nibble_storage.size()) < count) nibble_storage.resize(count);
  int64_t work = 0, widest_words = 0;  // widest_words: the widest bits between two layers
  for (int64_t l = 0; l < count; ++l) {
    const BmmProblem& p = layers[l].problem;
    Weights& w = weights[l];
    w.chunks = CeilDiv(p.k_words, kChunkWords);
    w.mask = WeightMask(w.chunks, 1, p.k_words, p.k);
    w.tiles = KernelTiles(layers[l].b_tiles, 0, p.n, p.k_words, p.tile_rows, p.tile_words, p.k_tiles, w.tile_storage);
    if (const TableTier table = TableTierForBmm(m, p.k_words); table.dots != nullptr) {
      w.columns = ColumnNibbles(table, w.tiles, p.n, p.k_words, p.k, nibble_storage[l], pool);
    }
    work += GemmWork(GemmShape{m, 1, p.n, w.chunks, 0});
    if (l + 1 < count) widest_words = std::max(widest_words, formats::WordsForBits(p.n));
  }
  const int64_t round_rows =
      widest_words == 0 ? m : std::min(m, std::max(kPanelRows, kChainRoundBytes / (4 * widest_words)));
  std::vector<uint32_t> between[2];
  if (count > 1) {
    for (auto& buffer : between) buffer.resize(round_rows * widest_words);
  }
  const int64_t threads = PoolThreads(pool);
  const bool parallel = threads > 1 && work >= kMinParallelWork;
  const PanelDotsFn panel_dots = PanelDotsFor(ActiveIsa());
  const BmmProblem& last = layers[count - 1].problem;
  const int64_t out_row_bytes =
      layers[count - 1].epilogue.kind == Epilogue::kThreshold ? 4 * formats::WordsForBits(last.n) : 4 * last.n;
  // step r * count + l: layer l of the rows of round r, reading the layer before's bits (a buffer alternately), on
  // the panel kernel or on the table kernel (steps[step] indexes panel_steps or table_steps)
  std::vector<GemmTasks<BmmRows, BinaryKernel>> panel_steps;
  std::vector<GemmTasks<BmmTableRows, TableKernel>> table_steps;
  std::vector<std::pair<bool, size_t>> steps;
  const TableTier table = TableTierFor(ActiveIsa());
  std::vector<int64_t> tasks;
  for (int64_t first = 0; first < m; first += round_rows) {
    const int64_t rows = std::min(round_rows, m - first);
    for (int64_t l = 0; l < count; ++l) {
      const BmmProblem& p = layers[l].problem;
      const Weights& w = weights[l];
      const uint32_t* input = l == 0 ? a + first * p.k_words : between[(l - 1) % 2].data();
      void* output = l + 1 == count ? static_cast<char*>(out) + first * out_row_bytes
                                    : static_cast<void*>(between[l % 2].data());
      if (w.columns != nullptr && rows >= kTableMinRows) {
        table_steps.emplace_back(BmmTableRows{input, p.k_words, static_cast<int32_t>(p.k), table.row_tables},
                                 TableKernel{table.dots, w.columns, p.k_words * 8},
                                 GemmShape{rows, 1, p.n, w.chunks, p.k_words * 8}, layers[l].epilogue, output, threads,
                                 parallel);
        steps.emplace_back(true, table_steps.size() - 1);
        tasks.push_back(table_steps.back().count());
        continue;
      }
      panel_steps.emplace_back(BmmRows{input, p.k_words, w.chunks, static_cast<int32_t>(p.k),
                                       w.mask.empty() ? nullptr : w.mask.data()},
                               BinaryKernel{panel_dots, w.tiles, w.chunks},
                               GemmShape{rows, 1, p.n, w.chunks, w.chunks * kChunkWords * 4}, layers[l].epilogue,
                               output, threads, parallel);
      steps.emplace_back(false, panel_steps.size() - 1);
      tasks.push_back(panel_steps.back().count());
    }
  }
  ParallelForSteps(pool, tasks, parallel, [&](int64_t step, int64_t task) {
    const auto [on_table, index] = steps[step];
    if (on_table) {
      table_steps[index](task);
    } else {
      panel_steps[index](task);
    }
  });
}

void RunBconv2d(const Bconv2dProblem& problem, const uint32_t* x, const uint32_t* w_tiles,
                const int32_t* w_tap_popcount, const EpilogueData& epilogue, void* out, ffi::ThreadPool* pool) {
  const int64_t chunks = CeilDiv(problem.k_words, kChunkWords);
  const std::vector<uint32_t> weight_mask =
      WeightMask(chunks, problem.kh * problem.kw, problem.c_words, problem.c);
  std::vector<uint32_t> tile_storage;
  const uint32_t* tiles = KernelTiles(w_tiles, 0, problem.o, problem.k_words, problem.tile_rows,
                                      problem.tile_words, problem.k_tiles, tile_storage);
  const int64_t outputs = problem.batch * problem.out_h * problem.out_w;
  const GemmShape shape{outputs, problem.pool_h * problem.pool_w, problem.o, chunks, chunks * kChunkWords * 4};
  const uint32_t* mask = weight_mask.empty() ? nullptr : weight_mask.data();
  const ConvWindows windows{problem};
  if (const LaneDotsFn lane_dots = LaneDotsForConv(outputs * shape.rows_per_output, problem.k_words)) {
    std::vector<uint32_t> lane_storage;
    const uint32_t* lanes = LaneTiles(tiles, problem.o, problem.k_words, mask, lane_storage);
    std::vector<int64_t> field_offsets(problem.k_words);
    for (int64_t word = 0; word < problem.k_words; ++word) {
      const int64_t tap = word / problem.c_words;
      field_offsets[word] = windows.PixelOffset(0, tap / problem.kw, tap % problem.kw) + word % problem.c_words;
    }
    const std::vector<int64_t> contiguous = ContiguousOffsets(problem.k_words);
    RunGemm(ConvLaneRows{windows, x, w_tap_popcount, field_offsets.data(), contiguous.data()},
            LaneKernel{lane_dots, lanes, problem.k_words}, LaneShape(shape, problem.k_words), epilogue, out, pool);
    return;
  }
  RunGemm(ConvRows{windows, x, w_tap_popcount, chunks, mask, AddRowsFor(ActiveIsa(), 2)},
          BinaryKernel{PanelDotsFor(ActiveIsa()), tiles, chunks}, shape, epilogue, out, pool);
}

}  // namespace jaxbnn::cpu
