// What the binary and the ternary panel kernels (popcount_kernels.cc, ternary_dots.cc) share: the words of
// a tile chunk, the instruction-set tiers' target attributes, and the AVX2 tier's byte popcount.
//
// Each tier is compiled for its ISA with __attribute__((target(...))) on its own functions only (not
// per-file flags), so no shared inline code is ever emitted with instructions the running CPU lacks; the
// tier is picked at run time (popcount_kernels.h, ActiveIsa).
#ifndef JAXBNN_XLA_FFI_CPU_PANEL_WORDS_H_
#define JAXBNN_XLA_FFI_CPU_PANEL_WORDS_H_

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#define JAXBNN_X86 1
#include <immintrin.h>
#define JAXBNN_TARGET_POPCNT __attribute__((target("popcnt")))
#define JAXBNN_TARGET_AVX2 __attribute__((target("avx2,popcnt")))
#define JAXBNN_TARGET_AVX512 __attribute__((target("avx512f,avx512vpopcntdq,popcnt")))
#endif

namespace jaxbnn::cpu::panel_words {

inline constexpr int kTileRows = 8;
inline constexpr int kChunkWords = 4;
inline constexpr int kTileChunkWords = kTileRows * kChunkWords;  // 32 words = one 8 x 128-bit tile

inline uint64_t Load64(const uint32_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#ifdef JAXBNN_X86
// AVX2 has no vector popcount: bytes are counted with the nibble lookup table (pshufb); callers sum them
// into 64-bit lanes with psadbw.
JAXBNN_TARGET_AVX2 inline __m256i ByteCountsAvx2(__m256i v) {
  const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3,
                                         1, 2, 2, 3, 2, 3, 3, 4);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  __m256i low = _mm256_and_si256(v, low_nibbles);
  __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
  return _mm256_add_epi8(_mm256_shuffle_epi8(table, low), _mm256_shuffle_epi8(table, high));
}
#endif

}  // namespace jaxbnn::cpu::panel_words

#endif  // JAXBNN_XLA_FFI_CPU_PANEL_WORDS_H_
