// Ternary and mixed bmm / conv2d: panels of the planes ternary_dots.h reads, gathered from the activations, or the
// rows of its lane kernels, read where they lie; and the per-column terms from the weights' popcounts.
//
// Ternary activations enter the kernels as (a, z_x), z_x = NOT (a XOR b) masked to the real channels, formed
// once per call (a convolution gathers each pixel KH * KW times). Padding is exact without corrections
// wherever the activations are ternary: an out-of-frame tap is the value 0 for pad_value "zero" (z_x = 0)
// and -1 for "one" (a = 0, z_x = the real channel bits). Binary activations (BTN) have no 0: an
// out-of-frame tap is read as -1 (bits 0), which adds -sum(w_tap) to a dot; for "zero" the dots take it
// back with the tap sums popc(pos_tap) + popc(nonneg_tap) - c. Padding bits of the weights never count (z_w
// is masked), nor those of the activations (z_x is masked; BTN's only meet z_w).
#include "cpu/ternary_kernels.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "common/formats.h"
#include "cpu/gemm_driver.h"
#include "cpu/parallel_for.h"

namespace jaxbnn::cpu {
namespace {

using namespace gemm;

constexpr int64_t kConvertTaskWords = int64_t{1} << 14;  // activation words formed by one task

inline int32_t Popcount32(uint32_t v) {  // the module targets baseline x86-64: no popcnt instruction here
  v = v - ((v >> 1) & 0x55555555u);
  v = (v & 0x33333333u) + ((v >> 2) & 0x33333333u);
  return static_cast<int32_t>((((v + (v >> 4)) & 0x0F0F0F0Fu) * 0x01010101u) >> 24);
}

// The activations as the kernels take them: plane0 the bits (BTN) or a; plane1 z_x, plane_distance words after
// plane0 (so that a lane kernel row finds word k of z_x at the offset of word k of a plus plane_distance); `nonzero`
// TBN's popc(z_x) of each run (a row of a matrix, a pixel of an image).
struct SourcePlanes {
  const uint32_t* plane0;
  const uint32_t* plane1;
  int64_t plane_distance;
  const int32_t* nonzero;
};

// What a call keeps alive for its kernels: the nonneg and the formed z_x planes, one after the other, and the runs'
// popcounts.
struct ActivationStorage {
  std::unique_ptr<uint32_t[]> planes;
  std::unique_ptr<int32_t[]> nonzero_counts;
};

// `runs` runs of `words` words holding `bits` real bits each (rows, or pixels); ternary activations hold each
// run's two planes side by side (2 * words words a run), which the panels take as two planes of their own,
// written here in one pass over the activations.
SourcePlanes PrepareActivations(Mix mix, const ActivationPlanes& x, int64_t runs, int64_t words, int64_t bits,
                                ffi::ThreadPool* pool, ActivationStorage& storage) {
  if (mix == Mix::kBtn) return SourcePlanes{x.words, nullptr, 0, nullptr};
  const int64_t plane_words = std::max<int64_t>(1, runs * words);
  storage.planes.reset(new uint32_t[2 * plane_words]);
  storage.nonzero_counts.reset(mix == Mix::kTbn ? new int32_t[std::max<int64_t>(1, runs)] : nullptr);
  uint32_t* const a = storage.planes.get();
  uint32_t* const z = a + plane_words;
  int32_t* const counts = storage.nonzero_counts.get();
  const uint32_t last_mask = formats::LastWordMask(bits);
  const int64_t runs_per_task = std::max<int64_t>(1, kConvertTaskWords / std::max<int64_t>(1, 2 * words));
  const int64_t tasks = CeilDiv(runs, runs_per_task);
  ParallelFor(pool, tasks, PoolThreads(pool) > 1 && tasks > 1, [&](int64_t task) {
    for (int64_t run = task * runs_per_task; run < std::min(runs, (task + 1) * runs_per_task); ++run) {
      const uint32_t* nonneg = x.words + run * 2 * words;
      const uint32_t* pos = nonneg + words;
      uint32_t* a_run = a + run * words;
      uint32_t* z_run = z + run * words;
      int32_t count = 0;
      for (int64_t w = 0; w < words; ++w) {
        a_run[w] = nonneg[w];
        z_run[w] = ~(nonneg[w] ^ pos[w]) & (w + 1 == words ? last_mask : ~0u);
        if (counts != nullptr) count += Popcount32(z_run[w]);
      }
      if (counts != nullptr) counts[run] = count;
    }
  });
  return SourcePlanes{a, z, plane_words, counts};
}

// One receptive field being gathered into a contiguous line per plane (plane p at words + p * row_words),
// which is then copied into the panel a whole chunk at a time, as the binary gather does (bit_kernels.cc).
template <Mix kMix>
struct MixedLine {
  static constexpr int kPlanes = PanelPlanes(kMix);
  uint32_t* words;
  int64_t row_words;
  int32_t nonzero = 0;  // TBN: popc(z_x) so far

