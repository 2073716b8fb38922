// The windowed first-layer kernel: a direct convolution of int8 image levels with int8 weights on IMMA
// m16n8k32 (mma.sync, sm_80+) for images of at most four channels, the zoo's RGB and grey first layers.
//
// A tile is 8 x 16 output pixels (before the pool) of one image and 64 output channels a column of warps (a CTA
// has two, 128 channels, where N > 64, and builds the window once for both). Its frame window, the
// pixels its receptive fields cover, is built once in shared memory as four-byte slots: a slot at (y, x)
// holds the C' channel bytes (C rounded up to 1, 2 or 4; the fourth byte of an RGB pixel is 0) of the
// 4 / C' pixels x, x + 1, ... of window row y, zero outside the frame. The window's rows are first staged as
// they lie in the levels, by cp.async copies issued while the CTA's previous tile is multiplied, so that
// building the window waits for no global load. Where the stride is a multiple of 4 / C' pixels, the slots are
// only those the fragments read, the rows' bytes word by word; an RGB image at a stride that is a multiple of 4
// is read as a grey one three times as wide (WindowForm), so that its slots hold no padding byte. A kernel row of
// kw taps is then ceil(kw C' / 4) slots, and every A fragment register of the MMA is one 32-bit shared load at
// the pixel's slot plus the tap slot's offset: no im2col gather, and a pixel is read from global memory once per
// tile, not once per tap. The weights are laid out at load time in the same slots (zero past kw and C), resident for
// the CTA's life, and read with ldmatrix.
//
// The fragment rows are placed so that the epilogue needs no shared memory: warp w holds tile rows 2w and 2w + 1
// (its two 16-row fragments), fragment row g the pixels 2g and 2g + 1 (rows g and g + 8), so a thread's four
// accumulator rows are one 2 x 2 pool window and the pool is a max in registers. The 64 weight columns are
// permuted at load time for the stores (ChannelOfColumn): thread t of a quad holds the output channels 16t ..
// 16t + 15, so a plane's 16 bits are the thread's own and two threads' make a word, and an int16 stream's are two
// 16-byte stores; for an int32 stream alone the quad's values of two fragments are 16 consecutive channels, one
// 64-byte store.
//
// The pieces: WindowLaunch (the launch-time geometry), LoadWeights / LoadBounds / the slot table (once per
// CTA), StageRows (the next tile's rows, in flight) and ExpandWindow (the frame window of a tile from them), the
// mainloop over K steps, and the epilogue (the pool in registers, StoreQuadStream / StoreThreadStream /
// StoreBits).
#include "cuda/kernels/image_window.h"

#include <climits>
#include <cstdint>
#include <mutex>

#include "cuda/device/common.cuh"
#include "cuda/device/first_layer.cuh"
#include "cuda/device/pipeline.cuh"

