// Instruction-set tiers of the tile-row popcount kernel. Each tier is compiled for its ISA with
// __attribute__((target(...))) on its own functions only (not per-file flags), so no shared inline code is
// ever emitted with instructions the running CPU lacks; the tier is picked with __builtin_cpu_supports.
#include "cpu/popcount_kernels.h"

#include <atomic>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#define JAXBNN_X86 1
#include <immintrin.h>
#define JAXBNN_TARGET_POPCNT __attribute__((target("popcnt")))
#define JAXBNN_TARGET_AVX2 __attribute__((target("avx2,popcnt")))
#define JAXBNN_TARGET_AVX512 __attribute__((target("avx512f,avx512vpopcntdq,popcnt")))
#endif

namespace jaxbnn::cpu {
namespace {

constexpr int kTileRows = 8;
constexpr int kChunkWords = 4;
constexpr int kTileChunkWords = kTileRows * kChunkWords;  // 32 words = one 8 x 128-bit tile

inline uint64_t Load64(const uint32_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Scalar tiers: the same code with and without the popcnt instruction. Loops run tile row by tile row so
// that only kRows accumulators stay live.
#define JAXBNN_SCALAR_TILE_ROW(NAME, ATTR)                                                           \
  template <int kRows>                                                                              \
  ATTR void NAME##Rows(const PanelView& panel, const uint32_t* tile_row, int64_t chunks,            \
                       int32_t* popcounts) {                                                        \
    for (int i = 0; i < kTileRows; ++i) {                                                           \
      uint64_t acc[kRows] = {};                                                                     \
      for (int64_t j = 0; j < chunks; ++j) {                                                        \
        const uint32_t* w = tile_row + j * kTileChunkWords + i * kChunkWords;                      \
        uint64_t w0 = Load64(w), w1 = Load64(w + 2);                                                \
        for (int r = 0; r < kRows; ++r) {                                                           \
          const uint32_t* x = panel.data + r * panel.row_words + j * kChunkWords;                   \
          const uint32_t* m = panel.mask + r * panel.mask_stride + j * kChunkWords;                 \
          acc[r] += __builtin_popcountll((Load64(x) ^ w0) & Load64(m)) +                            \
                    __builtin_popcountll((Load64(x + 2) ^ w1) & Load64(m + 2));                     \
        }                                                                                           \
      }                                                                                             \
      for (int r = 0; r < kRows; ++r) popcounts[r * kTileRows + i] = static_cast<int32_t>(acc[r]);  \
    }                                                                                               \
  }                                                                                                 \
  ATTR void NAME(const PanelView& panel, int rows, const uint32_t* tile_row, int64_t chunks,         \
                 int32_t* popcounts) {                                                              \
    int r = 0;                                                                                      \
    for (; r + 4 <= rows; r += 4) {                                                                 \
      PanelView sub{panel.data + r * panel.row_words, panel.mask + r * panel.mask_stride,           \
                    panel.row_words, panel.mask_stride};                                            \
      NAME##Rows<4>(sub, tile_row, chunks, popcounts + r * kTileRows);                              \
    }                                                                                               \
    for (; r < rows; ++r) {                                                                         \
      PanelView sub{panel.data + r * panel.row_words, panel.mask + r * panel.mask_stride,           \
                    panel.row_words, panel.mask_stride};                                            \
      NAME##Rows<1>(sub, tile_row, chunks, popcounts + r * kTileRows);                              \
    }                                                                                               \
  }

JAXBNN_SCALAR_TILE_ROW(TileRowGeneric, )
#ifdef JAXBNN_X86
JAXBNN_SCALAR_TILE_ROW(TileRowPopcnt, JAXBNN_TARGET_POPCNT)
#endif
#undef JAXBNN_SCALAR_TILE_ROW

#ifdef JAXBNN_X86

// AVX2: a tile chunk is four 256-bit registers (tile rows 2q, 2q+1 in register q); a panel chunk is
// broadcast to both 128-bit lanes. Bytes are counted with the nibble lookup table (pshufb) and summed into
// 64-bit lanes with psadbw.
JAXBNN_TARGET_AVX2 inline __m256i ByteCountsAvx2(__m256i v) {
  const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3,
                                         1, 2, 2, 3, 2, 3, 3, 4);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  __m256i low = _mm256_and_si256(v, low_nibbles);
  __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
  return _mm256_add_epi8(_mm256_shuffle_epi8(table, low), _mm256_shuffle_epi8(table, high));
}

JAXBNN_TARGET_AVX2 void TileRowAvx2(const PanelView& panel, int rows, const uint32_t* tile_row,
                                    int64_t chunks, int32_t* popcounts) {
  const __m256i zero = _mm256_setzero_si256();
  for (int r = 0; r < rows; ++r) {
    const uint32_t* x = panel.data + r * panel.row_words;
    const uint32_t* m = panel.mask + r * panel.mask_stride;
    __m256i acc[4] = {zero, zero, zero, zero};
    for (int64_t j = 0; j < chunks; ++j) {
      const uint32_t* w = tile_row + j * kTileChunkWords;
      __m256i xj = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j * kChunkWords)));
      __m256i mj = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(m + j * kChunkWords)));
      for (int q = 0; q < 4; ++q) {
        __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * q));
        __m256i bits = _mm256_and_si256(_mm256_xor_si256(xj, wq), mj);
        acc[q] = _mm256_add_epi64(acc[q], _mm256_sad_epu8(ByteCountsAvx2(bits), zero));
      }
    }
    for (int q = 0; q < 4; ++q) {
      alignas(32) uint64_t lanes[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[q]);
      popcounts[r * kTileRows + 2 * q] = static_cast<int32_t>(lanes[0] + lanes[1]);
      popcounts[r * kTileRows + 2 * q + 1] = static_cast<int32_t>(lanes[2] + lanes[3]);
    }
  }
}