  // Words [word, word + count): `runs` runs from run `first_run` on, at word `offset` of the activations.
  JAXBNN_ALWAYS_INLINE void Put(int64_t word, const SourcePlanes& x, int64_t first_run, int64_t runs, int64_t offset,
                                int64_t count) {
    for (int64_t i = 0; i < count; ++i) words[word + i] = x.plane0[offset + i];
    if constexpr (kPlanes == 2) {
      for (int64_t i = 0; i < count; ++i) words[row_words + word + i] = x.plane1[offset + i];
    }
    if constexpr (kMix == Mix::kTbn) {
      for (int64_t run = first_run; run < first_run + runs; ++run) nonzero += x.nonzero[run];
    }
  }

  // An out-of-frame tap of `count` words: the value 0 (zero) or -1 (one, or BTN's stand-in for 0).
  JAXBNN_ALWAYS_INLINE void PutPadding(int64_t word, int64_t count, bool minus_one, uint32_t last_mask,
                                       int32_t channels) {
    for (int64_t i = 0; i < count; ++i) words[word + i] = 0;
    if constexpr (kPlanes == 2) {
      uint32_t* z = words + row_words + word;
      for (int64_t i = 0; i < count; ++i) z[i] = minus_one ? ~0u : 0u;
      if (minus_one) z[count - 1] = last_mask;
      if (kMix == Mix::kTbn && minus_one) nonzero += channels;
    }
  }

  // The receptive field at `origin`, each tap at word tap * c_words: an out-of-frame tap as pad_value says (BTN: -1
  // whatever it says, AddExcludedTaps or a correction row taking "zero" back). Returns whether a tap was out of frame.
  JAXBNN_ALWAYS_INLINE bool Gather(const ConvWindows& windows, const SourcePlanes& x, const RowOrigin& origin) {
    const Bconv2dProblem& p = windows.p;
    const uint32_t last_mask = formats::LastWordMask(p.c);
    const int32_t channels = static_cast<int32_t>(p.c);
    bool out_of_frame = false;
    for (int64_t dy = 0; dy < p.kh; ++dy) {
      const int64_t iy = origin.y0 + dy, word = dy * p.kw * p.c_words;
      if (windows.RowInFrame(origin, dy)) {
        const int64_t pixel = windows.Pixel(origin.b, iy, origin.x0);
        Put(word, x, pixel, p.kw, pixel * p.c_words, p.kw * p.c_words);
        continue;
      }
      for (int64_t dx = 0; dx < p.kw; ++dx) {
        if (windows.InFrame(iy, origin.x0 + dx)) {
          const int64_t pixel = windows.Pixel(origin.b, iy, origin.x0 + dx);
          Put(word + dx * p.c_words, x, pixel, 1, pixel * p.c_words, p.c_words);
        } else {
          PutPadding(word + dx * p.c_words, p.c_words, p.pad_one || kMix == Mix::kBtn, last_mask, channels);
          out_of_frame = true;
        }
      }
    }
    return out_of_frame;
  }

  // Into panel row r, each plane whole.
  JAXBNN_ALWAYS_INLINE void CopyTo(uint32_t* panel, int64_t chunks, int64_t r) const {
    for (int plane = 0; plane < kPlanes; ++plane) {
      PanelRow<kPlanes>(panel, chunks, r, plane).Put(words + plane * row_words, row_words, ~0u, chunks);
    }
  }
};

template <Mix kMix>
int64_t PanelWords(int64_t rows, int64_t chunks) {
  return RoundUp(rows, kGroupRows) * chunks * kChunkWords * PanelPlanes(kMix);
}

// Rows of the activation matrix.
template <Mix kMix>
struct MixedBmmRows {
  SourcePlanes a;
  int64_t k_words, chunks;

