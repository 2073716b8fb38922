// The first-layer kernels of the problems the windowed kernel (kernels/image_window.cu) does not take: an implicit
// GEMM of int8 image levels and int8 weights on IMMA m16n8k32 (mma.sync, sm_80+), 128-row tiles of 64 or 128
// columns. Rows are conv output pixels ordered window by window, so a tile holds whole pool windows; the epilogue
// pools in shared memory and writes the stream (int32 or int16), each threshold plane's packed bits, or both,
// never the int32 pre-activations of a thresholded layer.
//
// A first layer reduces over few products (27 for a 3x3 RGB conv, 363 for AlexNet's 11x11) and writes many
// outputs, so its time goes to the gathers and the epilogue, not to the tensor cores. Hence a persistent CTA
// per SM slot that keeps one column tile: its weights (every K step, where they fit), bounds and flip words
// are loaded once; each thread gathers its part of the next K step (the next tile's first, at a tile's last)
// into registers before the current step's MMAs and epilogue run, so the loads are in flight while the tensor
// cores and the stores work. Where N > 64 and K spans several steps a tile is 128 columns wide (twice the
// threads), so each row's levels are gathered once for all of them, not once per 64-column tile.
//
// The pieces: Shape (a tile width's threads and shared memory), RowOrigin and TapOf (a tile row's receptive
// field and a K byte's tap, tabled in shared memory: the origins once per tile, the taps once per CTA),
// GatherStep (a K step's levels, and the weights where they are not resident, into registers), StoreStep
// (registers to the stage), Mma (the step's IMMAs), the epilogue (StoreAccumulators, PoolInPlace, StoreStream /
// StoreBits). Where nothing needs gathering (a dense first layer) the GEMM form below takes the problem.
#include "cuda/image_conv.h"

#include <climits>
#include <cstdint>
#include <mutex>
#include <vector>

#include "cuda/device/first_layer.cuh"
#include "cuda/device/common.cuh"
#include "cuda/kernels/image_direct.h"
#include "cuda/kernels/image_wgmma.h"
#include "cuda/kernels/image_window.h"

