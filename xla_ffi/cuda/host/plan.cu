// ---------------------------------------------------------------------------------------------------
// Host side: a launch is planned once per problem shape and replayed from a cache.
//
// Planning (which kernel, its grid and shared memory, the band layout, the tensor maps) took the launcher
// 4.3-6.2 us of host time per call (kernel harness): about half the ~9 us a C = 128
// convolution takes on the GPU, paid again whenever XLA calls the handler. A plan depends on the problem's
// shape, the operands' alignment and the device alone; only its tensor maps hold operand addresses, so a
// cached plan is re-pointed (its maps re-encoded from their recipes) when a call brings other buffers.
#include "cuda/host/plan.h"

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/device/geometry.cuh"
#include "cuda/kernels/classic.h"
#include "cuda/kernels/dense_taps.h"
#include "cuda/kernels/wgmma_band.h"
#include "cuda/kernels/wgmma_persistent.h"
#include "cuda/kernels/wgmma_resident.h"

namespace jaxbnn::cuda {

LaunchDivisors DivisorsOf(const BinaryGemmProblem& p) {
  return {FastDivisor(p.cw), FastDivisor(p.kw), FastDivisor(p.cw * 4), FastDivisor(p.out_h * p.out_w),
          FastDivisor(p.out_w)};
}

int TilesOfRows(const BinaryGemmProblem& p, int rows) {
  const int pooled_per_tile = rows / (p.pool_h * p.pool_w);
  return (p.pooled_rows + pooled_per_tile - 1) / pooled_per_tile;
}

// The fields the launcher derives from the shape: the frame's largest excess, "one" padding where no
// receptive field reaches past the frame (a BMM, a convolution without padding: both paddings then agree,
// and as "one" padding the kernels skip the per-row border tests and the correction table; through XLA, a
// BMM as "zero" padding ran 17% longer), and whether the tiles keep the correction table.
void DeriveFromShape(BinaryGemmProblem& p) {
  p.max_excess = MaxExcessOf(p);
  if (!p.pad_one && BorderClasses(p) == 1) p.pad_one = true;
  p.compact_classes = UsesCompactClasses(p);
  p.class_numbering = ClassNumberingOf(p);
  p.correction_table = KeepsCorrectionTable(p);
  p.edge_table = KeepsEdgeTable(p);
  p.edge_corners = KeepsEdgeCorners(p);
}

// Points the plan at the operands of `p` (same shape): its problem, and its tensor maps re-encoded where an
// address moved. False where a map cannot be made for the new address.
bool Repoint(LaunchPlan& plan, const BinaryGemmProblem& p) {
  const bool x_moved = plan.p.x != p.x, w_moved = plan.p.w != p.w;
  plan.p = p;
  DeriveFromShape(plan.p);
  return (!x_moved || Encode(plan.a_recipe, p.x, plan.a_map)) && (!w_moved || Encode(plan.w_recipe, p.w, plan.w_map));
}

// One tile per CTA of ClassicKernel<Engine>; 16-byte activation copies where every tap's words are aligned.
template <class Engine>
LaunchPlan PlanClassic(const BinaryGemmProblem& p, bool aligned, KernelPath path) {
  LaunchPlan plan;
  plan.kind = LaunchPlan::Kind::kClassic;
  plan.path = path;
  plan.kernel = ClassicKernelInstance<Engine>(aligned, IsResidual(p.epilogue), p.doubled_k_blocks > 0);
  plan.threads = Engine::kThreads;
  plan.smem = ClassicSmemBytes<Engine>();
  plan.p = p;
  plan.div = DivisorsOf(p);
  plan.m_tiles = TilesOfRows(p, Engine::kRows);
  plan.n_tiles = (p.n + Engine::kCols - 1) / Engine::kCols;
  const long long tiles = static_cast<long long>(plan.m_tiles) * plan.n_tiles;
  plan.ctas = tiles > INT_MAX ? 0 : static_cast<unsigned>(tiles);  // 0: too many tiles (refused at launch)
  return plan;
}

// DenseTapKernel (UsesDenseTaps): as many CTAs as fit the SMs at once (three an SM where the shared memory
// takes them), the column tiles shared out evenly, each CTA at least one row tile.
LaunchPlan PlanDenseTaps(const BinaryGemmProblem& p, const DeviceInfo& info) {
  using Engine = MmaSyncDenseTaps;
  LaunchPlan plan;
  plan.kind = LaunchPlan::Kind::kDenseTaps;
  plan.path = KernelPath::kMmaSync;
  const bool edge_borders = DenseBorderBounds(p) && !DensePrefixSums<Engine>(p);
  plan.kernel = DenseTapKernelInstance(edge_borders, IsResidual(p.epilogue));
  plan.threads = Engine::kThreads;
  plan.smem = DenseTapSmem<Engine>::kBytes;
  plan.p = p;
  plan.div = DivisorsOf(p);
  plan.m_tiles = TilesOfRows(p, Engine::kRows);
  const int n_tiles = (p.n + Engine::kCols - 1) / Engine::kCols;
  const int per_sm = std::max(1, std::min(kDenseTapCtasPerSm, info.smem_per_sm / (plan.smem + info.smem_reserved)));
  plan.ctas_per_column = std::max(1, std::min(plan.m_tiles, per_sm * info.sms / n_tiles));
  const long long ctas = static_cast<long long>(n_tiles) * plan.ctas_per_column;
  plan.ctas = ctas > INT_MAX ? 0 : static_cast<unsigned>(ctas);  // 0: too many (refused at launch)
  return plan;
}

// ResidentWgmmaKernel where it can run `p`: unpooled, the column tile's weights within the shared memory left
// by the rest, at least one CTA per column tile, and activations by TMA in 64-row boxes, or by cp.async where
// no box takes them (14 x 14 or 7 x 7 images, stride 2) but the grid is small (below) or the epilogue is the
// int16 stream's residual one: 16-byte copies, more than one short K block (WgmmaKernel's short-K instances take
// those). A residual epilogue is the int16 stream's only (its shortcut staged: ResidentStagedBytes), on 128-column
// tiles where 256-column ones do not fit with their stages (a 3x3 convolution at C = 512). False (nothing
// planned) otherwise.
bool PlanResident(const BinaryGemmProblem& p, const DeviceInfo& info, LaunchPlan& plan) {
  const bool residual = IsResidual(p.epilogue);
  if (p.epilogue == Epilogue::kResidual) return false;  // (its residual instances stage an int16 shortcut only)
  const int m_tiles = TilesOfRows(p, kWgRows), wide_n_tiles = (p.n + kWgCols - 1) / kWgCols;
  // Column tiles of 128 (m64n128 wgmmas) where N <= 128, and where 256-column tiles would leave half the SMs
  // or more idle (batch-8 layers, small-batch GEMMs): twice the CTAs, each with half the weight bytes and
  // half the tensor work of its tile.
  const bool small_grid = 2ll * m_tiles * wide_n_tiles <= info.sms;
  const ALayout layout = ActivationLayout(p, plan.a_recipe, 64);
  const bool copies = layout == ALayout::kCoreMatrices;
  auto smem_of = [&](int cols) {
    return kResidentFixedBytes + ResidentWeightBytes(p.w_k_tiles, cols) +
           (residual ? ResidentStagedBytes(cols) : copies ? kResidentOriginBytes : 0);
  };
  // (the cp.async instance has 128-column tiles only)
  const bool narrow =
      p.n <= kWgCols / 2 || small_grid || copies || (residual && smem_of(kWgCols) > info.smem_optin);
  const int cols = narrow ? kWgCols / 2 : kWgCols, n_tiles = (p.n + cols - 1) / cols;
  if (p.pool_h * p.pool_w != 1 || n_tiles > info.sms || reinterpret_cast<uintptr_t>(p.w) % 16 != 0 ||
      TensorMapEncoder() == nullptr) {
    return false;
  }
  if (copies && !((small_grid || residual) && p.x_cw % 4 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                  p.k_words > 24)) {
    return false;
  }
  const int smem = smem_of(cols);
  if (smem > info.smem_optin || !Encode(plan.a_recipe, p.x, plan.a_map)) return false;  // (cp.async: no map)
  // the weights by one TMA box (where the driver cannot encode its map, the persistent kernel runs `p`)
  plan.w_recipe = ResidentWeightRecipe(p, cols);
  if (!Encode(plan.w_recipe, p.w, plan.w_map)) return false;
  plan.kind = LaunchPlan::Kind::kResident;
  plan.path = KernelPath::kWgmma;
  plan.kernel = ResidentWgmmaKernelInstance(layout, cols, residual);
  plan.threads = kWgThreads;
  plan.smem = smem;
  plan.programmatic = true;
  plan.p = p;
  plan.div = DivisorsOf(p);
  plan.m_tiles = m_tiles;
  // every SM a CTA, the column tiles shared out evenly; each CTA at least one row tile
  plan.ctas_per_column = std::max(1, std::min(m_tiles, info.sms / n_tiles));
  plan.ctas = static_cast<unsigned>(n_tiles * plan.ctas_per_column);
  return true;
}

// BandWgmmaKernel where it can run `p`: an unpooled stride-1 convolution with taps (not a GEMM: the resident
// kernel's rows need no band) of at most 128 output channels, 16-byte channel chunks in planes it can pair
// (P = 1 or even; a repeated pixel's band holds its stored planes once) or pixel pairs (C = 64, an even input
// width, not repeated), a padded row of at most 256 positions (a TMA box side), and a band of a tile per
// warpgroup in the shared memory left by the weights. False (nothing planned) otherwise. with_row_table: the
// tile rows' table where it is small enough (PlanBand takes the plan without it where the table leaves no room).
bool PlanBandWith(const BinaryGemmProblem& p, const DeviceInfo& info, LaunchPlan& plan, bool with_row_table) {
  const int sms = info.sms, smem_optin = info.smem_optin;
  // pixel pairs: an even Wp with the extra first column of an odd left padding, and rows of an even number
  // of pixels (a TMA row stride is a multiple of 16 bytes)
  const bool pixel_pairs = PixelPairs(p);
  const int planes = pixel_pairs ? 1 : p.cw / 4, position_bytes = pixel_pairs ? 8 : 16;
  const int stored_planes = pixel_pairs ? 1 : p.x_cw / 4;  // a band buffer's
  const int wp = pixel_pairs ? (p.out_w + p.kw - 1 + (p.pad_left & 1) + 1) / 2 * 2 : p.out_w + p.kw - 1;
  const bool chunks_pair = pixel_pairs ? p.in_w % 2 == 0 && p.x_cw == p.cw
                                       : p.x_cw % 4 == 0 && (planes == 1 || planes % 2 == 0);
  if (TensorMapEncoder() == nullptr || p.n > kBandCols || p.pool_h * p.pool_w != 1 || p.stride_h != 1 ||
      p.stride_w != 1 || p.kh * p.kw == 1 || !chunks_pair || wp > 256 ||
      reinterpret_cast<uintptr_t>(p.x) % 16 != 0 || reinterpret_cast<uintptr_t>(p.w) % 16 != 0) {
    return false;
  }
  BandLayout band;
  band.padded_w = FastDivisor(wp);
  band.planes = FastDivisor(planes);
  band.kw = FastDivisor(p.kw);
  band.steps = pixel_pairs ? p.kh * PixelPairStepsPerRow(p.kw) : (p.kh * p.kw * planes + 1) / 2;
  band.k_tiles = 2 * band.steps;
  if (!BandTakes(p.epilogue, band.steps, pixel_pairs)) return false;
  // pixel pairs: tiles in pairs over 128-position blocks, so every count of tiles below is even
  const int tile_step = pixel_pairs ? 2 : 1;
  auto round_up = [&](long long tiles) { return (tiles + tile_step - 1) / tile_step * tile_step; };
  band.tiles_per_image = static_cast<int>(round_up((p.out_h * wp + 63) / 64));
  const int table_entries = 64 * band.tiles_per_image;
  band.row_table = with_row_table && table_entries <= kBandRowTableEntries ? table_entries : 0;
  // Input rows of a band segment of tiles [t0, t0 + tiles) of an image: T tiles span at most (64 T - 1) / Wp + 2
  // output rows, so kh - 1 more input rows.
  auto segment_rows = [&](int t0, int tiles) { return (64 * (t0 + tiles) - 1) / wp - 64 * t0 / wp + p.kh; };
  // Sets the band's rows (the most any segment of an item needs) and slots; false where the band does not fit.
  auto fit_band = [&](int slots) {
    // tile indices over the batch stay below 2^30: ints, and exact fast divisions (Quotient)
    if (static_cast<long long>(p.batch) * band.image_tiles.divisor > INT_MAX / 2) return false;
    band.slots = slots;
    band.items = static_cast<int>(
        (static_cast<long long>(p.batch) * band.image_tiles.divisor + band.tiles_per_item - 1) / band.tiles_per_item);
    band.ctas = std::min(band.items, sms);
    band.band_rows = 0;
    // items crossing images: one item per CTA, each looked at; else the items of one image (all images alike)
    const int looked_at = slots == 2 ? band.items : band.image_tiles.divisor / band.tiles_per_item;
    for (int item = 0; item < looked_at; ++item) {
      const BandItem it = BandItemOf(p, band, item);
      band.band_rows = std::max(band.band_rows, segment_rows(it.first_tile, it.tiles[0]));
      if (it.tiles[1] > 0) band.band_rows = std::max(band.band_rows, segment_rows(0, it.tiles[1]));
    }
    // a TMA destination is 128-byte aligned: 8 positions (pixel pairs: 16)
    band.slot_positions = static_cast<int>((band.band_rows * wp + 8 * tile_step - 1) / (8 * tile_step) * (8 * tile_step));
    band.plane_bytes = band.slots * band.slot_positions * position_bytes;
    return band.band_rows <= 256 && BandSmemOf(p, band).total <= smem_optin;
  };
  // Every CTA one item of an equal share of all tiles, crossing images where they do not divide evenly;
  // where that band does not fit (or a share is more than an image), items within images, as many as fill
  // the SMs once where the images allow, else bands as large as fit.
  const long long total_tiles = static_cast<long long>(p.batch) * band.tiles_per_image;
  const long long share = round_up((total_tiles + sms - 1) / sms);
  bool fits = false;
  if (share <= band.tiles_per_image) {
    band.tiles_per_item = static_cast<int>(share);
    band.image_tiles = FastDivisor(band.tiles_per_image);
    fits = fit_band(band.tiles_per_image % band.tiles_per_item != 0 ? 2 : 1);
  }
  if (!fits) {
    band.slots = 1;
    band.band_rows = 1;
    band.slot_positions = 0;
    band.plane_bytes = 0;
    const int fixed = BandSmemOf(p, band).total;
    const int row_bytes = 2 * stored_planes * wp * position_bytes;  // two buffers
    const int max_rows = std::min(256, (smem_optin - fixed - 2 * stored_planes * 128 * tile_step) / row_bytes);
    if (max_rows < p.kh + 1) return false;
    // bands of fewer tiles than warpgroups would leave warpgroups idle
    const int smem_tiles = ((max_rows - p.kh - 1) * wp + 1) / 64 / tile_step * tile_step;
    if (smem_tiles < kBandWarpgroups) return false;
    const int wanted_per_image = std::max(1, sms / p.batch);
    const int balanced_tiles = static_cast<int>(round_up((band.tiles_per_image + wanted_per_image - 1) / wanted_per_image));
    band.tiles_per_item = std::min(balanced_tiles, smem_tiles);
    const long long items_per_image = (band.tiles_per_image + band.tiles_per_item - 1) / band.tiles_per_item;
    if (items_per_image * band.tiles_per_item * p.batch > INT_MAX / 2) return false;
    band.image_tiles = FastDivisor(static_cast<int>(items_per_image) * band.tiles_per_item);
    if (!fit_band(1)) return false;
  }
  // Out-of-frame pixels arrive as zeros. One plane: one (2 Wp 8-byte elements, band rows) box of image rows
  // per segment where it fits a box side; else one (16 bytes, Wp, band rows) box of NHWC bytes per plane and
  // segment.
  TensorMapRecipe& r = plan.a_recipe;
  const cuuint64_t pixel_bytes = static_cast<cuuint64_t>(p.x_cw) * 4;
  band.whole_rows = pixel_pairs || (stored_planes == 1 && 2 * wp <= 256);
  if (band.whole_rows) {
    const cuuint64_t pixel_elements = static_cast<cuuint64_t>(p.x_cw) / 2;  // 8-byte elements
    r.data_type = CU_TENSOR_MAP_DATA_TYPE_UINT64;
    r.rank = 3;
    r.dims[0] = pixel_elements * p.in_w;
    r.dims[1] = static_cast<cuuint64_t>(p.in_h);
    r.dims[2] = static_cast<cuuint64_t>(p.batch);
    r.strides[0] = pixel_bytes * p.in_w;
    r.strides[1] = pixel_bytes * p.in_w * p.in_h;
    r.box[0] = static_cast<cuuint32_t>(pixel_elements * wp);
    r.box[1] = static_cast<cuuint32_t>(band.band_rows);
    r.box[2] = 1;
  } else {
    r = NhwcBytes(p, 16, wp, band.band_rows, CU_TENSOR_MAP_SWIZZLE_NONE);
  }
  if (!Encode(r, p.x, plan.a_map)) return false;
  plan.kind = LaunchPlan::Kind::kBand;
  plan.path = KernelPath::kWgmma;
  const bool quarter = p.n <= kBandCols / 2;
  plan.kernel = BandWgmmaKernelInstance(band.steps, pixel_pairs, quarter, p.epilogue);
  plan.ctas = static_cast<unsigned>(band.ctas);
  plan.threads = kBandThreads;
  plan.smem = BandSmemOf(p, band).total;
  plan.programmatic = true;
  plan.p = p;
  plan.band = band;
  return true;
}

bool PlanBand(const BinaryGemmProblem& p, const DeviceInfo& info, LaunchPlan& plan) {
  return PlanBandWith(p, info, plan, true) || PlanBandWith(p, info, plan, false);
}

// Clusters of two CTAs over pairs of row tiles: persistent (one CTA per SM) unless the pooled epilogue or the
// int16 stream's residual one stages its tile in the pipeline's stages and so needs one tile per CTA.
LaunchPlan PlanPersistent(const BinaryGemmProblem& p, const DeviceInfo& info) {
  LaunchPlan plan;
  plan.kind = LaunchPlan::Kind::kPersistent;
  plan.path = KernelPath::kWgmma;
  const long long m_pairs = (TilesOfRows(p, kWgRows) + kWgCluster - 1) / kWgCluster;
  const long long n_tiles = (p.n + kWgCols - 1) / kWgCols;
  const long long pairs = m_pairs * n_tiles;
  const bool residual = p.epilogue == Epilogue::kResidualInt16;
  const long long max_clusters = p.pool_h * p.pool_w > 1 || residual ? pairs : info.sms / kWgCluster;
  const long long clusters = pairs < max_clusters ? pairs : max_clusters;
  // ctas 0: too many tiles (refused at launch)
  plan.ctas = pairs > INT_MAX || clusters * kWgCluster > INT_MAX ? 0 : static_cast<unsigned>(clusters * kWgCluster);
  ALayout layout = ActivationLayout(p, plan.a_recipe);
  if (layout != ALayout::kCoreMatrices && !Encode(plan.a_recipe, p.x, plan.a_map)) {
    layout = ALayout::kCoreMatrices;  // the driver cannot encode it: cp.async
    plan.a_recipe = TensorMapRecipe{};
  }
  plan.w_recipe = WeightRecipe(p);
  plan.weights_by_tma = Encode(plan.w_recipe, p.w, plan.w_map);  // else bulk copies
  if (!plan.weights_by_tma) plan.w_recipe = TensorMapRecipe{};
  // Runs of pairs per cluster when activations and weights together take at most 24 MiB of the 50 MiB L2.
  const long long operand_bytes = static_cast<long long>(p.batch) * p.in_h * p.in_w * p.x_cw * 4 +
                                  static_cast<long long>(p.w_row_tiles) * p.w_k_tiles * 128;
  plan.runs = operand_bytes <= (24ll << 20);
  // one short K block (unpooled, by cp.async): 1 or 3 k256 steps (K <= 8 or 24 words)
  const bool short_k = layout == ALayout::kCoreMatrices && p.k_words <= 24 && p.pool_h * p.pool_w == 1 && !residual;
  plan.kernel = PersistentWgmmaKernelInstance(layout, !short_k ? 4 : p.k_words <= 8 ? 1 : 3, residual,
                                             p.doubled_k_blocks > 0);
  plan.threads = kWgThreads;
  plan.smem = kWgSmemBytes;
  // Programmatic dependent launch: the CTAs' start-up (barrier init, cluster sync: ~1.3 us in a clock64
  // trace) runs while the previous kernel's last CTAs finish; the kernel waits (griddepcontrol.wait)
  // before touching memory. A previous kernel that never triggers simply completes first.
  plan.programmatic = true;
  plan.cluster = kWgCluster;
  plan.p = p;
  plan.div = DivisorsOf(p);
  plan.m_pairs = static_cast<int>(m_pairs);
  plan.n_tiles = static_cast<int>(n_tiles);
  return plan;
}

// The plan for `p` on `path` (kAuto: the default choice; a forced engine that cannot run `p` falls back to
// it), with the fields derived from the shape (DeriveFromShape).
LaunchPlan Plan(BinaryGemmProblem p, KernelPath path, const DeviceInfo& info) {
  DeriveFromShape(p);
  // 16-byte copies need every tap's words and every pixel's stored words 16-byte aligned (the classic kernels'
  // kVec, the wgmma TMA boxes).
  const bool aligned = p.cw % 4 == 0 && p.x_cw % 4 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  // the wgmma kernel's cp.async producer also copies 8 bytes at a time (a tap of 2 words: C = 64)
  const bool half_aligned = p.cw % 2 == 0 && p.x_cw % 2 == 0 && reinterpret_cast<uintptr_t>(p.x) % 8 == 0;
  const bool can_wgmma = info.major == 9 && info.minor == 0 && (aligned || half_aligned);
  const bool can_mma = info.major >= 8;
  KernelPath run = can_wgmma ? KernelPath::kWgmma : can_mma ? KernelPath::kMmaSync : KernelPath::kSimt;
  if (path == KernelPath::kSimt || (path == KernelPath::kMmaSync && can_mma) ||
      (path == KernelPath::kWgmma && can_wgmma)) {
    run = path;
  }
  const bool residual = IsResidual(p.epilogue);
  // doubled K blocks: the persistent and the classic kernels' instances that double (the others do not)
  const bool doubled = p.doubled_k_blocks > 0;
  switch (run) {
    case KernelPath::kWgmma: {
      if (doubled) return PlanPersistent(p, info);
      if (LaunchPlan plan; PlanBand(p, info, plan)) return plan;
      if (LaunchPlan plan; PlanResident(p, info, plan)) return plan;
      // the persistent kernel's residual instances take the int16 stream only
      if (!residual || p.epilogue == Epilogue::kResidualInt16) return PlanPersistent(p, info);
      run = KernelPath::kMmaSync;
      [[fallthrough]];
    }
    case KernelPath::kMmaSync:
      if (!doubled && UsesDenseTaps(p)) return PlanDenseTaps(p, info);
      // wide tiles where N needs them and the device's shared memory takes them
      if (p.n > MmaSyncNarrow::kCols && info.smem_optin >= ClassicSmemBytes<MmaSyncWide>()) {
        return PlanClassic<MmaSyncWide>(p, aligned, run);
      }
      return PlanClassic<MmaSyncNarrow>(p, aligned, run);
    default:
      return PlanClassic<SimtEngine>(p, aligned, run);
  }
}

}  // namespace jaxbnn::cuda