  MixedPanel Fill(int64_t first, int64_t count, Scratch& scratch) const {
    int32_t* row_term = Grow(scratch.row_term, count);
    uint8_t* excluded = Grow(scratch.excluded, count);
    uint32_t* panel = Grow(scratch.panel, PanelWords<kMix>(count, chunks));
    for (int64_t r = 0; r < count; ++r) {
      const int64_t offset = (first + r) * k_words;
      PanelRow<PanelPlanes(kMix)>(panel, chunks, r, 0).Put(a.plane0 + offset, k_words, ~0u, chunks);
      if constexpr (PanelPlanes(kMix) == 2) {
        PanelRow<2>(panel, chunks, r, 1).Put(a.plane1 + offset, k_words, ~0u, chunks);
      }
      row_term[r] = kMix == Mix::kTbn ? a.nonzero[first + r] : 0;  // the row's term (ternary_dots.h)
      excluded[r] = 0;
    }
    return MixedPanel{panel, count, chunks, row_term};
  }

  void AddExcludedTaps(const Scratch&, int64_t, int64_t, int64_t, int32_t*) const {}  // bmm excludes nothing
};

// Receptive fields of pooled output pixels, gathered from the NHWC planes (ConvWindows).
template <Mix kMix>
struct MixedConvRows {
  ConvWindows windows;
  SourcePlanes x;
  const int32_t* tap_sum;  // BTN with "zero" padding: (kh * kw, o), sum(w_tap) per tap and output channel
  int64_t chunks;
  AddRowsFn add_rows;

  MixedPanel Fill(int64_t first, int64_t count, Scratch& scratch) const {
    const Bconv2dProblem& p = windows.p;
    const int64_t rows = count * p.pool_h * p.pool_w;
    const uint32_t last_mask = formats::LastWordMask(p.c);
    uint32_t* panel = Grow(scratch.panel, PanelWords<kMix>(rows, chunks));
    int32_t* row_term = Grow(scratch.row_term, rows);
    uint8_t* excluded = Grow(scratch.excluded, rows);
    RowOrigin* origins = Grow(scratch.origins, rows);
    windows.Origins(first, count, origins);
    const int64_t row_words = chunks * kChunkWords;
    uint32_t* line = Grow(scratch.line, PanelPlanes(kMix) * row_words);
    std::fill(line, line + PanelPlanes(kMix) * row_words, 0u);  // the words past k_words stay 0
    const bool three_by_three = p.kh == 3 && p.kw == 3 && last_mask == ~0u;
    const int64_t image_row = windows.PixelOffset(0, 1, 0);
    for (int64_t r = 0; r < rows; ++r) {
      const auto [b, y0, x0] = origins[r];
      if (three_by_three && windows.FieldInFrame(origins[r]) && PutThreeByThree(r, b, y0, x0, image_row, panel, row_term)) {
        excluded[r] = 0;
        continue;
      }
      MixedLine<kMix> row{line, row_words};
      const bool out_of_frame = row.Gather(windows, x, origins[r]);
      row.CopyTo(panel, chunks, r);
      row_term[r] = row.nonzero;  // the row's term (ternary_dots.h): TBN's popc(z_x), 0 otherwise
      excluded[r] = kMix == Mix::kBtn && !p.pad_one && out_of_frame;
    }
    return MixedPanel{panel, rows, chunks, row_term};
  }

  // A 3 x 3 field wholly in frame of whole channel words straight into panel row r, each plane
  // (PanelRow::PutThreeByThree), and its row term; false, nothing written, for widths that take the line.
  bool PutThreeByThree(int64_t r, int64_t b, int64_t y0, int64_t x0, int64_t image_row, uint32_t* panel,
                       int32_t* row_term) const {
    const Bconv2dProblem& p = windows.p;
    constexpr int kPlanes = PanelPlanes(kMix);
    const int64_t offset = windows.PixelOffset(b, y0, x0);
    if (!PanelRow<kPlanes>(panel, chunks, r, 0).PutThreeByThree(x.plane0 + offset, image_row, p.c_words)) return false;
    if constexpr (kPlanes == 2) PanelRow<2>(panel, chunks, r, 1).PutThreeByThree(x.plane1 + offset, image_row, p.c_words);
    int32_t nonzero = 0;  // the row's term (ternary_dots.h): TBN's popc(z_x), 0 otherwise
    if constexpr (kMix == Mix::kTbn) {
      const int64_t pixel = windows.Pixel(b, y0, x0);
      for (int64_t dy = 0; dy < 3; ++dy) {
        const int32_t* counts = x.nonzero + pixel + dy * p.width;
        nonzero += counts[0] + counts[1] + counts[2];
      }
    }
    row_term[r] = nonzero;
    return true;
  }

