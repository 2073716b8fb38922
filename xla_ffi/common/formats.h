// The C++ mirror of jaxbnn/formats.py (see docs/formats.md). Header-only, no CUDA or XLA dependency, so
// CPU and CUDA kernels share it; tests/test_native_cpu.py checks that these values equal the Python ones.
#ifndef JAXBNN_XLA_FFI_COMMON_FORMATS_H_
#define JAXBNN_XLA_FFI_COMMON_FORMATS_H_

#include <cstdint>

namespace jaxbnn::formats {

// Packed words: uint32, element j of the packed axis is bit (j % 32) of word (j / 32).
inline constexpr int64_t kWordBits = 32;
inline constexpr bool kLsbFirst = true;

// Binary values: bit 1 is +1, bit 0 is -1; binarization is (x >= 0), so sign(0) = +1.
inline constexpr uint32_t kBitPlusOne = 1;
inline constexpr uint32_t kBitMinusOne = 0;

// Default FSB weight tile: 8 rows x 128 bits (4 words per tile row).
inline constexpr int64_t kFsbTileRows = 8;
inline constexpr int64_t kFsbTileBits = 128;
inline constexpr int64_t kFsbTileWords = kFsbTileBits / kWordBits;

// Ternary planes, bit of (sign plane, non-zero plane) for the values +1, 0, -1 (TAB's encoding).
inline constexpr uint32_t kTernarySignBit[3] = {0, 0, 1};     // for +1, 0, -1
inline constexpr uint32_t kTernaryNonzeroBit[3] = {1, 0, 1};  // for +1, 0, -1
// Ternary planes as activations travel and the ternary kernels read them: nonneg [t >= 0], pos [t > 0].
inline constexpr uint32_t kTernaryNonnegBit[3] = {1, 1, 0};  // for +1, 0, -1
inline constexpr uint32_t kTernaryPosBit[3] = {1, 0, 0};     // for +1, 0, -1

// Conv weight reduction order: tap (kh, kw) = kh * KW + kw holds ceil(C/32) words; tap popcounts are
// int32 (KH*KW, O), indexed [tap, o].
constexpr int64_t TapIndex(int64_t kh, int64_t kw, int64_t kernel_w) { return kh * kernel_w + kw; }

constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t WordsForBits(int64_t bits) { return CeilDiv(bits, kWordBits); }

// Mask of the valid bits of the last word of a packed axis of `bits` elements.
constexpr uint32_t LastWordMask(int64_t bits) {
  return bits % kWordBits == 0 ? ~uint32_t{0} : (uint32_t{1} << (bits % kWordBits)) - 1;
}

}  // namespace jaxbnn::formats

#endif  // JAXBNN_XLA_FFI_COMMON_FORMATS_H_