namespace jaxbnn::cuda {
namespace {

constexpr int kRows = 128;
constexpr int kStepBytes = 32;                 // one k32 IMMA step per stage
constexpr int kRowBytes = kStepBytes + 16;     // fragment loads of 8 rows hit 32 distinct banks (12 words apart)
constexpr int kWordsPerRow = kStepBytes / 4;   // 8: thread tid gathers word tid % 8 of rows tid / 8 + stride i
constexpr int kWarpRows = 32, kWarpCols = 32;  // each warp's part of the tile
constexpr int kOriginBytes = kRows * 16;
constexpr int kTapBytes = 8;

// A tile width's threads and shared memory. Shared memory, carved from the dynamic allocation: the A stage
// and the epilogue tile share the first region (the tile is written once the last step's MMAs are done); then
// the bounds, the flip words and the weights (every step's where resident, else one step's); then each tile
// row's receptive field (RowOrigin) and each K byte's tap (TapOf: every step's where the weights are
// resident, else the next step's). The kernel writes the next step's origins and taps between the barrier
// that ends the current step's gather (its loads issued, its origins and taps read) and the one before the
// next gather, so one buffer of each serves.
template <int kTileCols>
struct Shape {
  static constexpr int kCols = kTileCols;
  static constexpr int kThreads = kRows / kWarpRows * (kCols / kWarpCols) * 32;  // 4 x (2 or 4) warps
  static constexpr int kRowStride = kThreads / kWordsPerRow;
  static constexpr int kRowsPerThread = kRows / kRowStride;
  static constexpr int kWeightWordsPerThread = kCols * kWordsPerRow / kThreads;
  static constexpr int kTileLd = kCols + 4;  // int32 words per row of the epilogue tile (16-byte rows)
  static constexpr int kTileWords = kCols / 32;
  // K steps whose weights stay in shared memory for the CTA's life (64 columns: K <= 1024 bytes, every zoo
  // first layer; 128 columns: K <= 512, every zoo conv); longer reductions gather
  // each step's weights with its levels.
  static constexpr int kMaxResidentSteps = kCols == 64 ? 32 : 16;
  static constexpr int kTileBytes = kRows * kTileLd * 4;
  static constexpr int kBoundOffset = kTileBytes;
  static constexpr int kFlipOffset = kBoundOffset + kMaxImagePlanes * kCols * 4;
  static constexpr int kWeightOffset = kFlipOffset + kMaxImagePlanes * kTileWords * 4;
  static constexpr int kWeightStepBytes = kCols * kRowBytes;
  static_assert(kRows * kRowBytes <= kTileBytes, "the stage fits the tile's region");
  static_assert(kWeightOffset % 16 == 0, "16-byte aligned weights");
  static_assert(kCols * kWordsPerRow % kThreads == 0, "whole weight words a thread");
  static __host__ __device__ constexpr int TapEntries(bool resident, int steps) {
    return (resident ? steps : 1) * kStepBytes;
  }
  static __host__ __device__ constexpr int OriginOffset(int weight_steps) {
    return kWeightOffset + weight_steps * kWeightStepBytes;
  }
  static __host__ __device__ constexpr int TapOffset(int weight_steps) { return OriginOffset(weight_steps) + kOriginBytes; }
  static __host__ __device__ constexpr int SmemBytes(bool resident, int steps) {
    return TapOffset(resident ? steps : 1) + TapEntries(resident, steps) * kTapBytes;
  }
};
using NarrowTile = Shape<kImageTileColumns>;
using WideTile = Shape<2 * kImageTileColumns>;
// The fewest K steps that take 128-column tiles (H200, batch 512 / 1024: AlexNet's 12 steps ran 1.33x faster
// than in 64-column tiles; CIFAR-10 VGG-small's single 3x3 RGB step 1.38x slower, its per-tile epilogue and
// barriers no longer overlapped by the two other CTAs an SM holds of the narrow form; nothing in between was
// measured).
constexpr int kWideMinSteps = 4;
// the taps' kernel row, column and channel fit 10 bits each where the weights are resident (TapOf)
static_assert(NarrowTile::kMaxResidentSteps * kStepBytes <= 1024 && WideTile::kMaxResidentSteps * kStepBytes <= 1024);

// Launch-time constants: divisors of the index arithmetic (no integer division in the kernel), the number of
// K steps and row tiles, whether aligned rows are gathered as words, whether the weights stay resident.
struct ImageLaunch {
  FastDivisor window, pool_w, out_w, out_hw, c, kw;
  int steps = 0, row_tiles = 0, per_tile = 0, pooled = 0, k_total = 0;
  // c % 4 == 0 and 4-byte aligned levels: the 4 bytes of a word lie in one tap and channel group, contiguous
  // and aligned, so an interior row's word is one 32-bit load
  bool word_loads = false;
  // the steps whose weights stay in shared memory: all of them, or none
  bool resident = false;
};

// A tile row's receptive field: x = the level index of its first tap (interior rows) or its image's first
// pixel index (border rows), y / z = its top row and left column in the frame, w = its kind.
constexpr int kNoRow = 0, kBorderRow = 1, kInteriorRow = 2;
__device__ __forceinline__ int4 RowOrigin(const ImageConvProblem& p, const ImageLaunch& L, int tile, int r) {
  const int window = L.window.divisor;
  const int in_window = Quotient(r, L.window), q = tile * L.per_tile + in_window, j = r - in_window * window;
  if (in_window >= L.per_tile || q >= L.pooled) return make_int4(0, 0, 0, kNoRow);
  const int b = Quotient(q, L.out_hw), pixel = q - b * L.out_hw.divisor;
  const int py = Quotient(pixel, L.out_w), px = pixel - py * p.out_w;
  const int jy = Quotient(j, L.pool_w), jx = j - jy * p.pool_w;
  const int iy = (py * p.pool_h + jy) * p.stride_h - p.pad_top, ix = (px * p.pool_w + jx) * p.stride_w - p.pad_left;
  const int image = b * p.in_h * p.in_w;  // indices inside the levels: int32 by the handler's checks
  if (iy >= 0 && iy <= p.in_h - p.kh && ix >= 0 && ix <= p.in_w - p.kw) {
    return make_int4((image + iy * p.in_w + ix) * p.c, iy, ix, kInteriorRow);
  }
  return make_int4(image, iy, ix, kBorderRow);
}

// K byte k's tap: x = its level index relative to an interior row's first (-1 past K), y = its kernel row,
// column and channel as ky | kx << 10 | ch << 20 (resident problems: K <= 1024 bytes, so each fits 10 bits;
// else 0: the gather decodes them itself).
__device__ __forceinline__ int2 TapOf(const ImageConvProblem& p, const ImageLaunch& L, int k) {
  if (k >= L.k_total) return make_int2(-1, 0);
  const int t = Quotient(k, L.c), ch = k - t * p.c, ky = Quotient(t, L.kw), kx = t - ky * p.kw;
  // interior rows exist only where the kernel fits the frame: then the offset is an index difference inside the
  // levels
  const int offset = p.kh <= p.in_h && p.kw <= p.in_w ? (ky * p.in_w + kx) * p.c + ch : 0;
  return make_int2(offset, L.resident ? ky | kx << 10 | ch << 20 : 0);
}

// What a thread gathered of one K step, still as loaded: byte e of word tid % 8 of row i in bytes[i][e]
// (zero-extended; with word loads the whole word in bytes[i][0]), and, where the weights are not resident,
// weight words as bytes too.
template <class S>
struct Gathered {
  uint32_t bytes[S::kRowsPerThread][4];
  uint32_t weight[S::kWeightWordsPerThread][4];
};

// The levels of word tid % 8 of K step `step` for the thread's rows (origins: the tile's RowOrigin buffer;
// taps: the step's 32 Tap entries), zero outside the frame and past K. Pixels (ImageConvProblem::pixels) are
// gathered as they lie, the bytes not loaded set to pixel 128, and become levels as the words are stored
// (StoreStep: the word XOR 0x80808080).
template <class S, bool kResidentWeights>
__device__ __forceinline__ void GatherStep(const ImageConvProblem& p, const ImageLaunch& L, const int4* origins,
                                           const int2* taps, int step, int col0, int tid, Gathered<S>& g) {
  const int q = tid % kWordsPerRow;
  // the value a byte or word register keeps where nothing is loaded into it: level 0 (pixel 128 for pixels)
  const uint32_t pad_byte = p.pixels ? 0x80u : 0u, pad_word = p.pixels ? kPixelLevelFlip : 0u;
  int2 tap[4];
  int real[4];  // the byte lies below K (its tap's offset is not -1)
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    tap[e] = taps[4 * q + e];
    real[e] = tap[e].x >= 0;
  }
#pragma unroll
  for (int i = 0; i < S::kRowsPerThread; ++i) {
    const int4 o = origins[tid / kWordsPerRow + S::kRowStride * i];
    const bool words = o.w == kInteriorRow && L.word_loads;  // the whole word in bytes[i][0]
#pragma unroll
    for (int e = 0; e < 4; ++e) g.bytes[i][e] = words ? (e == 0 ? pad_word : 0u) : pad_byte;
    // level indices as unsigned 32-bit sums: one wide add forms each address (a byte past K, whose offset is
    // -1, wraps, but is not loaded)
    if (o.w == kInteriorRow) {
      if (L.word_loads) {
        LoadWord(g.bytes[i][0], p.levels + static_cast<uint32_t>(o.x + tap[0].x), real[0]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) LoadByte(g.bytes[i][e], p.levels + static_cast<uint32_t>(o.x + tap[e].x), real[e]);
      }
    } else if (o.w == kBorderRow) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int ky, kx, ch;
        if constexpr (kResidentWeights) {
          ky = tap[e].y & 1023;
          kx = tap[e].y >> 10 & 1023;
          ch = tap[e].y >> 20;
        } else {
          const int k = step * kStepBytes + 4 * q + e, t = Quotient(k, L.c);
          ch = k - t * p.c;
          ky = Quotient(t, L.kw);
          kx = t - ky * p.kw;
        }
        const int y = o.y + ky, x = o.z + kx;
        const bool inside = real[e] && y >= 0 && y < p.in_h && x >= 0 && x < p.in_w;
        LoadByte(g.bytes[i][e], p.levels + static_cast<uint32_t>(inside ? (o.x + y * p.in_w + x) * p.c + ch : 0), inside);
      }
    }
  }
  if constexpr (!kResidentWeights) {
#pragma unroll
    for (int w = 0; w < S::kWeightWordsPerThread; ++w) {
      const int col = tid % S::kCols, wq = tid / S::kCols + w * (S::kThreads / S::kCols), n = col0 + col;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = step * kStepBytes + 4 * wq + e;
        g.weight[w][e] = 0;
        const bool take = k < L.k_total && n < p.n;
        LoadByte(g.weight[w][e], p.kernel + (take ? static_cast<int64_t>(k) * p.n + n : 0), take);
      }
    }
  }
}