namespace jaxbnn::cuda {
namespace {

constexpr int kTileH = 8, kTileW = 16;  // output pixels of a tile, before the pool: 128 rows
constexpr int kRowWarps = kTileH / 2;   // a warp per two tile rows and 64 columns
constexpr int kWarpCols = kImageTileColumns;  // 64
constexpr int kFrags = kWarpCols / 8;
constexpr int kStepSlots = 8;             // a k32 step: eight four-byte slots
constexpr int kStepBytes = 4 * kStepSlots;
constexpr int kWarpStepBytes = kWarpCols * kStepBytes;  // a warp's 64 columns of one step: 2 KB
constexpr int kMaxSteps = 32;             // the resident weights: 64 KB a 64-column half
constexpr int kMaxWindowWords = 12 * 1024;  // the frame window: 48 KB (AlexNet's 11 x 11 at stride 4: 12 KB)
static_assert(kWarpCols == 64 && kTileW == 2 * 8, "the fragment rows and the column permutation assume this tile");

// A CTA: the tile's 128 rows by 64 columns a column warp (1, or 2 where N > 64, so that the window is built once
// for 128 columns), four CTAs (128 registers) or two an SM.
template <int kColWarps>
struct CtaShape {
  static constexpr int kCols = kColWarps * kWarpCols;
  static constexpr int kThreads = 32 * kRowWarps * kColWarps;
  static constexpr int kStepBytes = kColWarps * kWarpStepBytes;
  static constexpr int kMinCtas = 4 / kColWarps;
};

// Channel bytes a pixel takes in a slot: C = 3 is padded to 4.
__host__ __device__ constexpr int ChannelBytes(int c) { return c == 3 ? 4 : c; }

// The launch-time geometry. Shared memory: the weights (steps x 2 KB a column warp), each plane's bounds and flip
// words, the slot table (each K slot's byte offset in the window), the frame window (window_h rows of
// window_w words), the staged rows (window_h rows of stage_stride bytes), their StagedRow table and, where C' < 4,
// the window columns' masks.
struct WindowLaunch {
  int slots_per_row = 0, slots = 0, steps = 0;
  int window_h = 0, window_w = 0;  // rows of window_w slots, unpadded
  int span_pixels = 0;   // the pixels of a window row: window_w slot_step + 4 / C' - slot_step
  int stage_stride = 0;  // a staged row's bytes: its pixels' bytes and room for the phase and the last slot's words
  int copies_per_row = 0;
  bool wide_copies = false;  // 16-byte copies (16-byte aligned levels), else 4-byte ones
  int tiles_x = 0, tiles = 0;
  int levels_bytes = 0;  // batch * H * W * C: up to 2^31 - 33 (ImageWindowTakes)
  int image_bytes = 0, row_bytes = 0;  // H * W * C, W * C: operands from the parameters, not registers held
  FastDivisor window_w_div, copies_per_row_div, tiles_x_div, tiles_per_image_div;
  int bound_offset = 0, flip_offset = 0, slot_offset = 0, window_offset = 0, stage_offset = 0, rows_offset = 0;
  int smem = 0;
  bool vector_stream = false;  // rows of whole 16-byte vectors and a 16-byte aligned stream: 16-byte stores
  // Where C' < 4: the pixels from one window slot to the next along a row (1, or 4 / C' where the stride is a
  // multiple of it: the slots are then the row's bytes word by word), and in slots, a K slot's width (4 / C' /
  // slot_step) and the stride (stride_w / slot_step)
  int slot_step = 1, slot_words = 1, column_words = 1;
  int columns_offset = 0;  // where C' < 4: each window column's mask of its bytes inside the frame
};

// Kernel column kc = 8 nf + 2 t + e of the MMA holds an output channel of the tile chosen for the epilogue's
// stores. In general channel 16 t + 2 nf + e, so that thread t of a quad holds channels 16 t .. 16 t + 15 (its 16
// bits of a word, 32 bytes of an int16 stream). An int32 stream alone: channel 16 (nf / 2) + 4 t +
// 2 (nf % 2) + e, so that the quad's four values of fragments 2 i and 2 i + 1 are 16 consecutive channels, four a
// thread: one 64-byte store.
__device__ __forceinline__ int ChannelOfColumn(int kc, bool quad_stream) {
  const int nf = kc / 8, t = (kc % 8) / 2, e = kc % 2;
  return quad_stream ? 16 * (nf / 2) + 4 * t + 2 * (nf % 2) + e : 16 * t + 2 * nf + e;
}

// The epilogue's two families of kernel instances: the plain forms (an int32 stream alone, in the quad layout, or
// the threshold planes of the pre-activations) and the stream's values (StreamValue: an int16 stream, or a stream
// and the threshold planes of its values), so that the stream's forms cost the plain ones no instructions.
bool TakesStreamValues(const ImageConvProblem& p) {
  return p.narrow_stream || (p.out_stream != nullptr && p.out_bits != nullptr);
}

// Byte offset of a 16-byte half of kernel column kc in a weight step: 32-byte columns, the halves swapped in
// every other group of four columns, so that ldmatrix's eight rows of a half hit 32 distinct banks.
__device__ __forceinline__ int WeightOffset(int kc, int half) { return kc * 32 + ((half ^ ((kc >> 2) & 1)) << 4); }

// Every K step's weights of the CTA's columns in the slot layout, each column warp's 64 columns of a step together
// (2 KB): byte i of slot s holds kernel[ky, kx, ch, n] with (ky, j) = (s / slots_per_row, s % slots_per_row),
// kx = j * (4 / C') + i / C', ch = i % C'; 0 past kw, C, N and the last slot. Four words' byte loads are issued
// before any is combined.
template <int kChannelBytes, bool kStreamValues, class S>
__device__ void LoadWeights(const ImageConvProblem& p, const WindowLaunch& L, uint8_t* smem, int col0, int tid) {
  constexpr int kPixelsPerSlot = 4 / kChannelBytes;
  const int words = L.steps * S::kCols * kStepSlots;
  for (int first = tid; first < words; first += 4 * S::kThreads) {
    uint32_t bytes[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int idx = first + u * S::kThreads, kc = idx % S::kCols, slot = idx / S::kCols;
      const int n = col0 + kc / kWarpCols * kWarpCols + ChannelOfColumn(kc % kWarpCols, !kStreamValues && p.planes == 0);
      const int ky = slot / L.slots_per_row, j = slot - ky * L.slots_per_row;
      const bool real = idx < words && slot < L.slots && n < p.n;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int kx = j * kPixelsPerSlot + i / kChannelBytes, ch = i % kChannelBytes;
        const bool take = real && kx < p.kw && ch < p.c;
        bytes[u][i] = 0;
        LoadByte(bytes[u][i], p.kernel + (take ? (static_cast<int64_t>(ky * p.kw + kx) * p.c + ch) * p.n + n : 0),
                 take);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int idx = first + u * S::kThreads, kc = idx % S::kCols, slot = idx / S::kCols;
      if (idx < words) {
        const int step = slot / kStepSlots, w = slot % kStepSlots;
        *reinterpret_cast<uint32_t*>(smem + step * S::kStepBytes + kc / kWarpCols * kWarpStepBytes +
                                     WeightOffset(kc % kWarpCols, w / 4) + 4 * (w % 4)) = Word(bytes[u]);
      }
    }
  }
}

// Each plane's bounds and flip words of the CTA's columns in channel order, once per CTA.
template <class S>
__device__ void LoadBounds(const ImageConvProblem& p, const WindowLaunch& L, uint8_t* smem, int col0, int tid) {
  LoadImageBounds(p, reinterpret_cast<int*>(smem + L.bound_offset), reinterpret_cast<uint32_t*>(smem + L.flip_offset),
                  col0, S::kCols, tid, S::kThreads);
}

__device__ __forceinline__ uint32_t LoadShared(uint32_t address) {
  uint32_t value;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(value) : "r"(address));
  return value;
}

// Where a tile lies: its image's first level, its first output pixel (before the pool) and its frame window's
// first pixel (iy0, ix0) (negative inside the padding).
struct TileOrigin {
  int b, image, oy0, ox0, iy0, ix0;
};
__device__ __forceinline__ TileOrigin OriginOf(const ImageConvProblem& p, const WindowLaunch& L, int tile) {
  TileOrigin o;
  o.b = Quotient(tile, L.tiles_per_image_div);
  const int in_image = tile - o.b * L.tiles_per_image_div.divisor, ty = Quotient(in_image, L.tiles_x_div);
  o.oy0 = ty * kTileH;
  o.ox0 = (in_image - ty * L.tiles_x) * kTileW;
  o.image = o.b * L.image_bytes;
  o.iy0 = o.oy0 * p.stride_h - p.pad_top;
  o.ix0 = o.ox0 * p.stride_w - p.pad_left;
  return o;
}

// A window row as ExpandWindow reads it: the shared address of its first window pixel's byte among the staged
// rows, and the mask of its slots (0 for a row outside the frame, whose address is then its staged row's start,
// so that every load stays inside the staged rows).
struct StagedRow {
  uint32_t first_byte, mask;
};

// Stages the tile's frame window as it lies in the levels: for each window row inside the frame, the bytes of its
// pixels inside the frame, by cp.async copies aligned to the levels' start (16 bytes where the levels are 16-byte
// aligned, else 4; the levels' last bytes one by one where they end inside a copy); the bytes around them are left
// as they are (ExpandWindow masks them off). Row y's bytes lie at staged + y * stage_stride from its first window
// pixel's level offset rounded down to 16 (negative inside the padding), so that a 16-byte copy lands aligned;
// the rows' StagedRow table is written with them, and where a slot holds several pixels (C' < 4), each window
// column's mask of the bytes of its pixels inside the frame. Not waited for here: the copies land while the
// previous tile is multiplied.
template <int kChannelBytes, int kThreads>
__device__ __forceinline__ void StageRows(const ImageConvProblem& p, const WindowLaunch& L, uint8_t* smem,
                                          const TileOrigin& o, int tid) {
  constexpr int kPixelsPerSlot = 4 / kChannelBytes;
  const uint32_t staged = SmemAddress(smem) + L.stage_offset;
  const uint32_t channels = p.c == 3 ? 0xffffffu : 0xffffffffu;
  StagedRow* rows = reinterpret_cast<StagedRow*>(smem + L.rows_offset);
  for (int y = tid; y < L.window_h; y += kThreads) {
    const int iy = o.iy0 + y;
    const bool inside = static_cast<unsigned>(iy) < static_cast<unsigned>(p.in_h);
    const int phase = (o.image + iy * L.row_bytes + o.ix0 * p.c) & 15;
    rows[y] = {staged + y * L.stage_stride + (inside ? phase : 0), inside ? channels : 0u};
  }
  if constexpr (kPixelsPerSlot > 1) {  // the slot's pixels inside the frame: [inside_first, inside_end) of them
    uint32_t* columns = reinterpret_cast<uint32_t*>(smem + L.columns_offset);
    for (int x = tid; x < L.window_w; x += kThreads) {
      const int ix = o.ix0 + x * L.slot_step;
      const int inside_first = max(0, -ix), inside_end = min(kPixelsPerSlot, p.in_w - ix);
      const int low_bit = 8 * kChannelBytes * inside_first, end_bit = 8 * kChannelBytes * inside_end;
      columns[x] = inside_first < inside_end
                       ? static_cast<uint32_t>((uint64_t{1} << end_bit) - (uint64_t{1} << low_bit))
                       : 0u;
    }
  }
  const int first_pixel = max(o.ix0, 0), end_pixel = min(o.ix0 + L.span_pixels, p.in_w);
  if (first_pixel >= end_pixel) return;  // no window column inside the frame
  const int copy_bytes = L.wide_copies ? 16 : 4, copies = L.window_h * L.copies_per_row;
#pragma unroll 1
  for (int idx = tid; idx < copies; idx += kThreads) {
    const int y = Quotient(idx, L.copies_per_row_div), iy = o.iy0 + y;
    if (static_cast<unsigned>(iy) >= static_cast<unsigned>(p.in_h)) continue;
    const int row = o.image + iy * L.row_bytes, end = row + end_pixel * p.c;
    const int offset = ((row + first_pixel * p.c) & -copy_bytes) + (idx - y * L.copies_per_row) * copy_bytes;
    if (offset >= end) continue;
    const int to = y * L.stage_stride + (offset - ((row + o.ix0 * p.c) & ~15));
    if (offset + copy_bytes <= L.levels_bytes) {
      if (L.wide_copies) {
        CopyAsync<16>(staged + to, p.levels + offset, true);
      } else {
        CopyAsync<4>(staged + to, p.levels + offset, true);
      }
    } else {  // the levels' last bytes, one by one: a cp.async may read all of its size
      for (int i = 0; offset + i < L.levels_bytes; ++i) smem[L.stage_offset + to + i] = p.levels[offset + i];
    }
  }
}

// The frame window of the tile from its staged rows: slot (y, x) holds the channel bytes of pixels
// ix0 + x slot_step + i / C' of row iy0 + y, 0 outside the frame: two staged words and a funnel shift, masked to
// the slot's pixels inside the frame (its row's mask: for RGB three channels, 0 outside the frame; where C' < 4,
// and its column's). Pixels become levels in the same masking instruction ((word ^ 0x80808080) & mask,
// ImageConvProblem::pixels). No branch: the loads of a masked slot read staged bytes that the mask discards.
template <int kChannelBytes, int kThreads>
__device__ __forceinline__ void ExpandWindow(const ImageConvProblem& p, const WindowLaunch& L, uint8_t* smem,
                                             const TileOrigin& o, int tid) {
  constexpr int kPixelsPerSlot = 4 / kChannelBytes;
  const StagedRow* rows = reinterpret_cast<const StagedRow*>(smem + L.rows_offset);
  uint32_t* window = reinterpret_cast<uint32_t*>(smem + L.window_offset);
  const uint32_t level_flip = p.pixels ? kPixelLevelFlip : 0u;
  const int total = L.window_h * L.window_w;
#pragma unroll 4
  for (int idx = tid; idx < total; idx += kThreads) {
    const int y = Quotient(idx, L.window_w_div), x = idx - y * L.window_w;
    const int slot_pixel = kPixelsPerSlot == 1 ? x : x * L.slot_step;
    const uint2 row = reinterpret_cast<const uint2*>(rows)[y];  // one 8-byte load: first_byte, mask
    uint32_t mask;
    if constexpr (kPixelsPerSlot == 1) {
      const int ix = o.ix0 + x;
      mask = static_cast<unsigned>(ix) < static_cast<unsigned>(p.in_w) ? row.y : 0u;
    } else {
      mask = row.y & reinterpret_cast<const uint32_t*>(smem + L.columns_offset)[x];
    }
    const uint32_t at = row.x + slot_pixel * p.c, from = at & ~3u;
    // the funnel shift takes its amount modulo 32: 8 (at % 4)
    window[idx] = (__funnelshift_r(LoadShared(from), LoadShared(from + 4), at << 3) ^ level_flip) & mask;
  }
}

__device__ __forceinline__ void LoadMatrices(uint32_t address, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(address));
}

