// The direct first-layer kernel: a convolution of int8 image levels with int8 weights on the CUDA cores (dp4a),
// for first layers that sum at most 12 products and write at most 32 channels of threshold planes, as the MNIST
// conv net's 3 x 3 grey layer (9 products, 32 channels). The tensor-core kernels' k32 step would be mostly
// padding there, and their tiles' window building and barriers cost more than the products
// (docs/design/decisions.md).
//
// A thread computes one pooled pixel's 32 channels, one word of each threshold plane: for each pixel of its pool
// window it gathers the receptive field's levels into K4 = ceil(K / 4) words (byte k the product k of the HWIO
// kernel's order, tap (i, j) and channel c; 0 outside the frame and past K), takes K4 dp4a a channel against the
// weights, keeps the max over the window, and writes each plane's word. CTAs stride over the pixels; each thread
// holds the weights (32 K4 words) and the products' tap offsets in registers for its life. Hence at most 12
// products (at 16 the weights spilled). More channels would be more column tiles, each gathering every
// field again: at 64 channels that ran slower than the windowed kernel.
//
// The kernel is bound by its integer instructions (Hopper issues them at half the rate of its issue slots), so the
// per-pixel work is kept to the dp4a and little else: a field's in-frame products are one mask from its rows' and
// columns' ranges (products run row by row, so a row range is one run of bits and a column range the same run in
// every filter row), each product's load predicated on its bit; each channel's dot starts at minus plane 0's
// bound, so that its sign is plane 0's bit, shifted into the word by one funnel shift (another plane first subtracts
// the difference of its bound from plane 0's); and an unpooled layer has no max.
#include "cuda/kernels/image_direct.h"

#include <climits>
#include <cstdint>

#include "cuda/device/common.cuh"
#include "cuda/device/first_layer.cuh"
#include "cuda/kernels/image_window.h"

namespace jaxbnn::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kCols = 32;  // the channels: one word of each plane
static_assert(kCols == kMaxDirectChannels, "a thread writes every channel's bit");
// |dot| <= kMaxDirectProducts * 128 * 128 < 2^18: a bound clamped to +-2^20 gives every bit it gave, and a dot less a
// clamped bound, or less the difference of two, stays far inside int32.
constexpr int kBoundReach = 1 << 20;
static_assert(kMaxDirectProducts * 128 * 128 < kBoundReach / 2, "clamped bounds keep every comparison");

// Launch-time constants: the pooled pixels, the products, the divisors of a pixel's index.
struct DirectLaunch {
  int pooled = 0, products = 0;
  FastDivisor out_hw, out_w;
};

// Bits [first, last) of a word (none where last <= first); first, last < 32 (at most kMaxDirectProducts).
__device__ __forceinline__ uint32_t BitRange(int first, int last) { return ((1u << last) - 1u) & ~((1u << first) - 1u); }
static_assert(kMaxDirectProducts < 32, "a field's products are bits of one word");

// Bit k set where product k (tap (i, j), channel c, k = (i kw + j) C + c) of the field whose first pixel is at (iy0,
// ix0) lies in the frame: its filter rows in frame are a range, hence one run of bits, and its filter columns a
// range, one run of bits in a filter row's run repeated in every filter row (times `row_repeat`, bit i kw C for
// each filter row i).
__device__ __forceinline__ uint32_t InFrameProducts(const ImageConvProblem& p, int iy0, int ix0, uint32_t row_repeat) {
  const int row_products = p.kw * p.c;
  const int row_lo = min(max(-iy0, 0), p.kh), row_hi = min(max(p.in_h - iy0, 0), p.kh);
  const int col_lo = min(max(-ix0, 0), p.kw), col_hi = min(max(p.in_w - ix0, 0), p.kw);
  return BitRange(row_lo * row_products, row_hi * row_products) & (BitRange(col_lo * p.c, col_hi * p.c) * row_repeat);
}

// A byte into a register that keeps its value where bit `bit` of `mask` is clear.
__device__ __forceinline__ void LoadByteIfBit(uint32_t& reg, const int8_t* address, uint32_t mask, uint32_t bit) {
  asm volatile(
      "{\n .reg .pred p;\n .reg .b32 t;\n and.b32 t, %2, %3;\n setp.ne.b32 p, t, 0;\n @p ld.global.nc.u8 %0, [%1];\n}\n"
      : "+r"(reg)
      : "l"(address), "r"(mask), "r"(bit));
}