// The gathered step into the A stage (and the weights' single step slot where they are not resident); level_flip:
// kPixelLevelFlip where the gathered bytes are pixels, else 0.
template <class S, bool kResidentWeights>
__device__ __forceinline__ void StoreStep(uint8_t* smem, const Gathered<S>& g, uint32_t level_flip, int tid) {
  const int q = tid % kWordsPerRow;
#pragma unroll
  for (int i = 0; i < S::kRowsPerThread; ++i) {
    const int r = tid / kWordsPerRow + S::kRowStride * i;
    *reinterpret_cast<uint32_t*>(smem + r * kRowBytes + 4 * q) = Word(g.bytes[i]) ^ level_flip;
  }
  if constexpr (!kResidentWeights) {
#pragma unroll
    for (int w = 0; w < S::kWeightWordsPerThread; ++w) {
      const int col = tid % S::kCols, wq = tid / S::kCols + w * (S::kThreads / S::kCols);
      *reinterpret_cast<uint32_t*>(smem + S::kWeightOffset + col * kRowBytes + 4 * wq) = Word(g.weight[w]);
    }
  }
}

// Every K step's weights of the column tile (B[step][col][kk] = kernel[32 step + kk][col0 + col], zero past K
// and N), once per CTA. A thread issues the byte loads of kWeightWordsInFlight words before it combines any:
// a CTA of a single tile (a dense first layer of 784 levels: 25 steps, 50 words a thread) would otherwise wait out a
// load's latency per word. Eight words spill the 64-column resident instance (80 registers).
constexpr int kWeightWordsInFlight = 6;
template <class S>
__device__ void LoadResidentWeights(const ImageConvProblem& p, const ImageLaunch& L, uint8_t* smem, int col0, int tid) {
  const int words = L.steps * S::kCols * kWordsPerRow;
  for (int first = tid; first < words; first += kWeightWordsInFlight * S::kThreads) {
    uint32_t bytes[kWeightWordsInFlight][4];
#pragma unroll
    for (int i = 0; i < kWeightWordsInFlight; ++i) {
      const int idx = first + i * S::kThreads;
      const int col = idx % S::kCols, wq = idx / S::kCols, n = col0 + col;  // consecutive threads: consecutive columns
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 4 * wq + e;
        const bool take = idx < words && k < L.k_total && n < p.n;
        bytes[i][e] = 0;
        LoadByte(bytes[i][e], p.kernel + (take ? static_cast<int64_t>(k) * p.n + n : 0), take);
      }
    }
#pragma unroll
    for (int i = 0; i < kWeightWordsInFlight; ++i) {
      const int idx = first + i * S::kThreads, col = idx % S::kCols, wq = idx / S::kCols;
      if (idx < words) {
        *reinterpret_cast<uint32_t*>(smem + S::kWeightOffset + (wq / kWordsPerRow) * S::kWeightStepBytes +
                                     col * kRowBytes + 4 * (wq % kWordsPerRow)) = Word(bytes[i]);
      }
    }
  }
}

// The threshold planes' bounds and flip words of the column tile, once per CTA.
template <class S>
__device__ void LoadBounds(const ImageConvProblem& p, uint8_t* smem, int col0, int tid) {
  LoadImageBounds(p, reinterpret_cast<int*>(smem + S::kBoundOffset), reinterpret_cast<uint32_t*>(smem + S::kFlipOffset),
                  col0, S::kCols, tid, S::kThreads);
}

// The warp's 32 x 32 accumulators: [16-row fragment][8-column fragment][register].
struct Accumulators {
  int v[2][4][4];
};