__device__ __forceinline__ void Imma(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// A thread's 16 values of one output row, value (nf, e) from kernel column 8 nf + 2 t + e (ChannelOfColumn).
using RowValues = int[kFrags][2];

// An int32 stream alone, kRows rows in the quad layout: `value >> shift`, fragments 2 i and 2 i + 1
// as channels col0 + 16 i + 4 t .. + 3 of the row.
template <int kRows>
__device__ __forceinline__ void StoreQuadStream(const ImageConvProblem& p, const WindowLaunch& L,
                                                const RowValues (&v)[kRows], const int (&q)[kRows],
                                                const bool (&valid)[kRows], int col0, int t) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (!valid[r]) continue;
    int32_t* out = static_cast<int32_t*>(p.out_stream) + static_cast<int64_t>(q[r]) * p.n;
#pragma unroll
    for (int i = 0; i < kFrags / 2; ++i) {
      const int first = col0 + 16 * i + 4 * t;
      const int4 four = make_int4(v[r][2 * i][0] >> p.shift, v[r][2 * i][1] >> p.shift, v[r][2 * i + 1][0] >> p.shift,
                                  v[r][2 * i + 1][1] >> p.shift);
      if (L.vector_stream && first + 4 <= p.n) {
        *reinterpret_cast<int4*>(out + first) = four;
      } else {
        if (first < p.n) out[first] = four.x;
        if (first + 1 < p.n) out[first + 1] = four.y;
        if (first + 2 < p.n) out[first + 2] = four.z;
        if (first + 3 < p.n) out[first + 3] = four.w;
      }
    }
  }
}

