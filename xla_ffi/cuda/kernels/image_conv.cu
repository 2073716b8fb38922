// The first-layer kernel: an implicit GEMM of int8 image levels and int8 weights on IMMA m16n8k32 (mma.sync,
// sm_80+), one 128-row x 64-column tile a CTA. Rows are conv output pixels ordered window by window, so a
// tile holds whole pool windows; the epilogue pools in shared memory and writes the int32 stream or each
// threshold plane's packed bits, never the int32 pre-activations of a thresholded layer.
//
// The pieces: RowOrigins (the tile's rows as receptive-field origins), GatherStage (the K block's levels and
// weights into shared memory, zero outside the frame and past K), Mainloop (the IMMA steps), PoolInPlace and
// the two stores. A first layer reduces over few products (27 for a 3x3 RGB conv, 363 for AlexNet's 11x11)
// and writes many outputs, so the kernel is bound by its gathers and stores, not by the tensor cores.
#include "cuda/image_conv.h"

#include <cstdint>

#include "cuda/device/common.cuh"

namespace jaxbnn::cuda {
namespace {

constexpr int kRows = 128, kCols = kImageTileColumns, kThreads = 256;
constexpr int kTileLd = kCols + 1;     // int32 words per row of the epilogue tile
constexpr int kWarpRows = 32, kWarpCols = 32;  // 4 x 2 warps
static_assert(kRows / kWarpRows * (kCols / kWarpCols) * 32 == kThreads, "the warps cover the tile");

// A K block is one k32 step (K <= 32: the 3x3 RGB and one-channel layers) or two (ImageConvKernel<kKBytes>).
// Bytes per shared row of a K block: 16 more than the block, so that the fragment loads of 8 rows hit 32
// distinct banks (rows 12 or 20 words apart).
template <int kKBytes>
__host__ __device__ constexpr int RowBytes() {
  return kKBytes + 16;
}

template <int kKBytes>
struct Operands {
  alignas(16) uint8_t a[kRows * RowBytes<kKBytes>()];
  alignas(16) uint8_t b[kCols * RowBytes<kKBytes>()];
};

constexpr int kRowOutput = 1, kRowInterior = 2;  // origin.w flags: an output row; its field inside the frame

template <int kKBytes>
struct SharedStorage {
  union {
    Operands<kKBytes> stage;
    int tile[kRows * kTileLd];  // the epilogue's pre-activations, once the mainloop is done with the stage
  };
  int4 origin[kRows];      // (first pixel of the image, top row, left column, flags)
  int row_base[kRows];     // an interior row: the level index of its field's first tap
  int4 tap[kKBytes];       // per byte of the K block: (row offset, column offset, channel, 1 if k < K)
  int tap_offset[kKBytes];  // the byte's level index relative to row_base (interior rows only)
  int threshold[kMaxImagePlanes * kCols];
  uint8_t flip[kMaxImagePlanes * kCols];
};

// The launch-time divisors of the index arithmetic (FastDivisor: no integer division in the kernel).
struct ImageDivisors {
  FastDivisor window, pool_w, out_w, out_hw, c, kw;
};

// The receptive-field origin of each tile row: row r is position r % window of pooled pixel
// tile_m * (kRows / window) + r / window.
template <int kKBytes>
__device__ void RowOrigins(const ImageConvProblem& p, const ImageDivisors& div, SharedStorage<kKBytes>& s,
                           int tile_m, int tid) {
  const int window = div.window.divisor, per_tile = kRows / window;
  const int pooled = p.batch * p.out_h * p.out_w;
  for (int r = tid; r < kRows; r += kThreads) {
    const int in_window = Quotient(r, div.window), q = tile_m * per_tile + in_window, j = r - in_window * window;
    if (r >= per_tile * window || q >= pooled) {
      s.origin[r] = make_int4(0, 0, 0, 0);
      continue;
    }
    const int b = Quotient(q, div.out_hw), pixel = q - b * div.out_hw.divisor;
    const int py = Quotient(pixel, div.out_w), px = pixel - py * p.out_w;
    const int jy = Quotient(j, div.pool_w), jx = j - jy * p.pool_w;
    const int iy = (py * p.pool_h + jy) * p.stride_h - p.pad_top, ix = (px * p.pool_w + jx) * p.stride_w - p.pad_left;
    const bool interior = iy >= 0 && iy <= p.in_h - p.kh && ix >= 0 && ix <= p.in_w - p.kw;
    s.origin[r] = make_int4(b * p.in_h * p.in_w, iy, ix, kRowOutput | (interior ? kRowInterior : 0));
    // an index inside the levels: int32 by the handler's checks
    if (interior) s.row_base[r] = ((b * p.in_h + iy) * p.in_w + ix) * p.c;
  }
}

// K block `k0`: A[r][kk] = the level of row r's tap k0 + kk, B[col][kk] = kernel[k0 + kk][col0 + col]; zero
// outside the frame, past K and past N. Four bytes a thread and store; an interior row's bytes without
// bounds checks, at row_base + tap_offset.
template <int kKBytes>
__device__ void GatherStage(const ImageConvProblem& p, const ImageDivisors& div, SharedStorage<kKBytes>& s, int k0,
                            int col0, int tid) {
  constexpr int kLd = RowBytes<kKBytes>();
  const int k_total = p.kh * p.kw * p.c;
  if (tid < kKBytes) {
    const int k = k0 + tid, t = Quotient(k, div.c), c = k - t * p.c, i = Quotient(t, div.kw), j = t - i * p.kw;
    s.tap[tid] = k < k_total ? make_int4(i, j, c, 1) : make_int4(0, 0, 0, 0);
    // used by interior rows only, which exist only where the kernel fits the frame: then the offset is an
    // index difference inside the levels
    s.tap_offset[tid] = k < k_total && p.kh <= p.in_h && p.kw <= p.in_w ? (i * p.in_w + j) * p.c + c : 0;
  }
  __syncthreads();
  for (int idx = tid; idx < kRows * (kKBytes / 4); idx += kThreads) {
    const int r = idx / (kKBytes / 4), q = idx % (kKBytes / 4);
    const int4 o = s.origin[r];
    uint32_t word = 0;
    if (o.w & kRowInterior) {
      const int8_t* field = p.levels + s.row_base[r];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (s.tap[4 * q + e].w) word |= uint32_t{static_cast<uint8_t>(field[s.tap_offset[4 * q + e]])} << (8 * e);
      }
    } else if (o.w) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int4 tap = s.tap[4 * q + e];
        const int iy = o.y + tap.x, ix = o.z + tap.y;
        if (tap.w && iy >= 0 && iy < p.in_h && ix >= 0 && ix < p.in_w) {
          const uint8_t level = static_cast<uint8_t>(p.levels[(o.x + iy * p.in_w + ix) * p.c + tap.z]);
          word |= uint32_t{level} << (8 * e);
        }
      }
    }
    *reinterpret_cast<uint32_t*>(&s.stage.a[r * kLd + 4 * q]) = word;
  }
  for (int idx = tid; idx < kCols * (kKBytes / 4); idx += kThreads) {
    const int col = idx % kCols, q = idx / kCols, n = col0 + col;  // consecutive threads: consecutive columns
    uint32_t word = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int k = k0 + 4 * q + e;
      if (k < k_total && n < p.n) word |= uint32_t{static_cast<uint8_t>(p.kernel[k * p.n + n])} << (8 * e);
    }
    *reinterpret_cast<uint32_t*>(&s.stage.b[col * kLd + 4 * q]) = word;
  }
}