  // BTN, "zero" padding: an out-of-frame tap t read as -1 added -tap_sum[t, col]: take it back.
  void AddExcludedTaps(const Scratch& scratch, int64_t row, int64_t col_begin, int64_t width, int32_t* dots) const {
    windows.AddExcludedTapTerms(scratch.origins[row], tap_sum, col_begin, width, add_rows, dots);
  }
};

// The words of a lane kernel row (ternary_dots.h, MixedLaneDotsFn) that lie side by side: offsets 0 .. k_words - 1,
// and for ternary activations those of z_x, plane_distance further on.
template <Mix kMix>
std::vector<int64_t> ContiguousPlaneOffsets(int64_t k_words, int64_t plane_distance) {
  std::vector<int64_t> offsets(PanelPlanes(kMix) * k_words);
  for (int64_t k = 0; k < k_words; ++k) {
    offsets[k] = k;
    if constexpr (PanelPlanes(kMix) == 2) offsets[k_words + k] = plane_distance + k;
  }
  return offsets;
}

// Rows of the activation matrix for the lane kernel, read where they lie (the kernels gate out every padding bit).
template <Mix kMix>
struct MixedBmmLaneRows {
  SourcePlanes a;
  int64_t k_words;
  const int64_t* offsets;  // ContiguousPlaneOffsets(k_words, a.plane_distance)

  LaneRows Fill(int64_t first, int64_t count, Scratch& scratch) const {
    int32_t* row_term = Grow(scratch.row_term, count);
    const uint32_t** base = Grow(scratch.row_base, count);
    const int64_t** row_offsets = Grow(scratch.row_offsets, count);
    for (int64_t r = 0; r < count; ++r) {
      base[r] = a.plane0 + (first + r) * k_words;
      row_offsets[r] = offsets;
      row_term[r] = kMix == Mix::kTbn ? a.nonzero[first + r] : 0;  // the row's term (ternary_dots.h)
    }
    return LaneRows{base, row_offsets, count, 1, row_term, nullptr};
  }
};

// Receptive fields of pooled output pixels for the lane kernel: read straight from the NHWC planes where every tap
// is in frame (field_offsets), else gathered (MixedLine::Gather) into scratch, each plane k_words long. BTN with
// "zero" padding reads an out-of-frame tap t as -1, which added -tap_sum[t, c] to the dot of column c: the row's
// correction row adds it back.
template <Mix kMix>
struct MixedConvLaneRows {
  ConvWindows windows;
  SourcePlanes x;
  const int32_t* tap_sum;        // BTN with "zero" padding: (kh * kw, o), sum(w_tap) per tap and output channel
  const int64_t* field_offsets;  // of a field in frame: plane 0's words, then z_x's, from plane 0's first word
  const int64_t* contiguous;     // ContiguousPlaneOffsets(k_words, k_words), for a gathered field

  LaneRows Fill(int64_t first, int64_t count, Scratch& scratch) const {
    const Bconv2dProblem& p = windows.p;
    constexpr int kPlanes = PanelPlanes(kMix);
    const int64_t rows = count * p.pool_h * p.pool_w;
    int32_t* row_term = Grow(scratch.row_term, rows);
    RowOrigin* origins = Grow(scratch.origins, rows);
    const uint32_t** base = Grow(scratch.row_base, rows);
    const int64_t** offsets = Grow(scratch.row_offsets, rows);
    uint32_t* gathered = Grow(scratch.panel, rows * kPlanes * p.k_words);
    windows.Origins(first, count, origins);
    windows.BeginCorrections(rows, scratch);
    for (int64_t r = 0; r < rows; ++r) {
      const RowOrigin& origin = origins[r];
      if (windows.FieldInFrame(origin)) {
        base[r] = x.plane0 + windows.PixelOffset(origin.b, origin.y0, origin.x0);
        offsets[r] = field_offsets;
        int32_t nonzero = 0;  // the row's term (ternary_dots.h): TBN's popc(z_x), 0 otherwise
        if constexpr (kMix == Mix::kTbn) {
          for (int64_t dy = 0; dy < p.kh; ++dy) {
            const int32_t* counts = x.nonzero + windows.Pixel(origin.b, origin.y0 + dy, origin.x0);
            for (int64_t dx = 0; dx < p.kw; ++dx) nonzero += counts[dx];
          }
        }
        row_term[r] = nonzero;
        continue;
      }
      MixedLine<kMix> line{gathered + r * kPlanes * p.k_words, p.k_words};
      const bool out_of_frame = line.Gather(windows, x, origin);
      base[r] = line.words;
      offsets[r] = contiguous;
      row_term[r] = line.nonzero;
      if (kMix == Mix::kBtn && !p.pad_one && out_of_frame) {
        scratch.correction_index[r] = windows.CorrectionRow(origin, tap_sum, 1, scratch);
      }
    }
    return LaneRows{base, offsets, rows, p.pool_h * p.pool_w, row_term, windows.CorrectionPointers(rows, scratch)};
  }
};

// The weights in kernel tiles, their reduction mask and per-column terms, and the kernel of the active tier.
struct MixedKernel {
  MixedDotsFn dots_fn;
  MixedWeights weights;  // of every output column