// The stream of kRows rows in the general layout, the values already StreamValue's: the thread's channels col0 +
// 16 t .. + 15 of a row, 64 bytes of int32 or 32 of int16 (T), as 16-byte stores where the row holds them.
template <class T, int kRows>
__device__ __forceinline__ void StoreThreadStream(const ImageConvProblem& p, const WindowLaunch& L,
                                                  const RowValues (&v)[kRows], const int (&q)[kRows],
                                                  const bool (&valid)[kRows], int col0, int t) {
  constexpr int kPerVector = 16 / sizeof(T);
  const int first = col0 + 16 * t;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (!valid[r]) continue;
    T* out = static_cast<T*>(p.out_stream) + static_cast<int64_t>(q[r]) * p.n + first;
    if (L.vector_stream && first + 16 <= p.n) {
#pragma unroll
      for (int j = 0; j < 16 / kPerVector; ++j) {
        uint32_t word[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if constexpr (sizeof(T) == 2) {  // channels 8 j + 2 k and + 1: fragment 4 j + k, both of its values
            word[k] = __byte_perm(v[r][4 * j + k][0], v[r][4 * j + k][1], 0x5410);
          } else {  // channel 4 j + k
            word[k] = v[r][(4 * j + k) / 2][k % 2];
          }
        }
        reinterpret_cast<uint4*>(out)[j] = make_uint4(word[0], word[1], word[2], word[3]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (first + i < p.n) out[i] = static_cast<T>(v[r][i / 2][i % 2]);
      }
    }
  }
}

