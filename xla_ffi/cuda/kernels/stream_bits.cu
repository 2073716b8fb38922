// The stream's threshold planes, a memory-bound pass: XLA's reduction over the 32 bits of each word read a
// ResNet-18 stream (512 x 56 x 56 x 64 int16) at 0.7 TB/s (docs/design/decisions.md, "The residual epilogue").
// Where rows are whole 32-channel words of 16-byte vectors and a CTA holds at least one row (StreamBitsRowsKernel),
// each thread keeps one column of vectors: its channels' bounds sit in registers for the whole pass and it
// streams rows with kLoadsInFlight loads in flight; else a warp takes a (row, word) item and ballots its lanes'
// bits (StreamBitsWordKernel).
#include "cuda/stream_bits.h"

#include <climits>
#include <cstdint>
#include <type_traits>

namespace jaxbnn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kLoadsInFlight = 4;  // rows per thread and round (rows kernel)
constexpr int kMaxRowsKernelPlanes = 2;

__device__ __forceinline__ bool Bit(int value, int threshold, bool flip) {
  return flip ? value <= threshold : value >= threshold;
}

// Bit(value, threshold, flip) as one range test, low <= value <= low + span, in wrapping 32-bit arithmetic.
struct Bounds {
  int low;
  uint32_t span;
};

__device__ __forceinline__ Bounds BoundsOf(int threshold, bool flip) {
  return flip ? Bounds{INT_MIN, static_cast<uint32_t>(threshold) - static_cast<uint32_t>(INT_MIN)}
              : Bounds{threshold, static_cast<uint32_t>(INT_MAX) - static_cast<uint32_t>(threshold)};
}

__device__ __forceinline__ bool InBounds(int value, Bounds b) {
  return static_cast<uint32_t>(value) - static_cast<uint32_t>(b.low) <= b.span;
}

// index / count, in 32 bits where the index fits (a 64-bit division is a long instruction sequence).
__device__ __forceinline__ long long RowOf(long long index, int count) {
  if (index <= 0xffffffffLL) return static_cast<uint32_t>(index) / static_cast<uint32_t>(count);
  return index / count;
}

// Thread t of a CTA holds vector column t % columns (channels kVec * column ..) of rows t / columns + k * stride:
// channels % 32 == 0 keeps a word's 32 / kVec vectors in consecutive, aligned lanes of one warp, which OR their
// bits together. Every thread of a CTA runs the same rounds (the shuffles take the whole warp).
template <typename T, int kPlanes>
__global__ void __launch_bounds__(kThreads) StreamBitsRowsKernel(const StreamBitsProblem p) {
  using Load = typename std::conditional<sizeof(T) == 2, uint4, int4>::type;
  constexpr int kVec = 16 / sizeof(T), kLanesPerWord = 32 / kVec;
  const int columns = p.channels / kVec, rows_per_cta = kThreads / columns;
  const int column = threadIdx.x % columns, words = p.channels / 32, word = column / kLanesPerWord;
  const bool active = threadIdx.x < rows_per_cta * columns;
  const int lane_shift = kVec * (column % kLanesPerWord);
  Bounds bounds[kPlanes][kVec];
#pragma unroll
  for (int plane = 0; plane < kPlanes; ++plane) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int c = plane * p.channels + (active ? kVec * column + e : 0);
      bounds[plane][e] = BoundsOf(__ldg(p.threshold + c), __ldg(p.flip + c) != 0);
    }
  }
  const long long stride = static_cast<long long>(gridDim.x) * rows_per_cta;
  const long long first_row = static_cast<long long>(blockIdx.x) * rows_per_cta + threadIdx.x / columns;
  for (long long round = static_cast<long long>(blockIdx.x) * rows_per_cta; round < p.rows;
       round += kLoadsInFlight * stride) {
    const long long row0 = first_row + (round - static_cast<long long>(blockIdx.x) * rows_per_cta);
    Load v[kLoadsInFlight];
#pragma unroll
    for (int i = 0; i < kLoadsInFlight; ++i) {  // the loads first, then the bits
      const long long row = row0 + i * stride;
      v[i] = active && row < p.rows
                 ? __ldg(reinterpret_cast<const Load*>(static_cast<const T*>(p.stream) + row * p.channels) + column)
                 : Load{};
    }
#pragma unroll
    for (int i = 0; i < kLoadsInFlight; ++i) {
      const long long row = row0 + i * stride;
      const bool real = active && row < p.rows;
      const uint32_t raw[4] = {static_cast<uint32_t>(v[i].x), static_cast<uint32_t>(v[i].y),
                               static_cast<uint32_t>(v[i].z), static_cast<uint32_t>(v[i].w)};
#pragma unroll
      for (int plane = 0; plane < kPlanes; ++plane) {
        uint32_t bits = 0;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const int value = sizeof(T) == 2 ? static_cast<int16_t>(raw[e / 2] >> (16 * (e % 2))) : static_cast<int>(raw[e]);
          bits |= static_cast<uint32_t>(InBounds(value, bounds[plane][e])) << e;
        }
        bits = real ? bits << lane_shift : 0;
#pragma unroll
        for (int offset = 1; offset < kLanesPerWord; offset *= 2) bits |= __shfl_xor_sync(0xffffffffu, bits, offset);
        if (real && lane_shift == 0) p.out_bits[(row * kPlanes + plane) * words + word] = bits;
      }
    }
  }
}