// The warp's 2 x 4 IMMAs of one k32 step on its fragments.
__device__ __forceinline__ void MmaFragments(const uint32_t (&a)[2][4], const uint32_t (&b)[4][2], Accumulators& acc) {
#if __CUDA_ARCH__ >= 800
#pragma unroll
  for (int mf = 0; mf < 2; ++mf) {
#pragma unroll
    for (int nf = 0; nf < 4; ++nf) {
      int* d = acc.v[mf][nf];
      asm volatile(
          "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
          : "r"(a[mf][0]), "r"(a[mf][1]), "r"(a[mf][2]), "r"(a[mf][3]), "r"(b[nf][0]), "r"(b[nf][1]));
    }
  }
#endif
}

// One k32 step. Fragments (PTX ISA, m16n8k32 .s8): lane (g, t) holds A rows g, g + 8 at bytes 4t..4t+3 and
// 16 + 4t.., B column g at the same bytes, and D rows g, g + 8 at columns 2t, 2t + 1.
__device__ __forceinline__ void Mma(const uint8_t* a_stage, const uint8_t* b_step, Accumulators& acc, int warp_row,
                                    int warp_col, int lane) {
#if __CUDA_ARCH__ >= 800
  const int g = lane / 4, t = lane % 4;
  uint32_t a[2][4], b[4][2];
#pragma unroll
  for (int mf = 0; mf < 2; ++mf) {
    const uint8_t* row = a_stage + (warp_row + 16 * mf + g) * kRowBytes + 4 * t;
    a[mf][0] = *reinterpret_cast<const uint32_t*>(row);
    a[mf][1] = *reinterpret_cast<const uint32_t*>(row + 8 * kRowBytes);
    a[mf][2] = *reinterpret_cast<const uint32_t*>(row + 16);
    a[mf][3] = *reinterpret_cast<const uint32_t*>(row + 8 * kRowBytes + 16);
  }
#pragma unroll
  for (int nf = 0; nf < 4; ++nf) {
    const uint8_t* col = b_step + (warp_col + 8 * nf + g) * kRowBytes + 4 * t;
    b[nf][0] = *reinterpret_cast<const uint32_t*>(col);
    b[nf][1] = *reinterpret_cast<const uint32_t*>(col + 16);
  }
  MmaFragments(a, b, acc);
#endif
}

template <class S>
__device__ __forceinline__ void StoreAccumulators(int* tile, Accumulators& acc, int warp_row, int warp_col, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mf = 0; mf < 2; ++mf) {
#pragma unroll
    for (int nf = 0; nf < 4; ++nf) {
      const int row = warp_row + 16 * mf + g, col = warp_col + 8 * nf + 2 * t;
      *reinterpret_cast<int2*>(&tile[row * S::kTileLd + col]) = make_int2(acc.v[mf][nf][0], acc.v[mf][nf][1]);
      *reinterpret_cast<int2*>(&tile[(row + 8) * S::kTileLd + col]) = make_int2(acc.v[mf][nf][2], acc.v[mf][nf][3]);
#pragma unroll
      for (int r = 0; r < 4; ++r) acc.v[mf][nf][r] = 0;  // the next tile starts from zero
    }
  }
}

// Each window's max into its first row as the epilogue's value (StreamValue; the window's cells are read and
// written by one thread only).
template <class S>
__device__ void PoolInPlace(const ImageConvProblem& p, int* tile, int window, int tid) {
  const int per_tile = kRows / window;
  for (int idx = tid; idx < per_tile * S::kCols; idx += S::kThreads) {
    const int first = (idx / S::kCols) * window, col = idx % S::kCols;
    int best = tile[first * S::kTileLd + col];
    for (int j = 1; j < window; ++j) best = max(best, tile[(first + j) * S::kTileLd + col]);
    tile[first * S::kTileLd + col] = StreamValue(p, best);
  }
}

// The stream, int32 or int16 (ImageConvProblem::narrow_stream), a thread per (pooled row, column).
template <class S>
__device__ void StoreStream(const ImageConvProblem& p, const ImageLaunch& L, const int* tile, int tile_m, int col0,
                            int tid) {
  const int window = L.window.divisor;
  for (int idx = tid; idx < L.per_tile * S::kCols; idx += S::kThreads) {
    const int pr = idx / S::kCols, col = idx % S::kCols, q = tile_m * L.per_tile + pr;
    if (q < L.pooled && col0 + col < p.n) {
      const int v = tile[pr * window * S::kTileLd + col];
      const int64_t at = static_cast<int64_t>(q) * p.n + col0 + col;
      if (p.narrow_stream) {
        static_cast<int16_t*>(p.out_stream)[at] = static_cast<int16_t>(v);
      } else {
        static_cast<int32_t*>(p.out_stream)[at] = v;
      }
    }
  }
}

// A thread per (pooled row, 32-column word): each plane's word from the row's 32 values, read four at a time,
// against the plane's bounds (LoadBounds).
template <class S>
__device__ void StoreBits(const ImageConvProblem& p, const ImageLaunch& L, const uint8_t* smem, const int* tile,
                          int tile_m, int col0, int tid) {
  const int window = L.window.divisor, out_words = (p.n + 31) / 32;
  const int* bound = reinterpret_cast<const int*>(smem + S::kBoundOffset);
  const uint32_t* flip_word = reinterpret_cast<const uint32_t*>(smem + S::kFlipOffset);
  for (int idx = tid; idx < L.per_tile * S::kTileWords; idx += S::kThreads) {
    const int word = idx % S::kTileWords, pr = idx / S::kTileWords;
    const int q = tile_m * L.per_tile + pr, first_col = col0 + 32 * word;
    if (q >= L.pooled || first_col >= p.n) continue;
    const int4* pre = reinterpret_cast<const int4*>(&tile[pr * window * S::kTileLd + 32 * word]);
    for (int plane = 0; plane < p.planes; ++plane) {
      const int4* plane_bound = reinterpret_cast<const int4*>(&bound[plane * S::kCols + 32 * word]);
      uint32_t bits = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int4 v = pre[i], b = plane_bound[i];
        bits |= uint32_t{v.x >= b.x} << (4 * i) | uint32_t{v.y >= b.y} << (4 * i + 1) |
                uint32_t{v.z >= b.z} << (4 * i + 2) | uint32_t{v.w >= b.w} << (4 * i + 3);
      }
      p.out_bits[(static_cast<int64_t>(q) * p.planes + plane) * out_words + first_col / 32] =
          bits ^ flip_word[plane * S::kTileWords + word];
    }
  }
}