// Each plane's word of kRows rows: the thread's 16 bits (channels col0 + 16 t .., the warp's columns from warp_col
// of the CTA's) against its 16 bounds, loaded once a plane, two threads' halves joined by a shuffle (every lane of
// the warp takes part; `valid` only gates the store).
template <int kCtaCols, int kRows>
__device__ __forceinline__ void StoreBits(const ImageConvProblem& p, const WindowLaunch& L, const uint8_t* smem,
                                          const RowValues (&v)[kRows], const int (&q)[kRows],
                                          const bool (&valid)[kRows], int col0, int warp_col, int t) {
  const int out_words = (p.n + 31) / 32, word = col0 / 32 + t / 2;
  const bool stores = t % 2 == 0 && col0 + 32 * (t / 2) < p.n;
  uint32_t* out = p.out_bits;
  for (int plane = 0; plane < p.planes; ++plane) {
    const int4* bound_of_plane =
        reinterpret_cast<const int4*>(smem + L.bound_offset) + (plane * kCtaCols + warp_col) / 4 + 4 * t;
    int4 bound[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) bound[i] = bound_of_plane[i];
    const uint32_t flips =
        reinterpret_cast<const uint32_t*>(smem + L.flip_offset)[(plane * kCtaCols + warp_col) / 32 + t / 2] >>
            (16 * (t % 2)) & 0xffffu;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      uint32_t bits = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        bits |= uint32_t{v[r][2 * i][0] >= bound[i].x} << (4 * i) | uint32_t{v[r][2 * i][1] >= bound[i].y} << (4 * i + 1) |
                uint32_t{v[r][2 * i + 1][0] >= bound[i].z} << (4 * i + 2) |
                uint32_t{v[r][2 * i + 1][1] >= bound[i].w} << (4 * i + 3);
      }
      bits ^= flips;
      const uint32_t high = __shfl_xor_sync(0xffffffffu, bits, 1);
      if (stores && valid[r]) out[(static_cast<int64_t>(q[r]) * p.planes + plane) * out_words + word] = bits | high << 16;
    }
  }
}

// The epilogue of kRows rows: the plain forms (an int32 stream alone, or the threshold planes), or the stream's
// values (StreamValue) stored as the stream, compared as the threshold planes, or both.
template <int kCtaCols, int kRows, bool kStreamValues>
__device__ __forceinline__ void StoreRows(const ImageConvProblem& p, const WindowLaunch& L, const uint8_t* smem,
                                          RowValues (&v)[kRows], const int (&q)[kRows], const bool (&valid)[kRows],
                                          int col0, int warp_col, int t) {
  if constexpr (!kStreamValues) {
    if (p.planes == 0) {
      StoreQuadStream<kRows>(p, L, v, q, valid, col0, t);
    } else {
      StoreBits<kCtaCols, kRows>(p, L, smem, v, q, valid, col0, warp_col, t);
    }
    return;
  }
  if (TransformsValues(p)) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int nf = 0; nf < kFrags; ++nf) {
        v[r][nf][0] = StreamValue(p, v[r][nf][0]);
        v[r][nf][1] = StreamValue(p, v[r][nf][1]);
      }
    }
  }
  if (p.out_stream != nullptr) {
    if (p.narrow_stream) {
      StoreThreadStream<int16_t, kRows>(p, L, v, q, valid, col0, t);
    } else {
      StoreThreadStream<int32_t, kRows>(p, L, v, q, valid, col0, t);
    }
  }
  if (p.planes > 0) StoreBits<kCtaCols, kRows>(p, L, smem, v, q, valid, col0, warp_col, t);
}