// GCC 12 reports its own _mm512_undefined_* placeholders (inside the broadcast intrinsics) as maybe
// uninitialized (in the broadcast and narrowing intrinsics); they are do-not-care lanes by design.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// AVX-512 VPOPCNTDQ: a tile chunk is two 512-bit registers (tile rows 0-3 and 4-7, two 64-bit lanes per
// row); a panel chunk is broadcast to the four 128-bit lanes. One ternary-logic op computes
// (x XOR w) AND mask. kRows panel rows share each tile load (register blocking).
template <int kRows, bool kSharedMask>
JAXBNN_TARGET_AVX512 void TileRowAvx512Rows(const PanelView& panel, const uint32_t* tile_row, int64_t chunks,
                                            int32_t* popcounts) {
  constexpr int kXorAnd = 0x28;  // (A ^ B) & C for the ternary-logic truth table A=0xf0, B=0xcc, C=0xaa
  __m512i acc_low[kRows], acc_high[kRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) acc_low[r] = acc_high[r] = _mm512_setzero_si512();
  for (int64_t j = 0; j < chunks; ++j) {
    const __m512i w_low = _mm512_loadu_si512(tile_row + j * kTileChunkWords);
    const __m512i w_high = _mm512_loadu_si512(tile_row + j * kTileChunkWords + 16);
    __m512i shared_mask;
    if constexpr (kSharedMask) {
      shared_mask = _mm512_broadcast_i32x4(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel.mask + j * kChunkWords)));
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512i xj = _mm512_broadcast_i32x4(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(panel.data + r * panel.row_words + j * kChunkWords)));
      __m512i mj;
      if constexpr (kSharedMask) {
        mj = shared_mask;
      } else {
        mj = _mm512_broadcast_i32x4(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(panel.mask + r * panel.mask_stride + j * kChunkWords)));
      }
      acc_low[r] = _mm512_add_epi64(acc_low[r], _mm512_popcnt_epi64(_mm512_ternarylogic_epi64(xj, w_low, mj, kXorAnd)));
      acc_high[r] =
          _mm512_add_epi64(acc_high[r], _mm512_popcnt_epi64(_mm512_ternarylogic_epi64(xj, w_high, mj, kXorAnd)));
    }
  }
  // Tile row i owns 64-bit lanes 2i, 2i+1 of (low, high): add the even lanes to the odd ones.
  const __m512i even_lanes = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
  const __m512i odd_lanes = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    const __m512i sums = _mm512_add_epi64(_mm512_permutex2var_epi64(acc_low[r], even_lanes, acc_high[r]),
                                          _mm512_permutex2var_epi64(acc_low[r], odd_lanes, acc_high[r]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(popcounts + r * kTileRows), _mm512_cvtepi64_epi32(sums));
  }
}