// CTAs an SM holds at least: 64-column tiles 3 with resident weights (80 registers) or 2; 128-column tiles, twice
// the threads, 1 (~90 registers; AlexNet's resident weights take 150 KB of shared memory).
template <class S, bool kResidentWeights>
constexpr int kMinCtas = S::kCols == 64 ? (kResidentWeights ? 3 : 2) : 1;

template <class S, bool kResidentWeights>
__global__ void __launch_bounds__(S::kThreads, (kMinCtas<S, kResidentWeights>))
    ImageConvKernel(const ImageConvProblem p, const ImageLaunch L) {
  extern __shared__ __align__(16) uint8_t smem[];
  int* tile = reinterpret_cast<int*>(smem);
  const int weight_steps = kResidentWeights ? L.steps : 1;
  int4* origins = reinterpret_cast<int4*>(smem + S::OriginOffset(weight_steps));  // [kRows]
  int2* taps = reinterpret_cast<int2*>(smem + S::TapOffset(weight_steps));         // [steps or 1][kStepBytes]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int col0 = blockIdx.y * S::kCols;
  const int warp_row = (warp % (kRows / kWarpRows)) * kWarpRows, warp_col = (warp / (kRows / kWarpRows)) * kWarpCols;
  int tile_m = blockIdx.x;
  if (tile_m >= L.row_tiles) return;  // the whole CTA
  if (p.planes > 0) LoadBounds<S>(p, smem, col0, tid);
  if constexpr (kResidentWeights) {
    LoadResidentWeights<S>(p, L, smem, col0, tid);
    for (int k = tid; k < L.steps * kStepBytes; k += S::kThreads) taps[k] = TapOf(p, L, k);
  } else if (tid < kStepBytes) {
    taps[tid] = TapOf(p, L, tid);
  }
  if (tid < kRows) origins[tid] = RowOrigin(p, L, tile_m, tid);
  __syncthreads();
  Gathered<S> gathered;
  GatherStep<S, kResidentWeights>(p, L, origins, taps, 0, col0, tid, gathered);
  Accumulators acc = {};
  for (int step = 0;;) {
    int next_tile = tile_m, next_step = step + 1;
    if (next_step == L.steps) {
      next_step = 0;
      next_tile += gridDim.x;
    }
    const bool more = next_tile < L.row_tiles;
    __syncthreads();  // the previous step's MMAs and the epilogue are done with the stage, its gather with the tables
    StoreStep<S, kResidentWeights>(smem, gathered, p.pixels ? kPixelLevelFlip : 0u, tid);
    if (more && next_step == 0 && tid < kRows) origins[tid] = RowOrigin(p, L, next_tile, tid);
    if (!kResidentWeights && more && tid >= S::kThreads - kStepBytes) {  // warps the origins leave idle
      const int e = tid - (S::kThreads - kStepBytes);
      taps[e] = TapOf(p, L, next_step * kStepBytes + e);
    }
    __syncthreads();
    // the next step's loads go out before this step's MMAs and epilogue
    if (more) {
      GatherStep<S, kResidentWeights>(p, L, origins, taps + (kResidentWeights ? next_step * kStepBytes : 0),
                                      next_step, col0, tid, gathered);
    }
    Mma(smem, smem + S::kWeightOffset + (kResidentWeights ? step * S::kWeightStepBytes : 0), acc, warp_row, warp_col,
        lane);
    if (step == L.steps - 1) {
      __syncthreads();  // every warp's MMAs are done: the stage becomes the epilogue tile
      StoreAccumulators<S>(tile, acc, warp_row, warp_col, lane);
      __syncthreads();
      if (L.window.divisor > 1 || TransformsValues(p)) {
        PoolInPlace<S>(p, tile, L.window.divisor, tid);
        __syncthreads();
      }
      if (p.out_stream != nullptr) StoreStream<S>(p, L, tile, tile_m, col0, tid);
      if (p.planes > 0) StoreBits<S>(p, L, smem, tile, tile_m, col0, tid);
    }
    if (!more) break;
    tile_m = next_tile;
    step = next_step;
  }
}

// ---- The GEMM form: a first layer whose output rows are the levels' rows (a 1 x 1 kernel, stride 1, no padding,
// no pool: ops.image_matmul's dense first layer, the MNIST MLP's 784 -> 1024) ----
//
// Nothing to gather: row q's K bytes lie at levels + q * K, the weights' K rows at kernel + k * N. So every K chunk
// of a tile's levels and weights arrives by 16-byte cp.async copies, kGemmStages chunks in flight, where the im2col
// kernel above waits out one step's loads at a time (ncu, the MNIST MLP's first layer: most of its samples on the
// gathers' latency and on its weights loaded byte by byte, 10.5 M instructions for a 1024-row batch). The MMAs
// want each column's K bytes contiguous, the weights hold each K row's columns so: each chunk's weights are
// transposed in shared memory (4 x 4 byte blocks, eight byte permutes a block) before its MMAs. The tile, warps,
// accumulators and epilogue are the im2col kernel's (GemmTile has NarrowTile's shape).
constexpr int kGemmChunkBytes = 4 * kStepBytes;              // K bytes a pipeline stage: 4 k32 steps
constexpr int kGemmStride = kGemmChunkBytes + 16;            // a stage row of levels, a transposed weight column:
                                                              // fragment loads of 8 rows x 4 words hit 32 banks