template <int kChannelBytes, bool kPooled, int kColWarps, bool kStreamValues>
__global__ void __launch_bounds__(CtaShape<kColWarps>::kThreads, CtaShape<kColWarps>::kMinCtas)
    ImageWindowKernel(const ImageConvProblem p, const WindowLaunch L) {
  using S = CtaShape<kColWarps>;
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int kPixelsPerSlot = 4 / kChannelBytes;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int row_warp = warp % kRowWarps, warp_col = warp / kRowWarps * kWarpCols;
  const int cta_col0 = blockIdx.y * S::kCols, col0 = cta_col0 + warp_col;
  if (static_cast<int>(blockIdx.x) >= L.tiles) return;  // the whole CTA
  LoadWeights<kChannelBytes, kStreamValues, S>(p, L, smem, cta_col0, tid);
  if (p.planes > 0) LoadBounds<S>(p, L, smem, cta_col0, tid);
  // window slots from a K slot to the next of a kernel row, and from an output column to the next
  const int slot_words = kPixelsPerSlot == 1 ? 1 : L.slot_words;
  const int column_words = kPixelsPerSlot == 1 ? p.stride_w : L.column_words;
  int* slot_offset = reinterpret_cast<int*>(smem + L.slot_offset);
  for (int s = tid; s < L.steps * kStepSlots; s += S::kThreads) {
    const int ky = s / L.slots_per_row;
    slot_offset[s] = s < L.slots ? 4 * (ky * L.window_w + (s - ky * L.slots_per_row) * slot_words) : 0;
  }
  uint32_t* window = reinterpret_cast<uint32_t*>(smem + L.window_offset);
  // fragment row (mf, h) of lane g: tile row 2 row_warp + mf, tile column 2 g + h; as byte addresses in the window
  uint32_t row_base[2][2];
#pragma unroll
  for (int mf = 0; mf < 2; ++mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_base[mf][h] = SmemAddress(window) +
                        4 * ((2 * row_warp + mf) * p.stride_h * L.window_w + (2 * g + h) * column_words);
    }
  }
  // ldmatrix: lanes 8m .. 8m + 7 address matrix m = (column fragment m / 2 of a pair, K half m % 2)
  const int m = lane / 8, matrix_column = 8 * (m / 2) + lane % 8;
  const uint32_t weight_lane =
      SmemAddress(smem) + warp_col / kWarpCols * kWarpStepBytes + WeightOffset(matrix_column, m % 2);
  const auto stage_tile = [&](int tile) {
    StageRows<kChannelBytes, S::kThreads>(p, L, smem, OriginOf(p, L, tile), tid);
  };
  stage_tile(blockIdx.x);
  for (int tile = blockIdx.x; tile < L.tiles; tile += gridDim.x) {
    CopyAsyncWaitAll();
    __syncthreads();  // the tile's rows are staged; the previous tile's MMAs are done with the window (the first:
                      // the tables are written)
    ExpandWindow<kChannelBytes, S::kThreads>(p, L, smem, OriginOf(p, L, tile), tid);
    __syncthreads();  // the window is built; the staged rows are free for the next tile's
    if (tile + static_cast<int>(gridDim.x) < L.tiles) stage_tile(tile + gridDim.x);
    int acc[2][kFrags][4] = {};
    // not unrolled: the 128-register budget holds only one step's fragments
#pragma unroll 1
    for (int step = 0; step < L.steps; ++step) {
      const uint32_t low = slot_offset[step * kStepSlots + t], high = slot_offset[step * kStepSlots + t + 4];
      uint32_t a[2][4];
#pragma unroll
      for (int mf = 0; mf < 2; ++mf) {
        a[mf][0] = LoadShared(row_base[mf][0] + low);
        a[mf][1] = LoadShared(row_base[mf][1] + low);
        a[mf][2] = LoadShared(row_base[mf][0] + high);
        a[mf][3] = LoadShared(row_base[mf][1] + high);
      }
      uint32_t bf[kFrags][2];
      const uint32_t step_address = weight_lane + step * S::kStepBytes;
#pragma unroll
      for (int pair = 0; pair < kFrags / 2; ++pair) {
        LoadMatrices(step_address + pair * 16 * 32, bf[2 * pair][0], bf[2 * pair][1], bf[2 * pair + 1][0],
                     bf[2 * pair + 1][1]);
      }
#pragma unroll
      for (int mf = 0; mf < 2; ++mf) {
#pragma unroll
        for (int nf = 0; nf < kFrags; ++nf) Imma(acc[mf][nf], a[mf], bf[nf][0], bf[nf][1]);
      }
    }
    // the epilogue, from the registers: a 2 x 2 window's max, or each of the four rows (the tile's origin found
    // again rather than held through the K loop)
    const TileOrigin o = OriginOf(p, L, tile);
    if constexpr (kPooled) {
      int v[1][kFrags][2];
#pragma unroll
      for (int nf = 0; nf < kFrags; ++nf) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          v[0][nf][e] = max(max(acc[0][nf][e], acc[0][nf][2 + e]), max(acc[1][nf][e], acc[1][nf][2 + e]));
        }
      }
      const int py = o.oy0 / 2 + row_warp, px = o.ox0 / 2 + g;
      const bool valid[1] = {py < p.out_h && px < p.out_w};
      const int q[1] = {valid[0] ? (o.b * p.out_h + py) * p.out_w + px : 0};
      StoreRows<S::kCols, 1, kStreamValues>(p, L, smem, v, q, valid, col0, warp_col, t);
    } else {
      int v[4][kFrags][2], q[4];
      bool valid[4];
#pragma unroll
      for (int mf = 0; mf < 2; ++mf) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 2 * mf + h, oy = o.oy0 + 2 * row_warp + mf, ox = o.ox0 + 2 * g + h;
#pragma unroll
          for (int nf = 0; nf < kFrags; ++nf) {
            v[r][nf][0] = acc[mf][nf][2 * h];
            v[r][nf][1] = acc[mf][nf][2 * h + 1];
          }
          valid[r] = oy < p.out_h && ox < p.out_w;
          q[r] = valid[r] ? (o.b * p.out_h + oy) * p.out_w + ox : 0;
        }
      }
      StoreRows<S::kCols, 4, kStreamValues>(p, L, smem, v, q, valid, col0, warp_col, t);
    }
  }
}