// The warp's 32 x 32 accumulators: [16-row fragment][8-column fragment][register].
struct Accumulators {
  int v[2][4][4];
};

// The K block's k32 steps. Fragments (PTX ISA, m16n8k32 .s8): lane (g, t) holds A rows g, g + 8 at bytes
// 4t..4t+3 and 16 + 4t.., B column g at the same bytes, and D rows g, g + 8 at columns 2t, 2t + 1.
template <int kKBytes>
__device__ void Mainloop(const SharedStorage<kKBytes>& s, Accumulators& acc, int warp_row, int warp_col, int lane) {
#if __CUDA_ARCH__ >= 800
  constexpr int kLd = RowBytes<kKBytes>();
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int ks = 0; ks < kKBytes / 32; ++ks) {
    uint32_t a[2][4], b[4][2];
#pragma unroll
    for (int mf = 0; mf < 2; ++mf) {
      const uint8_t* row = &s.stage.a[(warp_row + 16 * mf + g) * kLd + 32 * ks + 4 * t];
      a[mf][0] = *reinterpret_cast<const uint32_t*>(row);
      a[mf][1] = *reinterpret_cast<const uint32_t*>(row + 8 * kLd);
      a[mf][2] = *reinterpret_cast<const uint32_t*>(row + 16);
      a[mf][3] = *reinterpret_cast<const uint32_t*>(row + 8 * kLd + 16);
    }
#pragma unroll
    for (int nf = 0; nf < 4; ++nf) {
      const uint8_t* col = &s.stage.b[(warp_col + 8 * nf + g) * kLd + 32 * ks + 4 * t];
      b[nf][0] = *reinterpret_cast<const uint32_t*>(col);
      b[nf][1] = *reinterpret_cast<const uint32_t*>(col + 16);
    }
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
  }