template <bool kSharedMask>
JAXBNN_TARGET_AVX512 void TileRowAvx512Masked(const PanelView& panel, int rows, const uint32_t* tile_row,
                                              int64_t chunks, int32_t* popcounts) {
  constexpr int kBlock = 8;
  int r = 0;
  for (; r + kBlock <= rows; r += kBlock) {
    PanelView sub{panel.data + r * panel.row_words, panel.mask + r * panel.mask_stride, panel.row_words,
                  panel.mask_stride};
    TileRowAvx512Rows<kBlock, kSharedMask>(sub, tile_row, chunks, popcounts + r * kTileRows);
  }
  PanelView sub{panel.data + r * panel.row_words, panel.mask + r * panel.mask_stride, panel.row_words,
                panel.mask_stride};
  int32_t* out = popcounts + r * kTileRows;
  switch (rows - r) {
    case 7: TileRowAvx512Rows<7, kSharedMask>(sub, tile_row, chunks, out); break;
    case 6: TileRowAvx512Rows<6, kSharedMask>(sub, tile_row, chunks, out); break;
    case 5: TileRowAvx512Rows<5, kSharedMask>(sub, tile_row, chunks, out); break;
    case 4: TileRowAvx512Rows<4, kSharedMask>(sub, tile_row, chunks, out); break;
    case 3: TileRowAvx512Rows<3, kSharedMask>(sub, tile_row, chunks, out); break;
    case 2: TileRowAvx512Rows<2, kSharedMask>(sub, tile_row, chunks, out); break;
    case 1: TileRowAvx512Rows<1, kSharedMask>(sub, tile_row, chunks, out); break;
    default: break;
  }
}

void TileRowAvx512(const PanelView& panel, int rows, const uint32_t* tile_row, int64_t chunks,
                   int32_t* popcounts) {
  if (panel.mask_stride == 0) {
    TileRowAvx512Masked<true>(panel, rows, tile_row, chunks, popcounts);
  } else {
    TileRowAvx512Masked<false>(panel, rows, tile_row, chunks, popcounts);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // JAXBNN_X86

Isa DetectBestIsa() {
#ifdef JAXBNN_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vpopcntdq")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt")) return Isa::kAvx2;
  if (__builtin_cpu_supports("popcnt")) return Isa::kPopcnt;
#endif
  return Isa::kGeneric;
}

std::atomic<Isa>& ActiveIsaSlot() {
  static std::atomic<Isa> active{DetectBestIsa()};
  return active;
}

}  // namespace

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512_vpopcntdq";
    case Isa::kAvx2: return "avx2";
    case Isa::kPopcnt: return "popcnt";
    case Isa::kGeneric: return "generic";
  }
  return "generic";
}

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> isas;
  Isa best = DetectBestIsa();
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kPopcnt, Isa::kGeneric}) {
    if (static_cast<int>(isa) <= static_cast<int>(best)) isas.push_back(isa);
  }
  return isas;
}

Isa ActiveIsa() { return ActiveIsaSlot().load(std::memory_order_relaxed); }

bool ForceIsa(const std::string& name) {
  for (Isa isa : SupportedIsas()) {
    if (name == IsaName(isa)) {
      ActiveIsaSlot().store(isa, std::memory_order_relaxed);
      return true;
    }
  }
  return false;
}

TileRowPopcountFn TileRowPopcountFor(Isa isa) {
  switch (isa) {
#ifdef JAXBNN_X86
    case Isa::kAvx512: return TileRowAvx512;
    case Isa::kAvx2: return TileRowAvx2;
    case Isa::kPopcnt: return TileRowPopcnt;
#endif
    default: return TileRowGeneric;
  }
}

}  // namespace jaxbnn::cpu