// The general path: a warp per (row, word) item, lane l testing channel 32 word + l.
template <typename T>
__global__ void __launch_bounds__(kThreads) StreamBitsWordKernel(const StreamBitsProblem p) {
  const int lane = threadIdx.x % 32;
  const int words = (p.channels + 31) / 32;
  const long long items = p.rows * words, warps = static_cast<long long>(gridDim.x) * (kThreads / 32);
  for (long long item = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; item < items; item += warps) {
    const long long row = RowOf(item, words);
    const int word = static_cast<int>(item - row * words), col = 32 * word + lane;
    const bool real = col < p.channels;
    const int value = real ? static_cast<int>(static_cast<const T*>(p.stream)[row * p.channels + col]) : 0;
    for (int plane = 0; plane < p.planes; ++plane) {
      const int c = plane * p.channels + col;
      const uint32_t bits = __ballot_sync(0xffffffffu, real && Bit(value, __ldg(p.threshold + c), __ldg(p.flip + c) != 0));
      if (lane == 0) p.out_bits[(row * p.planes + plane) * words + word] = bits;
    }
  }
}

// Enough CTAs to fill the device a few times over (at most `wanted`); the CTAs stride over the rest.
unsigned BlocksFor(long long wanted) {
  int device = 0, sms = 132;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return static_cast<unsigned>(wanted < 8LL * sms ? (wanted > 0 ? wanted : 1) : 8LL * sms);
}

template <typename T>
void Launch(const StreamBitsProblem& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool rows = p.channels % 32 == 0 && p.channels / kVec <= kThreads && p.planes <= kMaxRowsKernelPlanes &&
                    reinterpret_cast<uintptr_t>(p.stream) % 16 == 0;
  if (rows) {
    const int rows_per_cta = kThreads / (p.channels / kVec);
    const unsigned blocks = BlocksFor((p.rows + kLoadsInFlight * rows_per_cta - 1) / (kLoadsInFlight * rows_per_cta));
    if (p.planes == 1) {
      StreamBitsRowsKernel<T, 1><<<blocks, kThreads, 0, stream>>>(p);
    } else {
      StreamBitsRowsKernel<T, 2><<<blocks, kThreads, 0, stream>>>(p);
    }
  } else {
    StreamBitsWordKernel<T><<<BlocksFor((p.rows * ((p.channels + 31) / 32) + kThreads / 32 - 1) / (kThreads / 32)),
                              kThreads, 0, stream>>>(p);
  }
}

}  // namespace

cudaError_t LaunchStreamBits(const StreamBitsProblem& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  p.narrow ? Launch<int16_t>(p, stream) : Launch<int32_t>(p, stream);
  return cudaGetLastError();
}

}  // namespace jaxbnn::cuda