#endif
}

template <int kKBytes>
__device__ void StoreAccumulators(SharedStorage<kKBytes>& s, const Accumulators& acc, int warp_row, int warp_col, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mf = 0; mf < 2; ++mf) {
#pragma unroll
    for (int nf = 0; nf < 4; ++nf) {
      const int row = warp_row + 16 * mf + g, col = warp_col + 8 * nf + 2 * t;
      s.tile[row * kTileLd + col] = acc.v[mf][nf][0];
      s.tile[row * kTileLd + col + 1] = acc.v[mf][nf][1];
      s.tile[(row + 8) * kTileLd + col] = acc.v[mf][nf][2];
      s.tile[(row + 8) * kTileLd + col + 1] = acc.v[mf][nf][3];
    }
  }
}

// Each window's max into its first row (the window's cells are read and written by one thread only).
template <int kKBytes>
__device__ void PoolInPlace(SharedStorage<kKBytes>& s, int window, int tid) {
  const int per_tile = kRows / window;
  for (int idx = tid; idx < per_tile * kCols; idx += kThreads) {
    const int first = (idx / kCols) * window, col = idx % kCols;
    int best = s.tile[first * kTileLd + col];
    for (int j = 1; j < window; ++j) best = max(best, s.tile[(first + j) * kTileLd + col]);
    s.tile[first * kTileLd + col] = best;
  }
}

template <int kKBytes>
__device__ void StoreStream(const ImageConvProblem& p, const SharedStorage<kKBytes>& s, int tile_m, int col0, int tid) {
  const int window = p.pool_h * p.pool_w, per_tile = kRows / window;
  const int pooled = p.batch * p.out_h * p.out_w;
  int32_t* out = static_cast<int32_t*>(p.out);
  for (int idx = tid; idx < per_tile * kCols; idx += kThreads) {
    const int pr = idx / kCols, col = idx % kCols, q = tile_m * per_tile + pr;
    if (q < pooled && col0 + col < p.n) {
      out[static_cast<int64_t>(q) * p.n + col0 + col] = s.tile[pr * window * kTileLd + col] >> p.shift;
    }
  }
}