// A problem's geometry in int64, for ImageWindowTakes to bound before anything is narrowed (conv_h / conv_w: the
// convolution output that the pooled output needs; smem: the bytes of shared memory a CTA takes).
struct Geometry {
  int64_t slots_per_row, slots, steps, slot_step, window_h, window_w, span_pixels, stage_stride, conv_h, conv_w,
      tiles_x, tiles, col_warps, bound_offset, flip_offset, slot_offset, window_offset, stage_offset, rows_offset,
      columns_offset, smem;
};
Geometry GeometryOf(const ImageConvProblem& p) {
  Geometry G;
  const int pixels_per_slot = 4 / ChannelBytes(p.c);
  G.slots_per_row = (int64_t{p.kw} + pixels_per_slot - 1) / pixels_per_slot;
  G.slots = G.slots_per_row * p.kh;
  G.steps = (G.slots + kStepSlots - 1) / kStepSlots;
  // a slot at every pixel (the A fragments' pixels at any stride), or at every 4 / C'-th where the stride is a
  // multiple of that: the rows' bytes word by word
  G.slot_step = p.stride_w % pixels_per_slot == 0 ? pixels_per_slot : 1;
  G.window_h = int64_t{kTileH - 1} * p.stride_h + p.kh;
  G.window_w = G.slot_step == 1 ? int64_t{kTileW - 1} * p.stride_w + (G.slots_per_row - 1) * pixels_per_slot + 1
                                : int64_t{kTileW - 1} * p.stride_w / G.slot_step + G.slots_per_row;
  G.span_pixels = G.window_w * G.slot_step + pixels_per_slot - G.slot_step;
  // a row's bytes from its phase (up to 15), a 16-byte copy's overhang past them, the last slot's second word
  G.stage_stride = (G.span_pixels * p.c + 32 + 15) / 16 * 16;
  G.conv_h = int64_t{p.out_h} * p.pool_h;
  G.conv_w = int64_t{p.out_w} * p.pool_w;
  G.tiles_x = (G.conv_w + kTileW - 1) / kTileW;
  G.tiles = int64_t{p.batch} * ((G.conv_h + kTileH - 1) / kTileH) * G.tiles_x;
  G.col_warps = p.n > kWarpCols ? 2 : 1;
  const auto align16 = [](int64_t bytes) { return (bytes + 15) / 16 * 16; };
  G.bound_offset = G.steps * G.col_warps * kWarpStepBytes;
  G.flip_offset = G.bound_offset + align16(int64_t{p.planes} * G.col_warps * kWarpCols * 4);
  G.slot_offset = G.flip_offset + align16(int64_t{p.planes} * G.col_warps * (kWarpCols / 32) * 4);
  G.window_offset = G.slot_offset + align16(G.steps * kStepSlots * 4);
  G.stage_offset = G.window_offset + align16(G.window_h * G.window_w * 4);
  G.rows_offset = G.stage_offset + G.window_h * G.stage_stride;
  G.columns_offset = G.rows_offset + G.window_h * 8;
  G.smem = G.columns_offset + (pixels_per_slot > 1 ? G.window_w * 4 : 0);
  return G;
}

template <int kChannelBytes, bool kPooled, int kColWarps, bool kStreamValues>
cudaError_t LaunchInstance(const ImageConvProblem& p, const WindowLaunch& L, cudaStream_t stream) {
  using S = CtaShape<kColWarps>;
  const void* kernel =
      reinterpret_cast<const void*>(&ImageWindowKernel<kChannelBytes, kPooled, kColWarps, kStreamValues>);
  const int col_tiles = (p.n + S::kCols - 1) / S::kCols;
  if (col_tiles > kMaxImageColumnTiles) return cudaErrorInvalidValue;
  int device = 0, sms = 0;
  cudaError_t err;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;
  if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
  // the dynamic shared memory limit raised per instance and device as far as a launch has needed
  static std::mutex mutex;
  static int raised[64] = {};
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (L.smem > raised[device]) {
      if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L.smem)) != cudaSuccess) {
        return err;
      }
      raised[device] = L.smem;
    }
  }
  const int per_sm = CtasPerSm(kernel, S::kThreads, L.smem, device);
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  // every SM slot busy, each CTA on one column tile, the pixel tiles shared out
  const long long per_column = (static_cast<long long>(per_sm) * sms + col_tiles - 1) / col_tiles;
  const dim3 grid(static_cast<unsigned>(per_column < L.tiles ? per_column : L.tiles), static_cast<unsigned>(col_tiles));
  ImageWindowKernel<kChannelBytes, kPooled, kColWarps, kStreamValues><<<grid, S::kThreads, L.smem, stream>>>(p, L);
  return cudaGetLastError();
}

template <int kChannelBytes, bool kPooled>
cudaError_t LaunchColumns(const ImageConvProblem& p, const WindowLaunch& L, int col_warps, cudaStream_t stream) {
  if (TakesStreamValues(p)) {
    return col_warps == 2 ? LaunchInstance<kChannelBytes, kPooled, 2, true>(p, L, stream)
                          : LaunchInstance<kChannelBytes, kPooled, 1, true>(p, L, stream);
  }
  return col_warps == 2 ? LaunchInstance<kChannelBytes, kPooled, 2, false>(p, L, stream)
                        : LaunchInstance<kChannelBytes, kPooled, 1, false>(p, L, stream);
}