template <int kWords, bool kPooled>  // K4: the level words of a receptive field; kPooled: a pool window above 1
__global__ void __launch_bounds__(kThreads) ImageDirectKernel(const ImageConvProblem p, const DirectLaunch L) {
  constexpr int kProducts = 4 * kWords;
  __shared__ uint32_t weights[kCols * kWords];  // column n's K4 words
  __shared__ int tap_offset[kProducts];         // product k's byte offset from its field's first pixel
  __shared__ int bound[kMaxImagePlanes * kCols];
  __shared__ uint32_t flip_word[kMaxImagePlanes];
  __shared__ int4 start[kCols / 4];                            // a dot's start: minus plane 0's clamped bound
  __shared__ int4 bound_step[(kMaxImagePlanes - 1) * kCols / 4];  // plane q's clamped bound less plane 0's
  const int tid = threadIdx.x;
  for (int idx = tid; idx < kCols * kWords; idx += kThreads) {
    const int n = idx / kWords, w = idx % kWords;
    uint32_t bytes[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = 4 * w + i;
      const bool take = k < L.products && n < p.n;
      bytes[i] = 0;
      LoadByte(bytes[i], p.kernel + (take ? k * p.n + n : 0), take);
    }
    weights[idx] = Word(bytes);
  }
  for (int k = tid; k < kProducts; k += kThreads) {
    const bool real = k < L.products;  // (past K: never loaded, no bit in InFrameProducts)
    const int i = real ? k / (p.kw * p.c) : 0, j = real ? k / p.c % p.kw : 0, c = real ? k % p.c : 0;
    tap_offset[k] = (i * p.in_w + j) * p.c + c;
  }
  LoadImageBounds(p, bound, flip_word, 0, kCols, tid, kThreads);
  __syncthreads();
  for (int i = tid; i < p.planes * kCols; i += kThreads) {
    const int n = i % kCols, clamped = min(max(bound[i], -kBoundReach), kBoundReach);
    const int clamped0 = min(max(bound[n], -kBoundReach), kBoundReach);
    if (i < kCols) {
      reinterpret_cast<int*>(start)[n] = -clamped;
    } else {
      reinterpret_cast<int*>(bound_step)[i - kCols] = clamped - clamped0;
    }
  }
  __syncthreads();
  // The weights and the taps in registers for the thread's life: the loop below reads shared memory only for the
  // dots' starts and the other planes' bound steps.
  uint32_t column_words[kCols][kWords];
#pragma unroll
  for (int n = 0; n < kCols; ++n) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) column_words[n][w] = weights[n * kWords + w];
  }
  int offsets[kProducts];
#pragma unroll
  for (int k = 0; k < kProducts; ++k) offsets[k] = tap_offset[k];
  uint32_t row_repeat = 0;  // bit i kw C for each filter row i (< 12 bits: kh kw C <= 12)
  for (int i = 0; i < p.kh; ++i) row_repeat |= 1u << (i * p.kw * p.c);

  // a stored pixel's byte is its level's XOR 0x80: out-of-frame bytes keep 0x80 and become level 0 with the others
  const uint32_t fill = p.pixels ? 0x80u : 0u, word_flip = p.pixels ? 0x80808080u : 0u;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  for (int64_t q64 = int64_t{blockIdx.x} * kThreads + tid; q64 < L.pooled; q64 += stride) {
    const int q = static_cast<int>(q64);
    const int b = Quotient(q, L.out_hw), in_image = q - b * L.out_hw.divisor;
    const int py = Quotient(in_image, L.out_w), px = in_image - py * L.out_w.divisor;
    int best[kCols];  // a channel's (max) dot less plane 0's bound
    const int windows_h = kPooled ? p.pool_h : 1, windows_w = kPooled ? p.pool_w : 1;
    for (int wy = 0; wy < windows_h; ++wy) {
      for (int wx = 0; wx < windows_w; ++wx) {
        const int iy0 = (py * p.pool_h + wy) * p.stride_h - p.pad_top;
        const int ix0 = (px * p.pool_w + wx) * p.stride_w - p.pad_left;
        const uint32_t in_frame = InFrameProducts(p, iy0, ix0, row_repeat);
        // the field's first pixel, maybe outside the frame: only its in-frame products are read
        const int8_t* origin = p.levels + ((int64_t{b} * p.in_h + iy0) * p.in_w + ix0) * p.c;
        uint32_t field[kWords];
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
          uint32_t bytes[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            bytes[i] = fill;
            LoadByteIfBit(bytes[i], origin + offsets[4 * w + i], in_frame, 1u << (4 * w + i));
          }
          field[w] = Word(bytes) ^ word_flip;
        }
#pragma unroll
        for (int v = 0; v < kCols / 4; ++v) {
          const int4 s = start[v];
          const int s4[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int n = 4 * v + u;
            int dot = s4[u];
#pragma unroll
            for (int w = 0; w < kWords; ++w) dot = __dp4a(static_cast<int>(field[w]), static_cast<int>(column_words[n][w]), dot);
            best[n] = (kPooled && (wy | wx) != 0) ? max(best[n], dot) : dot;
          }
        }
      }
    }
    // bit n of plane q: (pre >= bound) XOR flip, i.e. best[n] - step >= 0 (step 0 for plane 0); the sign bits, shifted
    // in from channel 31 down, are the complement. Columns past N have bound 2^20 (INT_MAX clamped), above every dot.
    uint32_t below = 0;
