// The global pooling kernel (GlobalSumBitsKernel). A CTA's warps take (image, channel chunk) items, `splits` warps
// an item, each summing every splits-th pixel of it. A lane holds kVec consecutive channels: where the channels are
// whole 16-byte vectors, kVec = 8 of an int16 stream (4 of int32), so each of the warp's loads reads 512 contiguous
// bytes of one pixel; else one channel a lane. A warp issues its pixels' loads together (at most kLoadsInFlight)
// before it adds them. The item's first warp adds the other warps' partial sums (shared memory) and compares each
// total with each threshold plane; the lanes of a 32-channel word OR their bits together. The host picks `splits`
// so that a warp's pixels are one round of loads where the images are small (a ResNet's last 7 x 7 or 4 x 4
// stream): measured against XLA's reduction and the forms this replaced in docs/design/decisions.md, "Whole
// networks".
#include "cuda/global_pool.h"

#include <cstdint>
#include <type_traits>

namespace jaxbnn::cuda {
namespace {

constexpr int kThreads = 256, kWarpsPerBlock = kThreads / 32;
constexpr int kLoadsInFlight = 8;  // per lane and round

// The 16 bytes (kVec > 1) or the one element that a lane loads of a pixel: kVec channels of type T.
template <typename T, int kVec>
using LaneLoad = typename std::conditional<kVec == 1, int32_t, uint4>::type;

template <typename T, int kVec>
__device__ __forceinline__ LaneLoad<T, kVec> LoadLane(const T* at) {
  if constexpr (kVec == 1) {
    return __ldg(at);  // sign-extended
  } else {
    static_assert(kVec * sizeof(T) == 16, "one 16-byte vector");
    return __ldg(reinterpret_cast<const uint4*>(at));
  }
}

// Adds a lane's load to its kVec sums (wrapping).
template <typename T, int kVec>
__device__ __forceinline__ void AddLane(const LaneLoad<T, kVec>& v, uint32_t (&sum)[kVec]) {
  if constexpr (kVec == 1) {
    sum[0] += static_cast<uint32_t>(v);
  } else {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      sum[i] += sizeof(T) == 2 ? static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(words[i / 2] >> (16 * (i % 2)))))
                               : words[i];
    }
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) GlobalSumBitsKernel(const GlobalSumProblem p, int splits) {
  constexpr int kChunk = 32 * kVec, kLanesPerWord = 32 / kVec;
  __shared__ uint32_t warp_sums[kWarpsPerBlock][kVec][32];
  const int chunks = (p.channels + kChunk - 1) / kChunk, words = (p.channels + 31) / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = warp / splits, split = warp % splits;  // the item within the CTA, the warp's share of its pixels
  const long long item = static_cast<long long>(blockIdx.x) * (kWarpsPerBlock / splits) + slot;
  const bool live = item < static_cast<long long>(p.batch) * chunks;
  const int b = live ? static_cast<int>(item / chunks) : 0;
  const int chunk = live ? static_cast<int>(item - static_cast<long long>(b) * chunks) : 0;
  const int c0 = kChunk * chunk + kVec * lane;  // this lane's first channel: all kVec real, or none
  const bool real = live && c0 < p.channels;
  uint32_t sum[kVec] = {};  // unsigned: the int32 sums wrap as XLA's do
  if (real) {
    const T* x = static_cast<const T*>(p.stream) + (static_cast<long long>(b) * p.pixels + split) * p.channels + c0;
    const long long step = static_cast<long long>(splits) * p.channels;  // to the warp's next pixel
    for (int i = split; i < p.pixels; i += splits * kLoadsInFlight, x += kLoadsInFlight * step) {
      LaneLoad<T, kVec> v[kLoadsInFlight];
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        if (i + u * splits < p.pixels) v[u] = LoadLane<T, kVec>(x + u * step);
      }
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        if (i + u * splits < p.pixels) AddLane<T, kVec>(v[u], sum);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kVec; ++e) warp_sums[warp][e][lane] = sum[e];
  __syncthreads();
  if (split != 0 || !live) return;
  for (int s = 1; s < splits; ++s) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) sum[e] += warp_sums[warp + s][e][lane];
  }
  const int word = (kChunk * chunk + kVec * lane) / 32;
  for (int plane = 0; plane < p.planes; ++plane) {
    uint32_t bits = 0;
    if (real) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int c = c0 + e;
        const int32_t total = static_cast<int32_t>(sum[e]), t = p.threshold[plane * p.channels + c];
        const bool bit = p.flip[plane * p.channels + c] != 0 ? total <= t : total >= t;
        bits |= static_cast<uint32_t>(bit) << (c % 32);
      }
    }
    if constexpr (kVec == 1) {
      bits = __ballot_sync(0xffffffffu, bits != 0);
    } else {
#pragma unroll
      for (int offset = 1; offset < kLanesPerWord; offset *= 2) bits |= __shfl_xor_sync(0xffffffffu, bits, offset);
    }
    if (lane % kLanesPerWord == 0 && word < words) {
      p.out_bits[(static_cast<long long>(b) * p.planes + plane) * words + word] = bits;
    }
  }
}

// Warps per item: the fewest (1, 2, 4 or 8) whose pixels take one round of loads each, 8 past that.
int SplitsOf(int pixels) {
  int splits = 1;
  while (splits < kWarpsPerBlock && (pixels + splits - 1) / splits > kLoadsInFlight) splits *= 2;
  return splits;
}

template <typename T, int kVec>
void Launch(const GlobalSumProblem& p, cudaStream_t stream) {
  const int splits = SplitsOf(p.pixels), items_per_block = kWarpsPerBlock / splits;
  const long long items = static_cast<long long>(p.batch) * ((p.channels + 32 * kVec - 1) / (32 * kVec));
  const unsigned blocks = static_cast<unsigned>((items + items_per_block - 1) / items_per_block);
  GlobalSumBitsKernel<T, kVec><<<blocks, kThreads, 0, stream>>>(p, splits);
}

}  // namespace

cudaError_t LaunchGlobalSumBits(const GlobalSumProblem& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  const int element_bytes = p.narrow ? 2 : 4;
  // 16-byte vectors: every pixel's channels start 16-byte aligned
  const bool vectors = reinterpret_cast<uintptr_t>(p.stream) % 16 == 0 && p.channels * element_bytes % 16 == 0;
  if (p.narrow) {
    vectors ? Launch<int16_t, 8>(p, stream) : Launch<int16_t, 1>(p, stream);
  } else {
    vectors ? Launch<int32_t, 4>(p, stream) : Launch<int32_t, 1>(p, stream);
  }
  return cudaGetLastError();
}

}  // namespace jaxbnn::cuda