// An RGB problem at a horizontal stride that is a multiple of 4 as the same bytes read as a grey one: an image row
// a row of 3 W grey pixels, a kernel row 3 kw taps (the same HWIO bytes), the stride and the left padding three
// times theirs. Its slots are then the window rows' bytes word by word (the grey stride a multiple of 4 pixels),
// where an RGB pixel would take a slot of its own with a zero fourth byte: a quarter fewer K steps and window slots
// (ResNet-18's stem and AlexNet's first layer).
ImageConvProblem WindowForm(const ImageConvProblem& p) {
  // the columns the tiles reach, in bytes within int32 (the tiles' origins and the window's offsets)
  const int64_t reach = (int64_t{p.out_w} * p.pool_w + kTileW) * p.stride_w + p.kw + p.pad_left + p.in_w;
  if (p.c != 3 || p.stride_w % 4 != 0 || 3 * reach > INT_MAX) return p;
  ImageConvProblem grey = p;
  grey.c = 1;
  grey.in_w = 3 * p.in_w;
  grey.kw = 3 * p.kw;
  grey.stride_w = 3 * p.stride_w;
  grey.pad_left = 3 * p.pad_left;
  return grey;
}

}  // namespace

bool ImageWindowTakes(const ImageConvProblem& problem) {
  if (problem.c < 1 || problem.c > 4 || problem.kh < 1 || problem.kw < 1 || problem.stride_h < 1 ||
      problem.stride_w < 1) {
    return false;
  }
  const ImageConvProblem p = WindowForm(problem);
  const bool pooled = p.pool_h == 2 && p.pool_w == 2;
  if (!pooled && (p.pool_h != 1 || p.pool_w != 1)) return false;
  if (p.planes < 0 || p.planes > kMaxImagePlanes || reinterpret_cast<uintptr_t>(p.levels) % 4 != 0) return false;
  // the staging copies' offsets and their 16-byte overhang within int32
  const int64_t levels_bytes = int64_t{p.batch} * p.in_h * p.in_w * p.c;
  if (levels_bytes > INT_MAX - 32) return false;
  const Geometry G = GeometryOf(p);
  if (G.slots > int64_t{kMaxSteps} * kStepSlots || G.window_h * G.window_w > kMaxWindowWords ||
      3 * G.conv_h < kTileH || 3 * G.conv_w < kTileW || G.tiles > INT_MAX) {
    return false;
  }
  int device = 0, smem_limit = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
         G.smem <= smem_limit;
}

cudaError_t LaunchImageWindow(const ImageConvProblem& problem, cudaStream_t stream) {
  if (!ImageWindowTakes(problem)) return cudaErrorInvalidValue;
  const ImageConvProblem p = WindowForm(problem);
  const Geometry G = GeometryOf(p);
  if (G.tiles == 0 || p.n == 0) return cudaSuccess;
  WindowLaunch L;
  L.slots_per_row = static_cast<int>(G.slots_per_row);
  L.slots = static_cast<int>(G.slots);
  L.steps = static_cast<int>(G.steps);
  L.window_h = static_cast<int>(G.window_h);
  L.window_w = static_cast<int>(G.window_w);
  L.slot_step = static_cast<int>(G.slot_step);
  L.slot_words = 4 / ChannelBytes(p.c) / L.slot_step;
  L.column_words = p.stride_w / L.slot_step;
  L.span_pixels = static_cast<int>(G.span_pixels);
  L.stage_stride = static_cast<int>(G.stage_stride);
  L.wide_copies = reinterpret_cast<uintptr_t>(p.levels) % 16 == 0;
  const int copy_bytes = L.wide_copies ? 16 : 4;
  L.copies_per_row = (L.span_pixels * p.c + 2 * copy_bytes - 2) / copy_bytes;  // a row's bytes at any alignment
  L.copies_per_row_div = FastDivisor(L.copies_per_row);
  L.tiles_x = static_cast<int>(G.tiles_x);
  L.tiles = static_cast<int>(G.tiles);
  L.window_w_div = FastDivisor(L.window_w);
  L.tiles_x_div = FastDivisor(L.tiles_x);
  L.tiles_per_image_div = FastDivisor(static_cast<int>(G.tiles / p.batch));
  L.levels_bytes = p.batch * p.in_h * p.in_w * p.c;
  L.image_bytes = p.in_h * p.in_w * p.c;
  L.row_bytes = p.in_w * p.c;
  L.bound_offset = static_cast<int>(G.bound_offset);
  L.flip_offset = static_cast<int>(G.flip_offset);
  L.slot_offset = static_cast<int>(G.slot_offset);
  L.window_offset = static_cast<int>(G.window_offset);
  L.stage_offset = static_cast<int>(G.stage_offset);
  L.rows_offset = static_cast<int>(G.rows_offset);
  L.columns_offset = static_cast<int>(G.columns_offset);
  L.smem = static_cast<int>(G.smem);
  L.vector_stream = p.n % (p.narrow_stream ? 8 : 4) == 0 && reinterpret_cast<uintptr_t>(p.out_stream) % 16 == 0;
  const int channel_bytes = ChannelBytes(p.c), col_warps = static_cast<int>(G.col_warps);
  const bool pooled = p.pool_h == 2;
  switch (channel_bytes * 2 + (pooled ? 1 : 0)) {
    case 2: return LaunchColumns<1, false>(p, L, col_warps, stream);
    case 3: return LaunchColumns<1, true>(p, L, col_warps, stream);
    case 4: return LaunchColumns<2, false>(p, L, col_warps, stream);
    case 5: return LaunchColumns<2, true>(p, L, col_warps, stream);
    case 8: return LaunchColumns<4, false>(p, L, col_warps, stream);
    default: return LaunchColumns<4, true>(p, L, col_warps, stream);
  }
}

}  // namespace jaxbnn::cuda