constexpr int kGemmWeightStride = kImageTileColumns + 16;    // a K row of the chunk's weights as they arrive (the
                                                              // transposition's loads at most 2-way conflicted)
constexpr int kGemmStages = 3;

struct GemmTile {
  static constexpr int kCols = kImageTileColumns;
  static constexpr int kThreads = NarrowTile::kThreads;
  static constexpr int kTileLd = NarrowTile::kTileLd;
  static constexpr int kTileWords = NarrowTile::kTileWords;
  static constexpr int kLevelBytes = kRows * kGemmStride;
  static constexpr int kStageBytes = kLevelBytes + kGemmChunkBytes * kGemmWeightStride;
  // the ring of stages, which the epilogue tile reuses once the last chunk's MMAs are done; the chunk's
  // transposed weights; the threshold planes' bounds and flip words
  static constexpr int kTransposedOffset = kGemmStages * kStageBytes;
  static constexpr int kBoundOffset = kTransposedOffset + kCols * kGemmStride;
  static constexpr int kFlipOffset = kBoundOffset + kMaxImagePlanes * kCols * 4;
  static constexpr int kSmemBytes = kFlipOffset + kMaxImagePlanes * kTileWords * 4;
  static_assert(kRows * kTileLd * 4 <= kTransposedOffset, "the epilogue tile fits the ring");
  static_assert(kThreads == 256 && kCols == 64, "the chunk loads and the transposition's thread layout");
};

__device__ __forceinline__ void CopyPiece(const uint8_t* dst, const int8_t* src, bool real) {
  // src-size 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(dst)), "l"(src),
               "r"(real ? 16 : 0)
               : "memory");
}

