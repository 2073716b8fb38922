// The stream's threshold planes (StreamBitsKernel), a memory-bound pass: XLA's reduction over the 32 bits of each
// word read a ResNet-18 stream (512 x 56 x 56 x 64 int16) at 0.7 TB/s (docs/design/decisions.md, "The residual
// epilogue"). Where the rows are whole 32-channel words of 16-byte vectors (kVec > 1), a lane loads kVec
// consecutive channels of the stream viewed as one array, 32 / kVec lanes hold a word and OR their bits together,
// and a warp keeps kLoadsInFlight loads in flight; else a warp takes a (row, word) item and ballots its lanes'
// bits.
#include "cuda/stream_bits.h"

#include <cstdint>
#include <type_traits>

namespace jaxbnn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kLoadsInFlight = 4;  // per lane and round (vector path)

__device__ __forceinline__ bool Bit(int value, int threshold, bool flip) {
  return flip ? value <= threshold : value >= threshold;
}

// index / count, in 32 bits where the index fits (a 64-bit division is a long instruction sequence).
__device__ __forceinline__ long long RowOf(long long index, int count) {
  if (index <= 0xffffffffLL) return static_cast<uint32_t>(index) / static_cast<uint32_t>(count);
  return index / count;
}

// The vector path: lane l of warp chunk u holds vector 32 u + l, channels kVec (32 u + l) .. of the flattened
// stream; 32 % channels == 0 keeps a word's vectors in one row and in 32 / kVec consecutive lanes.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) StreamBitsVectorKernel(const StreamBitsProblem p) {
  using Load = typename std::conditional<sizeof(T) == 2, uint4, int4>::type;
  constexpr int kLanesPerWord = 32 / kVec;
  const int lane = threadIdx.x % 32;
  const long long vectors = p.rows * p.channels / kVec, chunks = (vectors + 31) / 32;
  const long long warps = static_cast<long long>(gridDim.x) * (kThreads / 32);
  const int words = p.channels / 32;
  for (long long u0 = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; u0 < chunks; u0 += kLoadsInFlight * warps) {
    Load v[kLoadsInFlight] = {};
#pragma unroll
    for (int i = 0; i < kLoadsInFlight; ++i) {  // the loads first, then the bits
      const long long vector = (u0 + i * warps) * 32 + lane;
      if (vector < vectors) v[i] = __ldg(reinterpret_cast<const Load*>(p.stream) + vector);
    }
#pragma unroll
    for (int i = 0; i < kLoadsInFlight; ++i) {
      if (u0 + i * warps >= chunks) break;  // the same for the whole warp
      const long long vector = (u0 + i * warps) * 32 + lane;
      const bool real = vector < vectors;
      const long long flat_word = real ? vector / (32 / kVec) : 0;  // the word's index in the flattened stream
      const long long row = RowOf(flat_word, words);
      const int col = 32 * static_cast<int>(flat_word - row * words) + kVec * (lane % kLanesPerWord);
      int values[kVec];
      const uint32_t raw[4] = {static_cast<uint32_t>(v[i].x), static_cast<uint32_t>(v[i].y),
                               static_cast<uint32_t>(v[i].z), static_cast<uint32_t>(v[i].w)};
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        values[e] = sizeof(T) == 2 ? static_cast<int16_t>(raw[e / 2] >> (16 * (e % 2))) : static_cast<int>(raw[e]);
      }
      for (int plane = 0; plane < p.planes; ++plane) {
        uint32_t bits = 0;
        if (real) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const int c = plane * p.channels + col + e;
            bits |= static_cast<uint32_t>(Bit(values[e], __ldg(p.threshold + c), __ldg(p.flip + c) != 0)) << e;
          }
        }
        bits <<= kVec * (lane % kLanesPerWord);
#pragma unroll
        for (int offset = 1; offset < kLanesPerWord; offset *= 2) bits |= __shfl_xor_sync(0xffffffffu, bits, offset);
        if (real && lane % kLanesPerWord == 0) p.out_bits[(row * p.planes + plane) * words + col / 32] = bits;
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

// Enough CTAs to fill the device a few times over; the warps stride over the rest.
unsigned BlocksFor(long long warp_items) {
  int device = 0, sms = 132;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const long long wanted = (warp_items + kThreads / 32 - 1) / (kThreads / 32);
  return static_cast<unsigned>(wanted < 8LL * sms ? (wanted > 0 ? wanted : 1) : 8LL * sms);
}

template <typename T>
void Launch(const StreamBitsProblem& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectors = p.channels % 32 == 0 && reinterpret_cast<uintptr_t>(p.stream) % 16 == 0;
  if (vectors) {
    const long long chunks = (p.rows * p.channels / kVec + 31) / 32;
    StreamBitsVectorKernel<T, kVec><<<BlocksFor((chunks + kLoadsInFlight - 1) / kLoadsInFlight), kThreads, 0, stream>>>(p);
  } else {
    StreamBitsWordKernel<T><<<BlocksFor(p.rows * ((p.channels + 31) / 32)), kThreads, 0, stream>>>(p);
  }
}

}  // namespace

cudaError_t LaunchStreamBits(const StreamBitsProblem& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  p.narrow ? Launch<int16_t>(p, stream) : Launch<int32_t>(p, stream);
  return cudaGetLastError();
}

}  // namespace jaxbnn::cuda