  void operator()(const MixedPanel& panel, int64_t col_begin, int64_t tiles, int32_t* dots, int64_t stride) const {
    const int64_t offset = col_begin / kTileRows * weights.chunks * kTileChunkWords;
    const MixedWeights run{weights.nonneg + offset, weights.pos == nullptr ? nullptr : weights.pos + offset,
                           weights.chunks, weights.mask, weights.col_term + col_begin};
    dots_fn(panel, run, tiles, dots, stride);
  }
};

// The weights of every output column as the lane kernels read them (ternary_dots.h, MixedLaneDotsFn), the column
// terms, and the lane kernel of the active tier; it pools and corrects the rows itself.
struct MixedLaneKernel {
  static constexpr bool kPoolsWindows = true;
  MixedLaneDotsFn lane_dots;
  const uint32_t* lanes;
  int64_t k_words, tile_words;
  const int32_t* col_term;

  void operator()(const LaneRows& rows, int64_t col_begin, int64_t tiles, int32_t* dots, int64_t stride) const {
    lane_dots(rows, lanes + col_begin / kTileRows * tile_words, k_words, col_term + col_begin, col_begin, tiles, dots,
              stride);
  }
};

// The lane kernel of `tier` over the weights `w` of n output columns, their lane tiles in `storage`.
MixedLaneKernel MixedLaneKernelOf(Mix mix, const MixedLaneTier& tier, const MixedWeights& w, int64_t n,
                                  int64_t k_words, std::unique_ptr<uint32_t[]>& storage) {
  const int64_t tiles = CeilDiv(n, kTileRows);
  const int64_t tile_words = k_words * LaneWeightPlanes(mix) * kLaneWordNibbles * kTileRows;
  storage.reset(new uint32_t[std::max<int64_t>(1, tiles * tile_words)]);  // every word written by tier.tiles
  tier.tiles(w, tiles, k_words, storage.get());
  return MixedLaneKernel{tier.dots, storage.get(), k_words, tile_words, w.col_term};
}

// What a call keeps alive for its kernel: the copied tiles (where the FSB weights were not the kernels'
// tiles already), the mask and the column terms.
struct WeightStorage {
  std::vector<uint32_t> nonneg, pos, mask;
  std::vector<int32_t> col_term;
};

// `nonzero(c)`: popc(z_w) of output column c (BTN's column term).
template <class Nonzero>
MixedKernel PrepareWeights(Mix mix, const uint32_t* tiles, int64_t n, int64_t k_words, int64_t tile_rows,
                           int64_t tile_words, int64_t k_tiles, std::vector<uint32_t> mask, Nonzero nonzero,
                           WeightStorage& storage) {
  const int64_t chunks = CeilDiv(k_words, kChunkWords);
  MixedWeights w{};
  w.chunks = chunks;
  w.nonneg = KernelTiles(tiles, 0, n, k_words, tile_rows, tile_words, k_tiles, storage.nonneg);
  storage.col_term.assign(RoundUp(n, kTileRows), 0);  // the kernels read whole 8-column tiles
  if (TernaryWeights(mix)) {
    w.pos = KernelTiles(tiles, n, n, k_words, tile_rows, tile_words, k_tiles, storage.pos);
    storage.mask = mask.empty() ? std::vector<uint32_t>(chunks * kChunkWords, ~0u) : std::move(mask);
    w.mask = storage.mask.data();
  }
  if (mix == Mix::kBtn) {
    for (int64_t c = 0; c < n; ++c) storage.col_term[c] = nonzero(c);
  }
  w.col_term = storage.col_term.data();
  return MixedKernel{MixedDotsFor(mix, ActiveIsa()), w};
}

// The lane kernels (ternary_dots.h) serve a product from this many reduction rows, fewer not repaying the weights'
// regrouping (MixedLaneTilesFn: a 1024 x 1024 TNN bmm of 8 rows -20%, a 3 x 3 x 512 TNN convolution of 49 rows -13%),
// and up to LaneMaxWords words: TNN's to 144, the zoo's longest (3 x 3 x 512 at batch 8 +17-35%, in blocks of 36
// words), TBN's and BTN's to 36, their panel kernels being as fast from 72 (3 x 3 x 128 +16% / +23%, 3 x 3 x 256
// -12% / -3%) (decisions.md).
constexpr int64_t kLaneMinRows = 64;
constexpr int64_t LaneMaxWords(Mix mix) { return mix == Mix::kTnn ? 144 : 36; }

// The active tier's lane kernel for a product of `rows` reduction rows of k_words words, or null functions (the
// panel kernel).
MixedLaneTier LaneTierFor(Mix mix, int64_t rows, int64_t k_words) {
  if (rows < kLaneMinRows || k_words > LaneMaxWords(mix)) return {nullptr, nullptr};
  return MixedLaneTierFor(mix, ActiveIsa());
}

// Bytes of weights a lane kernel reads per output column.
int64_t LaneColumnBytes(Mix mix, int64_t k_words) { return k_words * LaneWeightPlanes(mix) * kLaneWordNibbles * 4; }

template <Mix kMix>
void RunBmmOf(const BmmProblem& p, const SourcePlanes& a, const MixedKernel& kernel,
              const EpilogueData& epilogue, void* out, ffi::ThreadPool* pool) {
  const int64_t chunks = kernel.weights.chunks;
  if (const MixedLaneTier tier = LaneTierFor(kMix, p.m, p.k_words); tier.dots != nullptr) {
    std::unique_ptr<uint32_t[]> lane_storage;
    const MixedLaneKernel lane = MixedLaneKernelOf(kMix, tier, kernel.weights, p.n, p.k_words, lane_storage);
    const std::vector<int64_t> offsets = ContiguousPlaneOffsets<kMix>(p.k_words, a.plane_distance);
    RunGemm(MixedBmmLaneRows<kMix>{a, p.k_words, offsets.data()}, lane,
            GemmShape{p.m, 1, p.n, chunks, LaneColumnBytes(kMix, p.k_words)}, epilogue, out, pool);
    return;
  }
  MixedBmmRows<kMix> rows{a, p.k_words, chunks};
  const int64_t column_bytes = chunks * kChunkWords * 4 * (TernaryWeights(kMix) ? 2 : 1);
  RunGemm(rows, kernel, GemmShape{p.m, 1, p.n, chunks, column_bytes}, epilogue, out, pool);
}

template <Mix kMix>
void RunConvOf(const Bconv2dProblem& p, const SourcePlanes& x, const int32_t* tap_sum,
               const MixedKernel& kernel, const EpilogueData& epilogue, void* out, ffi::ThreadPool* pool) {
  const int64_t chunks = kernel.weights.chunks;
  const int64_t outputs = p.batch * p.out_h * p.out_w;
  const ConvWindows windows{p};
  if (const MixedLaneTier tier = LaneTierFor(kMix, outputs * p.pool_h * p.pool_w, p.k_words); tier.dots != nullptr) {
    std::unique_ptr<uint32_t[]> lane_storage;
    const MixedLaneKernel lane = MixedLaneKernelOf(kMix, tier, kernel.weights, p.o, p.k_words, lane_storage);
    std::vector<int64_t> field_offsets(PanelPlanes(kMix) * p.k_words);
    for (int64_t word = 0; word < p.k_words; ++word) {
      const int64_t tap = word / p.c_words;
      field_offsets[word] = windows.PixelOffset(0, tap / p.kw, tap % p.kw) + word % p.c_words;
      if constexpr (PanelPlanes(kMix) == 2) field_offsets[p.k_words + word] = field_offsets[word] + x.plane_distance;
    }
    const std::vector<int64_t> contiguous = ContiguousPlaneOffsets<kMix>(p.k_words, p.k_words);
    RunGemm(MixedConvLaneRows<kMix>{windows, x, tap_sum, field_offsets.data(), contiguous.data()}, lane,
            GemmShape{outputs, p.pool_h * p.pool_w, p.o, chunks, LaneColumnBytes(kMix, p.k_words)}, epilogue, out,
            pool);
    return;
  }
  MixedConvRows<kMix> rows{windows, x, tap_sum, chunks, AddRowsFor(ActiveIsa(), 1)};
  const int64_t column_bytes = chunks * kChunkWords * 4 * (TernaryWeights(kMix) ? 2 : 1);
  RunGemm(rows, kernel, GemmShape{outputs, p.pool_h * p.pool_w, p.o, chunks, column_bytes}, epilogue, out, pool);
}

}  // namespace

void RunMixedBmm(Mix mix, const BmmProblem& p, const ActivationPlanes& a, const uint32_t* w_tiles,
                 const int32_t* w_popcount, const EpilogueData& epilogue, void* out, ffi::ThreadPool* pool) {
  const int64_t chunks = CeilDiv(p.k_words, kChunkWords);
  WeightStorage storage;
  // A ternary weight is non-zero where its planes agree: popc(z_w) = k - popc(nonneg) + popc(pos).
  const MixedKernel kernel = PrepareWeights(
      mix, w_tiles, p.n, p.k_words, p.tile_rows, p.tile_words, p.k_tiles, WeightMask(chunks, 1, p.k_words, p.k),
      [&](int64_t c) { return static_cast<int32_t>(p.k - w_popcount[c] + w_popcount[p.n + c]); }, storage);
  ActivationStorage activations;
  const SourcePlanes planes = PrepareActivations(mix, a, p.m, p.k_words, p.k, pool, activations);
  switch (mix) {
    case Mix::kTnn: return RunBmmOf<Mix::kTnn>(p, planes, kernel, epilogue, out, pool);
    case Mix::kTbn: return RunBmmOf<Mix::kTbn>(p, planes, kernel, epilogue, out, pool);
    case Mix::kBtn: return RunBmmOf<Mix::kBtn>(p, planes, kernel, epilogue, out, pool);
  }
}

void RunMixedConv2d(Mix mix, const Bconv2dProblem& p, const ActivationPlanes& x, const uint32_t* w_tiles,
                    const int32_t* w_tap_popcount, const EpilogueData& epilogue, void* out, ffi::ThreadPool* pool) {
  const int64_t chunks = CeilDiv(p.k_words, kChunkWords);
  const int64_t taps = p.kh * p.kw;
  WeightStorage storage;
  const MixedKernel kernel = PrepareWeights(
      mix, w_tiles, p.o, p.k_words, p.tile_rows, p.tile_words, p.k_tiles, WeightMask(chunks, taps, p.c_words, p.c),
      [&](int64_t c) {
        int64_t nonzero = 0;
        for (const int32_t* tap = w_tap_popcount; tap < w_tap_popcount + taps * 2 * p.o; tap += 2 * p.o) {
          nonzero += p.c - tap[c] + tap[p.o + c];
        }
        return static_cast<int32_t>(nonzero);
      },
      storage);
  std::vector<int32_t> tap_sum;
  if (mix == Mix::kBtn && !p.pad_one) {
    tap_sum.resize(taps * p.o);
    for (int64_t t = 0; t < taps; ++t) {
      for (int64_t c = 0; c < p.o; ++c) {
        tap_sum[t * p.o + c] =
            static_cast<int32_t>(w_tap_popcount[t * 2 * p.o + p.o + c] + w_tap_popcount[t * 2 * p.o + c] - p.c);
      }
    }
  }
  ActivationStorage activations;
  const SourcePlanes planes =
      PrepareActivations(mix, x, p.batch * p.height * p.width, p.c_words, p.c, pool, activations);
  switch (mix) {
    case Mix::kTnn: return RunConvOf<Mix::kTnn>(p, planes, tap_sum.data(), kernel, epilogue, out, pool);
    case Mix::kTbn: return RunConvOf<Mix::kTbn>(p, planes, tap_sum.data(), kernel, epilogue, out, pool);
    case Mix::kBtn: return RunConvOf<Mix::kBtn>(p, planes, tap_sum.data(), kernel, epilogue, out, pool);
  }
}

}  // namespace jaxbnn::cpu