#pragma unroll
    for (int n = kCols - 1; n >= 0; --n) below = __funnelshift_l(static_cast<uint32_t>(best[n]), below, 1);
    p.out_bits[int64_t{q} * p.planes] = ~below ^ flip_word[0];
    for (int plane = 1; plane < p.planes; ++plane) {
      below = 0;
#pragma unroll
      for (int v = kCols / 4 - 1; v >= 0; --v) {
        const int4 s = bound_step[(plane - 1) * (kCols / 4) + v];
        below = __funnelshift_l(static_cast<uint32_t>(best[4 * v + 3] - s.w), below, 1);
        below = __funnelshift_l(static_cast<uint32_t>(best[4 * v + 2] - s.z), below, 1);
        below = __funnelshift_l(static_cast<uint32_t>(best[4 * v + 1] - s.y), below, 1);
        below = __funnelshift_l(static_cast<uint32_t>(best[4 * v] - s.x), below, 1);
      }
      p.out_bits[int64_t{q} * p.planes + plane] = ~below ^ flip_word[plane];
    }
  }
}

template <int kWords, bool kPooled>
cudaError_t LaunchInstance(const ImageConvProblem& p, const DirectLaunch& L, cudaStream_t stream) {
  const void* kernel = reinterpret_cast<const void*>(&ImageDirectKernel<kWords, kPooled>);
  int device = 0, sms = 0;
  cudaError_t err;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;
  const int per_sm = CtasPerSm(kernel, kThreads, 0, device);
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  // every SM slot busy once, each CTA striding over the pixels, so that each loads its tile's weights once
  const long long needed = (static_cast<long long>(L.pooled) + kThreads - 1) / kThreads;
  const long long slots = static_cast<long long>(per_sm) * sms;
  ImageDirectKernel<kWords, kPooled><<<static_cast<unsigned>(needed < slots ? needed : slots), kThreads, 0, stream>>>(p, L);
  return cudaGetLastError();
}

template <int kWords>
cudaError_t LaunchWords(const ImageConvProblem& p, const DirectLaunch& L, cudaStream_t stream) {
  return p.pool_h * p.pool_w > 1 ? LaunchInstance<kWords, true>(p, L, stream) : LaunchInstance<kWords, false>(p, L, stream);
}

}  // namespace

bool ImageDirectTakes(const ImageConvProblem& p) {
  if (p.c < 1 || p.kh < 1 || p.kw < 1 || p.n < 1 || p.n > kMaxDirectChannels || p.stride_h < 1 || p.stride_w < 1 ||
      p.pool_h < 1 || p.pool_w < 1 || p.planes < 1 || p.planes > kMaxImagePlanes || p.out_bits == nullptr ||
      p.out_stream != nullptr || p.shift != 0 || p.narrow_stream) {
    return false;
  }
  const int64_t products = int64_t{p.kh} * p.kw * p.c;
  const int64_t pooled = int64_t{p.batch} * p.out_h * p.out_w;
  // the last product's offset from its field's first pixel (tap_offset), and the pixels' index, within int32
  const int64_t last_offset = ((int64_t{p.kh} - 1) * p.in_w + p.kw - 1) * p.c + p.c - 1;
  // a field's first row and column, and the frame's extent past it (InFrameProducts), within int32
  const int64_t reach_h = int64_t{p.out_h} * p.pool_h * p.stride_h, reach_w = int64_t{p.out_w} * p.pool_w * p.stride_w;
  return products <= kMaxDirectProducts && pooled <= INT_MAX && int64_t{p.out_h} * p.out_w <= INT_MAX &&
         last_offset <= INT_MAX && int64_t{p.in_h} + p.pad_top <= INT_MAX && int64_t{p.in_w} + p.pad_left <= INT_MAX &&
         reach_h <= INT_MAX && reach_w <= INT_MAX;
}

cudaError_t LaunchImageDirect(const ImageConvProblem& p, cudaStream_t stream) {
  if (!ImageDirectTakes(p)) return cudaErrorInvalidValue;
  DirectLaunch L;
  L.pooled = static_cast<int>(int64_t{p.batch} * p.out_h * p.out_w);
  if (L.pooled == 0) return cudaSuccess;
  L.products = p.kh * p.kw * p.c;
  L.out_hw = FastDivisor(p.out_h * p.out_w);
  L.out_w = FastDivisor(p.out_w);
  switch ((L.products + 3) / 4) {
    case 1: return LaunchWords<1>(p, L, stream);
    case 2: return LaunchWords<2>(p, L, stream);
    default: return LaunchWords<3>(p, L, stream);
  }
}

}  // namespace jaxbnn::cuda
