// The global pooling kernel (GlobalSumBitsKernel). A CTA's warps take (image, 32-channel word) items, `splits`
// warps an item, each summing every splits-th pixel of it: lane l sums channel 32 word + l, so each of the warp's
// loads reads 32 consecutive channels of one pixel (64 bytes of an int16 stream: whole sectors), and a warp issues
// its pixels' loads together (at most kLoadsInFlight, predicated) before it adds them. The item's first warp adds
// the other warps' partial sums (shared memory) and compares the total with each threshold plane by a ballot: the
// word's bits. The host picks `splits` so that a warp's pixels are one round of loads where the images are small
// (a ResNet's last 7 x 7 or 4 x 4 stream): at batch 8 there are few items, and a warp per item issuing its pixels'
// loads round after round took longer than XLA's reduction (docs/design/decisions.md, "Whole networks").
#include "cuda/global_pool.h"

#include <cstdint>

namespace jaxbnn::cuda {
namespace {

constexpr int kThreads = 256, kWarpsPerBlock = kThreads / 32;
constexpr int kLoadsInFlight = 8;  // per lane and round: independent partial sums

template <typename T>
__global__ void __launch_bounds__(kThreads) GlobalSumBitsKernel(const GlobalSumProblem p, int splits) {
  __shared__ uint32_t warp_sums[kWarpsPerBlock][32];
  const int words = (p.channels + 31) / 32, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = warp / splits, split = warp % splits;  // the item within the CTA, the warp's share of its pixels
  const long long item = static_cast<long long>(blockIdx.x) * (kWarpsPerBlock / splits) + slot;
  const bool live = item < static_cast<long long>(p.batch) * words;
  const int b = live ? static_cast<int>(item / words) : 0;
  const int word = live ? static_cast<int>(item - static_cast<long long>(b) * words) : 0;
  const int c = 32 * word + lane;
  const bool real = live && c < p.channels;
  uint32_t sum = 0;  // unsigned: the int32 sum wraps as XLA's does
  if (real) {
    const T* x = static_cast<const T*>(p.stream) + (static_cast<long long>(b) * p.pixels + split) * p.channels + c;
    const long long step = static_cast<long long>(splits) * p.channels;  // to the warp's next pixel
    uint32_t partial[kLoadsInFlight] = {};
    for (int i = split; i < p.pixels; i += splits * kLoadsInFlight, x += kLoadsInFlight * step) {
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        if (i + u * splits < p.pixels) partial[u] += static_cast<uint32_t>(static_cast<int32_t>(__ldg(x + u * step)));
      }
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) sum += partial[u];
  }
  warp_sums[warp][lane] = sum;
  __syncthreads();
  if (split != 0 || !live) return;
  for (int s = 1; s < splits; ++s) sum += warp_sums[warp + s][lane];
  const int32_t total = static_cast<int32_t>(sum);
  for (int plane = 0; plane < p.planes; ++plane) {
    bool bit = false;
    if (real) {
      const int32_t t = p.threshold[plane * p.channels + c];
      bit = p.flip[plane * p.channels + c] != 0 ? total <= t : total >= t;
    }
    const uint32_t bits = __ballot_sync(0xffffffffu, bit);
    if (lane == 0) p.out_bits[(static_cast<long long>(b) * p.planes + plane) * words + word] = bits;
  }
}

// Warps per item: the fewest (1, 2, 4 or 8) whose pixels take one round of loads each, 8 past that.
int SplitsOf(int pixels) {
  int splits = 1;
  while (splits < kWarpsPerBlock && (pixels + splits - 1) / splits > kLoadsInFlight) splits *= 2;
  return splits;
}

}  // namespace

cudaError_t LaunchGlobalSumBits(const GlobalSumProblem& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  const int splits = SplitsOf(p.pixels), items_per_block = kWarpsPerBlock / splits;
  const long long items = static_cast<long long>(p.batch) * ((p.channels + 31) / 32);
  const unsigned blocks = static_cast<unsigned>((items + items_per_block - 1) / items_per_block);
  if (p.narrow) {
    GlobalSumBitsKernel<int16_t><<<blocks, kThreads, 0, stream>>>(p, splits);
  } else {
    GlobalSumBitsKernel<int32_t><<<blocks, kThreads, 0, stream>>>(p, splits);
  }
  return cudaGetLastError();
}

}  // namespace jaxbnn::cuda