template <int kKBytes>
__device__ void StoreBits(const ImageConvProblem& p, const SharedStorage<kKBytes>& s, int tile_m, int col0, int tid) {
  constexpr int kTileWords = kCols / 32;
  const int window = p.pool_h * p.pool_w, per_tile = kRows / window;
  const int pooled = p.batch * p.out_h * p.out_w, out_words = (p.n + 31) / 32;
  uint32_t* out = static_cast<uint32_t*>(p.out);
  for (int idx = tid; idx < per_tile * p.planes * kTileWords; idx += kThreads) {
    const int word = idx % kTileWords, plane = (idx / kTileWords) % p.planes, pr = idx / (kTileWords * p.planes);
    const int q = tile_m * per_tile + pr, first_col = col0 + 32 * word;
    if (q >= pooled || first_col >= p.n) continue;
    const int* pre = &s.tile[pr * window * kTileLd + 32 * word];
    const int* threshold = &s.threshold[plane * kCols + 32 * word];
    const uint8_t* flip = &s.flip[plane * kCols + 32 * word];
    const int valid = min(32, p.n - first_col);
    uint32_t bits = 0;
    for (int i = 0; i < valid; ++i) {
      const bool bit = flip[i] ? pre[i] <= threshold[i] : pre[i] >= threshold[i];
      bits |= uint32_t{bit} << i;
    }
    out[(static_cast<int64_t>(q) * p.planes + plane) * out_words + first_col / 32] = bits;
  }
}

template <int kKBytes>
__global__ void __launch_bounds__(kThreads, 4) ImageConvKernel(const ImageConvProblem p, const ImageDivisors div) {
  __shared__ SharedStorage<kKBytes> s;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int tile_m = blockIdx.x, col0 = blockIdx.y * kCols;
  const int warp_row = (warp % (kRows / kWarpRows)) * kWarpRows, warp_col = (warp / (kRows / kWarpRows)) * kWarpCols;
  RowOrigins(p, div, s, tile_m, tid);
  for (int i = tid; i < p.planes * kCols; i += kThreads) {
    const int plane = i / kCols, n = col0 + i % kCols;
    s.threshold[i] = n < p.n ? p.threshold[plane * p.n + n] : 0;
    s.flip[i] = n < p.n ? p.flip[plane * p.n + n] : 0;
  }
  Accumulators acc = {};
  const int k_total = p.kh * p.kw * p.c;
  for (int k0 = 0; k0 < k_total; k0 += kKBytes) {
    __syncthreads();  // the origins are written; the last block's fragments are read
    GatherStage(p, div, s, k0, col0, tid);
    __syncthreads();
    Mainloop(s, acc, warp_row, warp_col, lane);
  }
  __syncthreads();  // the stage becomes the epilogue tile
  StoreAccumulators(s, acc, warp_row, warp_col, lane);
  __syncthreads();
  const int window = div.window.divisor;
  if (window > 1) {
    PoolInPlace(s, window, tid);
    __syncthreads();
  }
  if (p.planes == 0) {
    StoreStream(p, s, tile_m, col0, tid);
  } else {
    StoreBits(p, s, tile_m, col0, tid);
  }
}

}  // namespace

cudaError_t LaunchImageConv(const ImageConvProblem& p, cudaStream_t stream) {
  const int window = p.pool_h * p.pool_w;
  const int64_t pooled = int64_t{p.batch} * p.out_h * p.out_w;
  if (pooled == 0 || p.n == 0) return cudaSuccess;
  if (window < 1 || window > kMaxImagePoolWindow || p.planes < 0 || p.planes > kMaxImagePlanes) {
    return cudaErrorInvalidValue;
  }
  const int per_tile = kRows / window;
  const dim3 grid(static_cast<unsigned>((pooled + per_tile - 1) / per_tile),
                  static_cast<unsigned>((p.n + kCols - 1) / kCols));
  if (grid.y > kMaxImageColumnTiles) return cudaErrorInvalidValue;
  ImageDivisors div;
  div.window = FastDivisor(window);
  div.pool_w = FastDivisor(p.pool_w);
  div.out_w = FastDivisor(p.out_w);
  div.out_hw = FastDivisor(p.out_h * p.out_w);
  div.c = FastDivisor(p.c);
  div.kw = FastDivisor(p.kw);
  if (p.kh * p.kw * p.c <= 32) {
    ImageConvKernel<32><<<grid, kThreads, 0, stream>>>(p, div);
  } else {
    ImageConvKernel<64><<<grid, kThreads, 0, stream>>>(p, div);
  }
  return cudaGetLastError();
}

}  // namespace jaxbnn::cuda
