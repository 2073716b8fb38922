// Global pooling on the CPU: an image's channel sums accumulate pixel by pixel in a row of int32 (unsigned, so
// that they wrap as XLA's int32 sum does; the compiler vectorizes the row), then each plane's comparisons are
// packed word by word.
#include "cpu/pool_kernels.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/parallel_for.h"

namespace jaxbnn::cpu {
namespace {

// Fewer stream elements than this run on the calling thread: waking a helper costs more than the sum.
constexpr int64_t kMinParallelElements = 1 << 16;

template <typename T>
void SumImage(const T* image, int64_t pixels, int64_t channels, uint32_t* sums) {
  std::fill(sums, sums + channels, 0u);
  for (int64_t i = 0; i < pixels; ++i) {
    const T* pixel = image + i * channels;
    for (int64_t c = 0; c < channels; ++c) sums[c] += static_cast<uint32_t>(static_cast<int32_t>(pixel[c]));
  }
}

}  // namespace

void RunGlobalSumBits(const GlobalSumProblem& p, xla::ffi::ThreadPool* pool) {
  const int64_t words = (p.channels + 31) / 32;
  const bool parallel = p.batch > 1 && p.batch * p.pixels * p.channels >= kMinParallelElements;
  ParallelFor(pool, p.batch, parallel, [&](int64_t b) {
    std::vector<uint32_t> sums(static_cast<size_t>(p.channels));
    const int64_t offset = b * p.pixels * p.channels;
    if (p.narrow) {
      SumImage(static_cast<const int16_t*>(p.stream) + offset, p.pixels, p.channels, sums.data());
    } else {
      SumImage(static_cast<const int32_t*>(p.stream) + offset, p.pixels, p.channels, sums.data());
    }
    for (int64_t plane = 0; plane < p.planes; ++plane) {
      const int32_t* threshold = p.threshold + plane * p.channels;
      const uint8_t* flip = p.flip + plane * p.channels;
      uint32_t* out = p.bits + (b * p.planes + plane) * words;
      for (int64_t w = 0; w < words; ++w) {
        uint32_t word = 0;
        for (int64_t c = 32 * w; c < std::min(p.channels, 32 * w + 32); ++c) {
          const int32_t sum = static_cast<int32_t>(sums[c]);
          const bool bit = flip[c] != 0 ? sum <= threshold[c] : sum >= threshold[c];
          word |= static_cast<uint32_t>(bit) << (c % 32);
        }
        out[w] = word;
      }
    }
  });
}

}  // namespace jaxbnn::cpu
