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
// holds the weights (32 K4 words) and the products' tap offsets in registers for its life, so that its loop reads
// shared memory only for the bounds (16-byte loads). Hence at most 12 products: 16 took every register and
// spilled. More channels would be more column tiles, each gathering every field again: at 64 channels that ran
// slower than the windowed kernel.
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

// Launch-time constants: the pooled pixels, the products, the divisors of a pixel's index.
struct DirectLaunch {
  int pooled = 0, products = 0;
  FastDivisor out_hw, out_w;
};

template <int kWords>  // K4: the level words of a receptive field
__global__ void __launch_bounds__(kThreads) ImageDirectKernel(const ImageConvProblem p, const DirectLaunch L) {
  constexpr int kProducts = 4 * kWords;
  __shared__ uint32_t weights[kCols * kWords];  // column n's K4 words
  __shared__ int tap_offset[kProducts];         // product k's byte offset from its field's first pixel
  __shared__ uint32_t tap_place[kProducts];     // its tap (i, j) as i | j << 16
  __shared__ int4 bound[kMaxImagePlanes * kCols / 4];
  __shared__ uint32_t flip_word[kMaxImagePlanes];
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
    const bool real = k < L.products;  // (past K: never taken)
    const int i = real ? k / (p.kw * p.c) : 0, j = real ? k / p.c % p.kw : 0, c = real ? k % p.c : 0;
    tap_offset[k] = (i * p.in_w + j) * p.c + c;
    tap_place[k] = static_cast<uint32_t>(i) | static_cast<uint32_t>(j) << 16;
  }
  LoadImageBounds(p, reinterpret_cast<int*>(bound), flip_word, 0, kCols, tid, kThreads);
  __syncthreads();
  // The weights and the taps in registers for the thread's life: the loop below reads no shared memory but the
  // bounds.
  uint32_t column_words[kCols][kWords];
#pragma unroll
  for (int n = 0; n < kCols; ++n) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) column_words[n][w] = weights[n * kWords + w];
  }
  int offsets[kProducts];
  uint32_t places[kProducts];
#pragma unroll
  for (int k = 0; k < kProducts; ++k) {
    offsets[k] = tap_offset[k];
    places[k] = k < L.products ? tap_place[k] : 0xffffffffu;  // past K: outside every frame (below)
  }

  const uint32_t pixel_flip = p.pixels ? 0x80u : 0u;  // a stored pixel's byte to its level
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  for (int64_t q64 = int64_t{blockIdx.x} * kThreads + tid; q64 < L.pooled; q64 += stride) {
    const int q = static_cast<int>(q64);
    const int b = Quotient(q, L.out_hw), in_image = q - b * L.out_hw.divisor;
    const int py = Quotient(in_image, L.out_w), px = in_image - py * L.out_w.divisor;
    int best[kCols];
#pragma unroll
    for (int n = 0; n < kCols; ++n) best[n] = INT_MIN;
    for (int wy = 0; wy < p.pool_h; ++wy) {
      for (int wx = 0; wx < p.pool_w; ++wx) {
        const int iy0 = (py * p.pool_h + wy) * p.stride_h - p.pad_top;
        const int ix0 = (px * p.pool_w + wx) * p.stride_w - p.pad_left;
        const int64_t origin = ((int64_t{b} * p.in_h + iy0) * p.in_w + ix0) * p.c;
        uint32_t field[kWords];
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
          uint32_t bytes[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            // a place past K has row and column 0xffff, past every frame (ImageDirectTakes)
            const uint32_t place = places[4 * w + i];
            const bool take =
                static_cast<unsigned>(iy0 + static_cast<int>(place & 0xffffu)) < static_cast<unsigned>(p.in_h) &&
                static_cast<unsigned>(ix0 + static_cast<int>(place >> 16)) < static_cast<unsigned>(p.in_w);
            bytes[i] = 0;
            LoadByte(bytes[i], p.levels + (take ? origin + offsets[4 * w + i] : 0), take);
            bytes[i] ^= take ? pixel_flip : 0u;  // outside the frame: level 0
          }
          field[w] = Word(bytes);
        }
#pragma unroll
        for (int n = 0; n < kCols; ++n) {
          int dot = 0;
#pragma unroll
          for (int w = 0; w < kWords; ++w) dot = __dp4a(static_cast<int>(field[w]), static_cast<int>(column_words[n][w]), dot);
          best[n] = max(best[n], dot);
        }
      }
    }
    // bit n of plane `plane`: (pre >= bound) XOR flip (shift 0: the value is the pre-activation); columns past N
    // have bound INT_MAX, above every value
    for (int plane = 0; plane < p.planes; ++plane) {
      uint32_t word = 0;
#pragma unroll
      for (int v = 0; v < kCols / 4; ++v) {
        const int4 b4 = bound[plane * (kCols / 4) + v];
        word |= static_cast<uint32_t>(best[4 * v] >= b4.x) << (4 * v);
        word |= static_cast<uint32_t>(best[4 * v + 1] >= b4.y) << (4 * v + 1);
        word |= static_cast<uint32_t>(best[4 * v + 2] >= b4.z) << (4 * v + 2);
        word |= static_cast<uint32_t>(best[4 * v + 3] >= b4.w) << (4 * v + 3);
      }
      p.out_bits[int64_t{q} * p.planes + plane] = word ^ flip_word[plane];
    }
  }
}

template <int kWords>
cudaError_t LaunchInstance(const ImageConvProblem& p, const DirectLaunch& L, cudaStream_t stream) {
  const void* kernel = reinterpret_cast<const void*>(&ImageDirectKernel<kWords>);
  int device = 0, sms = 0;
  cudaError_t err;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;
  const int per_sm = CtasPerSm(kernel, kThreads, 0, device);
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  // every SM slot busy once, each CTA striding over the pixels, so that each loads its tile's weights once
  const long long needed = (static_cast<long long>(L.pooled) + kThreads - 1) / kThreads;
  const long long slots = static_cast<long long>(per_sm) * sms;
  ImageDirectKernel<kWords><<<static_cast<unsigned>(needed < slots ? needed : slots), kThreads, 0, stream>>>(p, L);
  return cudaGetLastError();
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
  // a field's first row and column, plus a place's 0xffff, within int32; 0xffff past every frame
  const int64_t reach_h = int64_t{p.out_h} * p.pool_h * p.stride_h, reach_w = int64_t{p.out_w} * p.pool_w * p.stride_w;
  return products <= kMaxDirectProducts && pooled <= INT_MAX && int64_t{p.out_h} * p.out_w <= INT_MAX &&
         last_offset <= INT_MAX && int64_t{p.in_h} + p.pad_top < 0xffff && int64_t{p.in_w} + p.pad_left < 0xffff &&
         reach_h <= INT_MAX - 0x10000 && reach_w <= INT_MAX - 0x10000;
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
    case 1: return LaunchInstance<1>(p, L, stream);
    case 2: return LaunchInstance<2>(p, L, stream);
    default: return LaunchInstance<3>(p, L, stream);
  }
}

}  // namespace jaxbnn::cuda