// Chunk `chunk` of the tile's levels (128 rows x 8 pieces of 16 bytes) and weights (128 K rows x 4 pieces of 16
// columns) into `stage`, zeros past the rows, K and N.
__device__ __forceinline__ void LoadGemmChunk(const ImageConvProblem& p, const ImageLaunch& L, int row0, int col0,
                                              int chunk, uint8_t* stage, int tid) {
  const int k0 = chunk * kGemmChunkBytes;
#pragma unroll
  for (int i = 0; i < kRows * 8 / GemmTile::kThreads; ++i) {
    const int idx = tid + i * GemmTile::kThreads, r = idx / 8, piece = idx % 8;
    const int row = row0 + r, k = k0 + 16 * piece;
    const bool real = row < L.pooled && k < L.k_total;
    CopyPiece(stage + r * kGemmStride + 16 * piece, p.levels + (real ? static_cast<int64_t>(row) * L.k_total + k : 0),
              real);
  }
#pragma unroll
  for (int i = 0; i < kGemmChunkBytes * 4 / GemmTile::kThreads; ++i) {
    const int idx = tid + i * GemmTile::kThreads, kr = idx / 4, piece = idx % 4;
    const int k = k0 + kr, n = col0 + 16 * piece;
    const bool real = k < L.k_total && n < p.n;
    CopyPiece(stage + GemmTile::kLevelBytes + kr * kGemmWeightStride + 16 * piece,
              p.kernel + (real ? static_cast<int64_t>(k) * p.n + n : 0), real);
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// The chunk's weights, K rows of columns as they arrived, into columns of K bytes (transposed[n][k]): each thread
// two 4 x 4 byte blocks, four words in and four out (lanes over 4 K quads and 8 column quads: the loads 2-way,
// the stores 4-way bank-conflicted at most).
__device__ __forceinline__ void TransposeGemmWeights(const uint8_t* rows, uint8_t* transposed, int tid) {
  const int lane = tid % 32, warp = tid / 32;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int kq = lane % 4 + 4 * warp, nq = lane / 4 + 8 * i;
    const uint8_t* src = rows + 4 * kq * kGemmWeightStride + 4 * nq;
    const uint32_t r0 = *reinterpret_cast<const uint32_t*>(src);
    const uint32_t r1 = *reinterpret_cast<const uint32_t*>(src + kGemmWeightStride);
    const uint32_t r2 = *reinterpret_cast<const uint32_t*>(src + 2 * kGemmWeightStride);
    const uint32_t r3 = *reinterpret_cast<const uint32_t*>(src + 3 * kGemmWeightStride);
    // byte j of word r_i is (K row 4 kq + i, column 4 nq + j); column j's word gets byte j of r0..r3
    const uint32_t lo01 = __byte_perm(r0, r1, 0x5140), hi01 = __byte_perm(r0, r1, 0x7362);
    const uint32_t lo23 = __byte_perm(r2, r3, 0x5140), hi23 = __byte_perm(r2, r3, 0x7362);
    uint8_t* dst = transposed + 4 * nq * kGemmStride + 4 * kq;
    *reinterpret_cast<uint32_t*>(dst) = __byte_perm(lo01, lo23, 0x5410);
    *reinterpret_cast<uint32_t*>(dst + kGemmStride) = __byte_perm(lo01, lo23, 0x7632);
    *reinterpret_cast<uint32_t*>(dst + 2 * kGemmStride) = __byte_perm(hi01, hi23, 0x5410);
    *reinterpret_cast<uint32_t*>(dst + 3 * kGemmStride) = __byte_perm(hi01, hi23, 0x7632);
  }
}

// k32 step `step` of a chunk: Mma's fragments (m16n8k32 .s8), the levels' words XORed with level_flip (pixels).
__device__ __forceinline__ void GemmMma(const uint8_t* stage, const uint8_t* transposed, int step, uint32_t level_flip,
                                        Accumulators& acc, int warp_row, int warp_col, int lane) {
#if __CUDA_ARCH__ >= 800
  const int g = lane / 4, t = lane % 4;
  uint32_t a[2][4], b[4][2];
#pragma unroll
  for (int mf = 0; mf < 2; ++mf) {
    const uint8_t* row = stage + (warp_row + 16 * mf + g) * kGemmStride + kStepBytes * step + 4 * t;
    a[mf][0] = *reinterpret_cast<const uint32_t*>(row) ^ level_flip;
    a[mf][1] = *reinterpret_cast<const uint32_t*>(row + 8 * kGemmStride) ^ level_flip;
    a[mf][2] = *reinterpret_cast<const uint32_t*>(row + 16) ^ level_flip;
    a[mf][3] = *reinterpret_cast<const uint32_t*>(row + 8 * kGemmStride + 16) ^ level_flip;
  }
#pragma unroll
  for (int nf = 0; nf < 4; ++nf) {
    const uint8_t* col = transposed + (warp_col + 8 * nf + g) * kGemmStride + kStepBytes * step + 4 * t;
    b[nf][0] = *reinterpret_cast<const uint32_t*>(col);
    b[nf][1] = *reinterpret_cast<const uint32_t*>(col + 16);
  }
  MmaFragments(a, b, acc);
#endif
}

// One 128 x 64 tile a CTA (blockIdx.x: the row tile, blockIdx.y: the column tile); two CTAs an SM.
__global__ void __launch_bounds__(GemmTile::kThreads, 2) ImageGemmKernel(const ImageConvProblem p, const ImageLaunch L) {
  using S = GemmTile;
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int tile_m = blockIdx.x, row0 = tile_m * kRows, col0 = blockIdx.y * S::kCols;
  const int warp_row = (warp % (kRows / kWarpRows)) * kWarpRows, warp_col = (warp / (kRows / kWarpRows)) * kWarpCols;
  const int chunks = (L.k_total + kGemmChunkBytes - 1) / kGemmChunkBytes;
  uint8_t* transposed = smem + S::kTransposedOffset;
  // the first kGemmStages - 1 chunks in flight (a group each, empty past K) while the bounds load
#pragma unroll
  for (int c = 0; c < kGemmStages - 1; ++c) {
    if (c < chunks) {
      LoadGemmChunk(p, L, row0, col0, c, smem + c * S::kStageBytes, tid);
    } else {
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
  }
  if (p.planes > 0) LoadBounds<S>(p, smem, col0, tid);
  const uint32_t level_flip = p.pixels ? kPixelLevelFlip : 0u;
  Accumulators acc = {};
  for (int c = 0; c < chunks; ++c) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kGemmStages - 2) : "memory");  // this thread's part of chunk c
    __syncthreads();  // every thread's part of chunk c; every warp done with chunk c - 1 (its stage, the transposed)
    const int next = c + kGemmStages - 1;
    if (next < chunks) {
      LoadGemmChunk(p, L, row0, col0, next, smem + next % kGemmStages * S::kStageBytes, tid);
    } else {
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    const uint8_t* stage = smem + c % kGemmStages * S::kStageBytes;
    TransposeGemmWeights(stage + S::kLevelBytes, transposed, tid);
    __syncthreads();
#pragma unroll
    for (int step = 0; step < kGemmChunkBytes / kStepBytes; ++step) {
      GemmMma(stage, transposed, step, level_flip, acc, warp_row, warp_col, lane);
    }
  }
  __syncthreads();  // every warp's MMAs are done: the ring becomes the epilogue tile
  int* tile = reinterpret_cast<int*>(smem);
  StoreAccumulators<S>(tile, acc, warp_row, warp_col, lane);
  __syncthreads();
  if (TransformsValues(p)) {
    PoolInPlace<S>(p, tile, 1, tid);
    __syncthreads();
  }
  if (p.out_stream != nullptr) StoreStream<S>(p, L, tile, tile_m, col0, tid);
  if (p.planes > 0) StoreBits<S>(p, L, smem, tile, tile_m, col0, tid);
}

// The GEMM form's launch: one 128 x 64 tile a CTA.
cudaError_t LaunchGemmForm(const ImageConvProblem& p, const ImageLaunch& L, cudaStream_t stream) {
  const void* kernel = reinterpret_cast<const void*>(&ImageGemmKernel);
  const int col_tiles = (p.n + GemmTile::kCols - 1) / GemmTile::kCols;
  if (col_tiles > kMaxImageColumnTiles) return cudaErrorInvalidValue;
  int device = 0;
  cudaError_t err;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  static std::once_flag raised[64];
  static cudaError_t raise_errors[64];
  if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
  std::call_once(raised[device], [&] {
    raise_errors[device] = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, GemmTile::kSmemBytes);
  });
  if ((err = raise_errors[device]) != cudaSuccess) return err;
  ImageGemmKernel<<<dim3(static_cast<unsigned>(L.row_tiles), static_cast<unsigned>(col_tiles)), GemmTile::kThreads,
                    GemmTile::kSmemBytes, stream>>>(p, L);
  return cudaGetLastError();
}

template <class S, bool kResidentWeights>
cudaError_t LaunchInstance(const ImageConvProblem& p, const ImageLaunch& L, cudaStream_t stream) {
  const void* kernel = reinterpret_cast<const void*>(&ImageConvKernel<S, kResidentWeights>);
  const int smem = S::SmemBytes(kResidentWeights, L.steps);
  const int col_tiles = (p.n + S::kCols - 1) / S::kCols;
  if (col_tiles > kMaxImageColumnTiles) return cudaErrorInvalidValue;
  int device = 0, sms = 0;
  cudaError_t err;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;
  static std::once_flag raised[64];
  static cudaError_t raise_errors[64];
  if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
  std::call_once(raised[device], [&] {  // the largest size an instance takes
    raise_errors[device] = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                S::SmemBytes(kResidentWeights, S::kMaxResidentSteps));
  });
  if ((err = raise_errors[device]) != cudaSuccess) return err;
  const int per_sm = CtasPerSm(kernel, S::kThreads, smem, device);
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  // every SM slot busy, each CTA on one column tile, the row tiles shared out
  const long long slots = static_cast<long long>(per_sm) * sms;
  const long long per_column = (slots + col_tiles - 1) / col_tiles;
  const dim3 grid(static_cast<unsigned>(per_column < L.row_tiles ? per_column : L.row_tiles),
                  static_cast<unsigned>(col_tiles));
  ImageConvKernel<S, kResidentWeights><<<grid, S::kThreads, smem, stream>>>(p, L);
  return cudaGetLastError();
}

}  // namespace

int CtasPerSm(const void* kernel, int threads, int smem, int device) {
  struct Known {
    const void* kernel;
    int smem, device, ctas;
  };
  static std::mutex mutex;
  static std::vector<Known> known;
  std::lock_guard<std::mutex> lock(mutex);
  for (const Known& k : known) {
    if (k.kernel == kernel && k.smem == smem && k.device == device) return k.ctas;
  }
  int ctas = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, smem) != cudaSuccess) ctas = 0;
  known.push_back({kernel, smem, device, ctas});
  return ctas;
}

bool ImageGemmTakes(const ImageConvProblem& p) {
  return p.kh == 1 && p.kw == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_top == 0 && p.pad_left == 0 &&
         p.pool_h == 1 && p.pool_w == 1 && p.out_h == p.in_h && p.out_w == p.in_w && p.c % 16 == 0 &&
         p.n % 16 == 0 && reinterpret_cast<uintptr_t>(p.levels) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.kernel) % 16 == 0;
}

cudaError_t LaunchImageGemm(const ImageConvProblem& p, cudaStream_t stream) {
  const int64_t rows = int64_t{p.batch} * p.out_h * p.out_w;
  if (rows == 0 || p.n == 0) return cudaSuccess;
  ImageLaunch L;
  L.k_total = p.c;
  L.per_tile = kRows;  // (window 1: a tile's rows are its outputs)
  L.pooled = static_cast<int>(rows);  // int32 by the handler's checks
  L.row_tiles = static_cast<int>((rows + kRows - 1) / kRows);
  return LaunchGemmForm(p, L, stream);
}

cudaError_t LaunchImageConv(const ImageConvProblem& p, cudaStream_t stream) {
  const int window = p.pool_h * p.pool_w;
  const int64_t pooled = int64_t{p.batch} * p.out_h * p.out_w;
  if (pooled == 0 || p.n == 0) return cudaSuccess;
  if (window < 1 || window > kMaxImagePoolWindow || p.planes < 0 || p.planes > kMaxImagePlanes ||
      (p.out_stream == nullptr && (p.shift != 0 || p.narrow_stream))) {
    return cudaErrorInvalidValue;
  }
  // a few products into few channels of threshold planes: the direct kernel on the CUDA cores; images of at most
  // four channels: the windowed kernel, where it covers the problem
  if (ImageDirectTakes(p)) return LaunchImageDirect(p, stream);
  if (ImageWindowTakes(p)) return LaunchImageWindow(p, stream);
  // a dense first layer: Hopper's integer wgmma where its weights fit, else the mma.sync GEMM form
  if (ImageGemmTakes(p)) return ImageWgmmaTakes(p) ? LaunchImageWgmma(p, stream) : LaunchImageGemm(p, stream);
  ImageLaunch L;
  L.window = FastDivisor(window);
  L.pool_w = FastDivisor(p.pool_w);
  L.out_w = FastDivisor(p.out_w);
  L.out_hw = FastDivisor(p.out_h * p.out_w);
  L.c = FastDivisor(p.c);
  L.kw = FastDivisor(p.kw);
  L.k_total = p.kh * p.kw * p.c;
  L.steps = (L.k_total + kStepBytes - 1) / kStepBytes;
  L.per_tile = kRows / window;
  L.pooled = static_cast<int>(pooled);  // int32 by the handler's checks
  L.row_tiles = static_cast<int>((pooled + L.per_tile - 1) / L.per_tile);
  L.word_loads = p.c % 4 == 0 && reinterpret_cast<uintptr_t>(p.levels) % 4 == 0;
  // 128-column tiles where a 64-column tile would leave half of N's gathers to another tile, the gathers are
  // most of the work (several K steps) and every step's weights stay resident at that width
  if (p.n > NarrowTile::kCols && L.steps >= kWideMinSteps && L.steps <= WideTile::kMaxResidentSteps) {
    L.resident = true;
    return LaunchInstance<WideTile, true>(p, L, stream);
  }
  L.resident = L.steps <= NarrowTile::kMaxResidentSteps;
  return L.resident ? LaunchInstance<NarrowTile, true>(p, L, stream) : LaunchInstance<NarrowTile, false>(p, L, stream);
}

}  // namespace jaxbnn::cuda
