// The first layer on the CPU as an implicit GEMM. A task gathers the receptive fields of a run of pooled
// output pixels (one im2col row per conv pixel of each pool window, in the (dy, dx, c) order of the
// kernel's rows, out-of-image taps at level 0) into a per-thread buffer, in its tier's element type, and
// multiplies them with the weights packed for that tier, one column block at a time. The epilogue runs on
// the accumulators in registers: the shifted int32 store, or each threshold plane's compare packed straight
// into output words; only a pool window's running max passes through a small tile.
//
// Tiers (popcount_kernels.h's ActiveIsa, so that tests can force each):
// - AVX-512 VNNI (vpdpbusd: four u8 x s8 products per 32-bit lane). The levels enter offset by 128 (XOR
//   0x80, so level 0 is the byte 0x80), the weights as they are, and the accumulators start at -128 * the
//   column sums of the weights: sum (l + 128) w - 128 sum w = sum l w. The partial sums may wrap, but int32
//   addition wraps modulo 2**32 and the result fits int32 (the reduction is capped), so it is exact. A call
//   of few gathered rows (no more than the reduction's elements and kVnniRawMaxRows: a dense first layer at a
//   small batch) reads the kernel unpacked instead, the offset on the weights (VnniRawBlock).
// - AMX-INT8 (tdpbusd: a 16 x 16 int32 tile += 16 x 64 u8 times 64 x 16 s8 per instruction), where the CPU and
//   the OS grant the tile state: the VNNI tier's operands (offset levels, quads, accumulators' start) in
//   tiles, 32 rows x 32 columns per pass, the VNNI tier's epilogue on the stored sums; for calls of enough
//   gathered rows and a long enough reduction (kAmxMinRows, kAmxMinReduction).
// - AVX2: a kernel of -1, 0 and +1 (every zoo model's) as bytes (vpmaddubsw on the offset levels, as VNNI's
//   operands, 64 quads' products summed in int16 before widening: Avx2ByteBlock), any other int8 kernel as
//   int16 pairs (vpmaddwd); a call of at most kAvx2RawMaxRows gathered rows (a dense first layer at batch 1)
//   reads the kernel as it is, its pairs made in registers (Avx2RawBlock), or, given them and with at most
//   kAvx2MaskMaxRows rows, the kernel's sign masks, made into vpmaddubsw's bytes in registers (Avx2MaskBlock).
// - portable: int16 pairs in plain loops.
#include "cpu/image_kernels.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/formats.h"
#include "cpu/parallel_for.h"
#include "cpu/popcount_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#define JAXBNN_X86 1
#include <immintrin.h>
#define JAXBNN_TARGET_AVX2 __attribute__((target("avx2")))
#define JAXBNN_AVX2_INLINE inline __attribute__((always_inline))
#define JAXBNN_TARGET_VNNI __attribute__((target("avx2,avx512f,avx512bw,avx512vnni")))
#define JAXBNN_VNNI_INLINE inline __attribute__((always_inline))
#define JAXBNN_TARGET_AMX __attribute__((target("avx2,avx512f,avx512bw,avx512vnni,amx-tile,amx-int8")))
#endif

// AMX: x86-64 Linux (arch_prctl grants the tile state), compilers with its intrinsics (GCC 11, Clang 12).
#if defined(__x86_64__) && defined(__linux__) && \
    (defined(__clang__) ? __clang_major__ >= 12 : defined(__GNUC__) && __GNUC__ >= 11)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#define JAXBNN_AMX 1
#endif

namespace jaxbnn::cpu {
namespace {

using formats::CeilDiv;

constexpr int64_t kWordBits = formats::kWordBits;
constexpr int64_t kMaxBlockCols = 256;                  // widest column block of any tier (the pool tile's row)
constexpr int64_t kPatchBytes = 96 * 1024;              // a task's gathered rows (stay in L2)
constexpr int64_t kMaxTaskRows = 512;                   // pooled outputs per task
constexpr int64_t kMinParallelMacs = int64_t{1} << 18;  // products worth a thread hop (decisions.md)
constexpr int64_t kPackCost = 16;                       // packing a weight costs about this many products
constexpr int64_t kMinParallelPack = int64_t{1} << 18;  // weight elements worth a thread hop
constexpr int64_t kPackBlocks = 8;                      // column blocks packed by one task
constexpr int64_t kTasksPerThread = 8;                  // with threads: enough tasks to balance
constexpr int64_t kChunk = 16;                          // elements per copy of the gather
constexpr int64_t kPrefetchRows = 16;                   // how far ahead the packers prefetch kernel rows

int64_t RoundUp(int64_t value, int64_t multiple) { return CeilDiv(value, multiple) * multiple; }

template <class T>
T* Grow(std::vector<T>& vector, int64_t size) {
  if (static_cast<int64_t>(vector.size()) < size) vector.resize(size);
  return vector.data();
}

// Grow's bytes from a 64-byte boundary: the packed weights are read by 32-byte (AVX2) or 64-byte loads, which
// cost twice where they cross a cache line (a vector's data is only 16-byte aligned).
uint8_t* GrowAligned(std::vector<uint8_t>& vector, int64_t size) {
  uint8_t* data = Grow(vector, size + 63);
  return data + (-reinterpret_cast<uintptr_t>(data) & 63);
}

// The epilogue of a call, on the padded columns (n_padded = 32 * words): the stream (dot >> shift, int32, or
// int16 where `narrow`: its low 16 bits) and / or the threshold planes' bits, of the stream's values where both
// are written. A threshold bit is one compare: (value > bound) XOR flip, with bound = threshold - 1 (INT32_MIN
// stays: no value is INT32_MIN, the products are capped at 2**31 - 2**14 in magnitude) for value >= threshold,
// and bound = threshold for the flipped test value <= threshold = not (value > threshold).
struct ImageEpilogue {
  int64_t planes;         // threshold planes of the bits output; 0: none
  int64_t shift;          // of the stream
  const int32_t* bound;   // (planes, n_padded); the padding columns hold INT32_MAX (their dots are 0)
  const uint32_t* flip;   // (planes, words): bit c % 32 of word c / 32 is flip[plane, c] != 0
  int64_t n, n_padded, words;
  void* stream;           // the stream's rows of n values, or null (the bits alone)
  bool narrow;            // the stream is int16
  uint32_t* bits;         // the bits' rows of planes * words words, or null (the stream alone)
};

// A stream value from a dot: dot >> shift, narrowed to int16 (and widened again) where `narrow`.
inline int32_t StreamValue(int32_t dot, int64_t shift, bool narrow) {
  const int32_t value = dot >> shift;
  return narrow ? static_cast<int16_t>(value) : value;
}

// One column block of a task: `rows` pooled outputs of `window` conv pixels each; the gathered row of
// window position w of output r is patches + (w * rows + r) * k_padded elements.
struct BlockJob {
  const void* patches;
  int64_t k, k_padded, rows, window;
  // A tier that reads its rows where they lie (kDirectQuads): gathered row i's quad g is the 4 bytes at
  // quads[i] + g * quad_stride[i], XORed with `to_offset` (patches unused).
  const uint8_t* const* quads;
  const int64_t* quad_stride;
  uint32_t to_offset;
  const void* weights;  // the block's packed weights: (k_padded / group, cols, group); or, for a tier that
                        // reads the kernel as it is, the kernel's (k, n) int8 matrix from column col_begin
  int64_t col_begin, cols;
  const int32_t* bias;  // (cols,): the accumulators' start; null: 0
  int64_t first_output;
  int32_t* tile;        // (rows of a register block, kMaxBlockCols): a window's running max
  ImageKernelMasks masks;  // the kernel's sign masks (a tier that reads them), else none
};

using BlockFn = void (*)(const BlockJob& job, const ImageEpilogue& epilogue);

// Pool window positions: the only one, the first, one in between, the last.
enum Mode { kOnly, kFirst, kMiddle, kLast };

Mode ModeOf(int64_t position, int64_t window) {
  if (window == 1) return kOnly;
  return position == 0 ? kFirst : position + 1 == window ? kLast : kMiddle;
}

inline int32_t Load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The bits of a word of 32 columns (ImageEpilogue).
uint32_t ThresholdBits(const int32_t* dots, const int32_t* bound, uint32_t flip) {
  uint32_t above = 0;
  for (int64_t i = 0; i < kWordBits; ++i) above |= static_cast<uint32_t>(dots[i] > bound[i]) << i;
  return above ^ flip;
}

// Column blocks of the kernel, as a (k, n) matrix, from col_begin: cols columns (the tier's blocks, the last
// one maybe shorter), each packed as (k_padded / group, block cols, group), zero past k and n. A column
// range of a wide kernel is a short run every n bytes, which the hardware prefetchers do not follow from
// page to page: the packers prefetch kPrefetchRows rows ahead.
struct KernelBlock {
  const int8_t* kernel;
  int64_t k, n, col_begin, cols, k_padded;
  int64_t run = 0;  // Avx2BytePack: 0, or each quad of the packed reduction is a kernel row's `run` elements and zeros
};

// dst: the packed block; bias: the accumulators' start of its columns (the VNNI tier's).
using PackBlockFn = void (*)(const KernelBlock& block, void* dst, int32_t* bias);

// int16 pairs in blocks of kPairCols columns, for the AVX2 and portable tiers (no accumulator start).
constexpr int64_t kPairCols = 32;

void PackPairs(const KernelBlock& block, void* packed, int32_t*) {
  static constexpr int8_t kZeros[kPairCols] = {};
  auto* dst = static_cast<int16_t*>(packed);
  const int64_t real = std::clamp<int64_t>(block.n - block.col_begin, 0, block.cols);
  for (int64_t pair = 0; pair < block.k_padded / 2; ++pair) {
    const int8_t* src[2];
    for (int e = 0; e < 2; ++e) {
      const int64_t kk = 2 * pair + e;
      src[e] = kk < block.k ? block.kernel + kk * block.n + block.col_begin : nullptr;
      if (kk + kPrefetchRows < block.k) {
        for (int64_t c = 0; c < real; c += 64) __builtin_prefetch(src[e] + kPrefetchRows * block.n + c);
      }
    }
    for (int64_t first = 0; first < block.cols; first += kPairCols) {
      int16_t* row = dst + first * block.k_padded + pair * kPairCols * 2;
      const int64_t copied = std::clamp<int64_t>(real - first, 0, kPairCols);
      if (copied == kPairCols) {  // a whole block: one interleave the compiler vectorizes
        const int8_t* a = src[0] == nullptr ? kZeros : src[0] + first;
        const int8_t* b = src[1] == nullptr ? kZeros : src[1] + first;
        for (int64_t c = 0; c < kPairCols; ++c) {
          row[2 * c] = a[c];
          row[2 * c + 1] = b[c];
        }
        continue;
      }
      for (int64_t c = 0; c < kPairCols; ++c) {
        row[2 * c] = c < copied && src[0] != nullptr ? src[0][first + c] : 0;
        row[2 * c + 1] = c < copied && src[1] != nullptr ? src[1][first + c] : 0;
      }
    }
  }
}

// --- portable tier: int16 pairs -----------------------------------------------------------------------

constexpr int kPortableRows = 4;
constexpr int kPortableCols = kPairCols;

void PortableBlock(const BlockJob& job, const ImageEpilogue& epi) {
  const auto* patches = static_cast<const int16_t*>(job.patches);
  const auto* weights = static_cast<const int16_t*>(job.weights);
  const int64_t cols = job.cols, pairs = job.k_padded / 2;
  int32_t acc[kPortableRows][kPortableCols];
  for (int64_t r0 = 0; r0 < job.rows; r0 += kPortableRows) {
    const int64_t rows = std::min<int64_t>(kPortableRows, job.rows - r0);
    for (int64_t w = 0; w < job.window; ++w) {
      for (int64_t r = 0; r < rows; ++r) {
        std::fill(acc[r], acc[r] + cols, 0);
        const int16_t* x = patches + (w * job.rows + r0 + r) * job.k_padded;
        for (int64_t g = 0; g < pairs; ++g) {
          const int32_t x0 = x[2 * g], x1 = x[2 * g + 1];
          const int16_t* wg = weights + g * cols * 2;
          for (int64_t c = 0; c < cols; ++c) acc[r][c] += x0 * wg[2 * c] + x1 * wg[2 * c + 1];
        }
      }
      const Mode mode = ModeOf(w, job.window);
      for (int64_t r = 0; r < rows; ++r) {
        int32_t* tile = job.tile + r * kMaxBlockCols;
        if (mode == kMiddle || mode == kLast) {
          for (int64_t c = 0; c < cols; ++c) acc[r][c] = std::max(acc[r][c], tile[c]);
        }
        if (mode == kFirst || mode == kMiddle) {
          std::copy(acc[r], acc[r] + cols, tile);
          continue;
        }
        const int64_t row = job.first_output + r0 + r;
        if (epi.stream != nullptr) {
          const int64_t valid = std::min(cols, epi.n - job.col_begin), at = row * epi.n + job.col_begin;
          for (int64_t c = 0; c < cols; ++c) acc[r][c] = StreamValue(acc[r][c], epi.shift, epi.narrow);
          if (epi.narrow) {
            std::copy(acc[r], acc[r] + valid, static_cast<int16_t*>(epi.stream) + at);
          } else {
            std::copy(acc[r], acc[r] + valid, static_cast<int32_t*>(epi.stream) + at);
          }
          if (epi.planes == 0) continue;
        }
        uint32_t* dst = epi.bits + row * epi.planes * epi.words + job.col_begin / kWordBits;
        for (int64_t p = 0; p < epi.planes; ++p) {
          for (int64_t c = 0; c < cols; c += kWordBits) {
            const int64_t col = job.col_begin + c;
            dst[p * epi.words + c / kWordBits] = ThresholdBits(acc[r] + c, epi.bound + p * epi.n_padded + col,
                                                               epi.flip[p * epi.words + col / kWordBits]);
          }
        }
      }
    }
  }
}

#ifdef JAXBNN_X86

// --- AVX2 tier: vpmaddwd on int16 pairs, 8 columns per register -----------------------------------------

constexpr int kAvx2Rows = 3;
constexpr int kAvx2Cols = kPairCols;

// The accumulators are carried through the reduction loop as 8 x int32, the type of vpmaddwd's sums (as
// __m256i, 4 x int64, GCC 12 copied and spilled them inside the loop).
typedef int V8si __attribute__((vector_size(32)));

// A register block's (pooled) accumulators, 32 columns in order from job.col_begin: the running max of a pool
// window into the tile, or the shifted int32 store / the threshold planes' bits.
template <int R, int kMode>
JAXBNN_TARGET_AVX2 JAXBNN_AVX2_INLINE void Avx2Epilogue(const BlockJob& job, const ImageEpilogue& epi,
                                                      __m256i (&acc)[R][kAvx2Cols / 8], int64_t r0) {
  constexpr int V = kAvx2Cols / 8;
  if constexpr (kMode == kMiddle || kMode == kLast) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const auto* tile = reinterpret_cast<const __m256i*>(job.tile + r * kMaxBlockCols + 8 * v);
        acc[r][v] = _mm256_max_epi32(acc[r][v], _mm256_loadu_si256(tile));
      }
    }
  }
  if constexpr (kMode == kFirst || kMode == kMiddle) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(job.tile + r * kMaxBlockCols + 8 * v), acc[r][v]);
      }
    }
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int64_t row = job.first_output + r0 + r;
    if (epi.stream != nullptr) {
      const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(epi.shift));
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const int64_t col = job.col_begin + 8 * v;
        acc[r][v] = _mm256_sra_epi32(acc[r][v], shift);
        if (epi.narrow) {
          // the low 16 bits, sign-extended: within int16, so that the saturating pack keeps them
          acc[r][v] = _mm256_srai_epi32(_mm256_slli_epi32(acc[r][v], 16), 16);
          const __m128i halves = _mm256_castsi256_si128(
              _mm256_permute4x64_epi64(_mm256_packs_epi32(acc[r][v], acc[r][v]), 0x08));
          int16_t* dst = static_cast<int16_t*>(epi.stream) + row * epi.n + col;
          if (col + 8 <= epi.n) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), halves);
          } else if (col < epi.n) {
            alignas(16) int16_t lanes[8];
            _mm_store_si128(reinterpret_cast<__m128i*>(lanes), halves);
            std::copy(lanes, lanes + (epi.n - col), dst);
          }
          continue;
        }
        int32_t* dst = static_cast<int32_t*>(epi.stream) + row * epi.n + col;
        if (col + 8 <= epi.n) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), acc[r][v]);
        } else if (col < epi.n) {
          const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
          const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(epi.n - col)), lanes);
          _mm256_maskstore_epi32(dst, mask, acc[r][v]);
        }
      }
      if (epi.planes == 0) continue;
    }
    uint32_t* dst = epi.bits + row * epi.planes * epi.words + job.col_begin / kWordBits;
    for (int64_t p = 0; p < epi.planes; ++p) {
      const int32_t* bound = epi.bound + p * epi.n_padded + job.col_begin;
      uint32_t above = 0;
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bound + 8 * v));
        above |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(acc[r][v], b))))
                 << (8 * v);
      }
      dst[p * epi.words] = above ^ epi.flip[p * epi.words + job.col_begin / kWordBits];
    }
  }
}

template <int R, int kMode>
JAXBNN_TARGET_AVX2 void Avx2Rows(const BlockJob& job, const ImageEpilogue& epi, const int16_t* x, int64_t r0) {
  constexpr int V = kAvx2Cols / 8;
  const auto* weights = static_cast<const int16_t*>(job.weights);
  const int64_t pairs = job.k_padded / 2, stride = job.k_padded;
  V8si sum[R][V] = {};
  for (int64_t g = 0; g < pairs; ++g) {
    __m256i wv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + (g * V + v) * 16));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i xr = _mm256_set1_epi32(Load32(x + r * stride + 2 * g));
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) sum[r][v] += reinterpret_cast<V8si>(_mm256_madd_epi16(xr, wv[v]));
    }
  }
  __m256i acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = reinterpret_cast<__m256i>(sum[r][v]);
  }
  Avx2Epilogue<R, kMode>(job, epi, acc, r0);
}

template <int R>
JAXBNN_TARGET_AVX2 void Avx2Window(const BlockJob& job, const ImageEpilogue& epi, int64_t r0) {
  const auto* patches = static_cast<const int16_t*>(job.patches);
  for (int64_t w = 0; w < job.window; ++w) {
    const int16_t* x = patches + (w * job.rows + r0) * job.k_padded;
    switch (ModeOf(w, job.window)) {
      case kOnly: Avx2Rows<R, kOnly>(job, epi, x, r0); break;
      case kFirst: Avx2Rows<R, kFirst>(job, epi, x, r0); break;
      case kMiddle: Avx2Rows<R, kMiddle>(job, epi, x, r0); break;
      case kLast: Avx2Rows<R, kLast>(job, epi, x, r0); break;
    }
  }
}

JAXBNN_TARGET_AVX2 void Avx2Block(const BlockJob& job, const ImageEpilogue& epi) {
  static_assert(kAvx2Rows == 3, "one case per register block height");
  for (int64_t r0 = 0; r0 < job.rows; r0 += kAvx2Rows) {
    switch (std::min<int64_t>(kAvx2Rows, job.rows - r0)) {
      case 3: Avx2Window<3>(job, epi, r0); break;
      case 2: Avx2Window<2>(job, epi, r0); break;
      default: Avx2Window<1>(job, epi, r0); break;
    }
  }
}

// --- AVX2 on the kernel as it is: a call of few gathered rows ---------------------------------------------
// As the VNNI tier's VnniRawBlock: packing the int16 pairs is a pass over the whole kernel, written at twice its
// size, on every call, which a call of few gathered rows does not win back (a dense 784 x 1024 first layer at
// batch 1 took 80 us, nearly all of it the packing). Here two kernel rows' bytes of 16 columns become int16
// pairs in registers (vpmovsxbw, then the word unpacks), times the pair of levels of each row (vpmaddwd: any
// int8 weights, exact in int32). The accumulators keep the unpacks' lane order (columns 0-3 and 8-11 in one,
// 4-7 and 12-15 in the other) until two lane permutes before the epilogue.

constexpr int kAvx2RawRows = 2;           // rows of a register block
constexpr int64_t kAvx2RawCols = 64;      // columns of a block job: one pass of one row, two of two rows
constexpr int64_t kAvx2RawMaxRows = 6;    // the most gathered rows of a call that reads the kernel as it is

// 16 kernel bytes of a row from column `col` as int16 (zeros past the row's `real` columns, which may end
// before the kernel does).
JAXBNN_TARGET_AVX2 JAXBNN_AVX2_INLINE __m256i KernelWords(const int8_t* row, int64_t real) {
  if (real >= 16) return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  alignas(16) int8_t bytes[16] = {};
  if (real > 0) std::memcpy(bytes, row, real);
  return _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(bytes)));
}

// Kernel rows row0 and row1 (null: zeros) of G 16-column groups (`real`: each group's columns in the kernel)
// times the levels 2 g and 2 g + 1 of R rows.
template <int R, int G>
JAXBNN_TARGET_AVX2 JAXBNN_AVX2_INLINE void RawPair(const int8_t* row0, const int8_t* row1, const int64_t (&real)[G],
                                                  const int16_t* x, int64_t stride, int64_t g, V8si (&sum)[R][G][2]) {
  __m256i xr[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) xr[r] = _mm256_set1_epi32(Load32(x + r * stride + 2 * g));
#pragma GCC unroll 4
  for (int b = 0; b < G; ++b) {
    const __m256i a = KernelWords(row0 + 16 * b, real[b]);
    const __m256i c = row1 == nullptr ? _mm256_setzero_si256() : KernelWords(row1 + 16 * b, real[b]);
    const __m256i lo = _mm256_unpacklo_epi16(a, c), hi = _mm256_unpackhi_epi16(a, c);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      sum[r][b][0] += reinterpret_cast<V8si>(_mm256_madd_epi16(lo, xr[r]));
      sum[r][b][1] += reinterpret_cast<V8si>(_mm256_madd_epi16(hi, xr[r]));
    }
  }
}

// R rows x G 16-column groups of a job from its group `first`: sums over the reduction, then the epilogue in
// passes of 32 columns.
template <int R, int G, int kMode>
JAXBNN_TARGET_AVX2 void Avx2RawRows(const BlockJob& job, const ImageEpilogue& epi, const int16_t* x, int64_t r0,
                                    int64_t first) {
  static_assert(G % 2 == 0, "whole 32-column epilogues");
  const int64_t n = epi.n, stride = job.k_padded, pairs = job.k / 2;
  const auto* kernel = static_cast<const int8_t*>(job.weights) + 16 * first;
  int64_t real[G];
#pragma GCC unroll 4
  for (int b = 0; b < G; ++b) real[b] = n - (job.col_begin + 16 * (first + b));
  V8si sum[R][G][2] = {};
  for (int64_t g = 0; g < pairs; ++g) {
    RawPair<R, G>(kernel + 2 * g * n, kernel + (2 * g + 1) * n, real, x, stride, g, sum);
  }
  if (job.k % 2 != 0) RawPair<R, G>(kernel + (job.k - 1) * n, nullptr, real, x, stride, pairs, sum);
#pragma GCC unroll 4
  for (int half = 0; half < G / 2; ++half) {
    __m256i acc[R][kAvx2Cols / 8];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < 2; ++j) {
        const __m256i lo = reinterpret_cast<__m256i>(sum[r][2 * half + j][0]);
        const __m256i hi = reinterpret_cast<__m256i>(sum[r][2 * half + j][1]);
        acc[r][2 * j] = _mm256_permute2x128_si256(lo, hi, 0x20);
        acc[r][2 * j + 1] = _mm256_permute2x128_si256(lo, hi, 0x31);
      }
    }
    BlockJob block = job;
    block.col_begin = job.col_begin + 16 * first + 32 * half;
    block.tile = job.tile + 16 * first + 32 * half;
    Avx2Epilogue<R, kMode>(block, epi, acc, r0);
  }
}

template <int R, int G>
JAXBNN_TARGET_AVX2 void Avx2RawPass(const BlockJob& job, const ImageEpilogue& epi, int64_t r0, int64_t first) {
  const auto* patches = static_cast<const int16_t*>(job.patches);
  for (int64_t w = 0; w < job.window; ++w) {
    const int16_t* x = patches + (w * job.rows + r0) * job.k_padded;
    switch (ModeOf(w, job.window)) {
      case kOnly: Avx2RawRows<R, G, kOnly>(job, epi, x, r0, first); break;
      case kFirst: Avx2RawRows<R, G, kFirst>(job, epi, x, r0, first); break;
      case kMiddle: Avx2RawRows<R, G, kMiddle>(job, epi, x, r0, first); break;
      case kLast: Avx2RawRows<R, G, kLast>(job, epi, x, r0, first); break;
    }
  }
}

// A job's rows in register blocks of up to 2: one row takes 64 columns a pass, two rows 32 (16 accumulators
// and operands within AVX2's 16 registers).
JAXBNN_TARGET_AVX2 void Avx2RawBlock(const BlockJob& job, const ImageEpilogue& epi) {
  static_assert(kAvx2RawRows == 2 && kAvx2RawCols == 64, "one case per register block shape");
  const int64_t groups = job.cols / 16;  // 2 or 4: a job's columns are whole 32-column words
  for (int64_t r0 = 0; r0 < job.rows; r0 += kAvx2RawRows) {
    if (job.rows - r0 == 1) {
      if (groups == 4) {
        Avx2RawPass<1, 4>(job, epi, r0, 0);
      } else {
        Avx2RawPass<1, 2>(job, epi, r0, 0);
      }
      continue;
    }
    for (int64_t first = 0; first < groups; first += 2) Avx2RawPass<2, 2>(job, epi, r0, first);
  }
}

// --- AVX2 on bytes, for kernels of -1, 0 and +1: vpmaddubsw on u8 quads ----------------------------------
// vpmaddubsw multiplies 32 unsigned bytes with 32 signed ones and adds adjacent pairs into int16: twice the
// products of vpmaddwd per instruction. The levels enter offset by 128 (u8, as in the VNNI tier, with the same
// accumulators' start, -128 * the column sums), the weights as bytes in quads: a pair's sum is at most 2 * 255 *
// |w| in magnitude, so with |w| <= 1 (every zoo model's first layer: binary or ternary) 64 quads' pairs add in
// int16 without overflow (64 * 510 = 32,640) before vpmaddwd with ones widens them to int32 (their wrap-free
// sum: below 2**31 as the reduction is capped). A kernel with any other value takes the int16 pairs
// (Avx2Tier); the call checks its values first (KernelWithinUnit).

constexpr int kAvx2ByteRows = 3;
constexpr int kAvx2ByteCols = 32;  // 4 registers of 8 columns' quads
constexpr int kAvx2ByteRun = 64;   // quads summed in int16 before widening

// Whether every value of the (k, n) kernel is -1, 0 or +1.
JAXBNN_TARGET_AVX2 bool KernelWithinUnit(const int8_t* kernel, int64_t size) {
  const __m256i one = _mm256_set1_epi8(1);
  __m256i largest = _mm256_setzero_si256();  // of w + 1 as unsigned bytes: 0, 1 or 2 for -1, 0, +1
  int64_t i = 0;
  for (; i + 32 <= size; i += 32) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kernel + i));
    largest = _mm256_max_epu8(largest, _mm256_add_epi8(w, one));
  }
  alignas(32) uint8_t lanes[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), largest);
  uint8_t most = 0;
  for (int j = 0; j < 32; ++j) most = std::max(most, lanes[j]);
  for (; i < size; ++i) most = std::max<uint8_t>(most, static_cast<uint8_t>(kernel[i] + 1));
  return most <= 2;
}

// 32 bytes of kernel row kk from column `col` (zeros past the row's `real` columns and past k); with block.run,
// kk is an element of the run-padded quads: kernel row (kk / 4) * run + kk % 4, or zeros past the run.
JAXBNN_TARGET_AVX2 JAXBNN_AVX2_INLINE __m256i KernelBytes(const KernelBlock& block, int64_t kk, int64_t col,
                                                          int64_t real) {
  if (block.run > 0) {
    if (kk % 4 >= block.run) return _mm256_setzero_si256();
    kk = kk / 4 * block.run + kk % 4;
  }
  if (kk >= block.k || real <= 0) return _mm256_setzero_si256();
  const int8_t* src = block.kernel + kk * block.n + col;
  if (real >= 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  alignas(32) int8_t bytes[32] = {};
  std::memcpy(bytes, src, real);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes));
}

// Blocks of kAvx2ByteCols columns as quads (four kernel rows' bytes of a column side by side: byte then word
// unpacks, then the 128-bit lanes put in column order), 8 columns a register; and their accumulators' start,
// -128 * their column sums, in the same pass.
JAXBNN_TARGET_AVX2 void Avx2BytePack(const KernelBlock& block, void* packed, int32_t* bias) {
  auto* dst = static_cast<int8_t*>(packed);
  const int64_t blocks = CeilDiv(block.cols, kAvx2ByteCols), quads = block.k_padded / 4;
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t col = block.col_begin + b * kAvx2ByteCols;
    const int64_t real = std::clamp<int64_t>(block.n - col, 0, kAvx2ByteCols);
    int8_t* block_dst = dst + b * kAvx2ByteCols * block.k_padded;
    __m256i sums[4] = {};
    for (int64_t g = 0; g < quads; ++g) {
      __m256i rows[4];
      for (int e = 0; e < 4; ++e) {
        const int64_t kk = 4 * g + e;
        if (kk + kPrefetchRows < block.k && real > 0) {
          _mm_prefetch(reinterpret_cast<const char*>(block.kernel + (kk + kPrefetchRows) * block.n + col), _MM_HINT_T0);
        }
        rows[e] = KernelBytes(block, kk, col, real);
      }
      const __m256i pairs01_lo = _mm256_unpacklo_epi8(rows[0], rows[1]);
      const __m256i pairs01_hi = _mm256_unpackhi_epi8(rows[0], rows[1]);
      const __m256i pairs23_lo = _mm256_unpacklo_epi8(rows[2], rows[3]);
      const __m256i pairs23_hi = _mm256_unpackhi_epi8(rows[2], rows[3]);
      // quads_j: columns 4 j .. 4 j + 3 in the low lane, 16 + 4 j .. in the high one
      const __m256i quads_0 = _mm256_unpacklo_epi16(pairs01_lo, pairs23_lo);
      const __m256i quads_1 = _mm256_unpackhi_epi16(pairs01_lo, pairs23_lo);
      const __m256i quads_2 = _mm256_unpacklo_epi16(pairs01_hi, pairs23_hi);
      const __m256i quads_3 = _mm256_unpackhi_epi16(pairs01_hi, pairs23_hi);
      // out[v]: columns 8 v .. 8 v + 7
      const __m256i out[4] = {_mm256_permute2x128_si256(quads_0, quads_1, 0x20),
                              _mm256_permute2x128_si256(quads_2, quads_3, 0x20),
                              _mm256_permute2x128_si256(quads_0, quads_1, 0x31),
                              _mm256_permute2x128_si256(quads_2, quads_3, 0x31)};
      for (int v = 0; v < 4; ++v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(block_dst + (g * 4 + v) * 32), out[v]);
        sums[v] = _mm256_add_epi32(sums[v], _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, out[v]), ones16));
      }
    }
    for (int v = 0; v < 4 && 8 * v < block.cols - b * kAvx2ByteCols; ++v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bias + b * kAvx2ByteCols + 8 * v),
                          _mm256_mullo_epi32(sums[v], _mm256_set1_epi32(-128)));
    }
  }
}

// The int16 sums as 16 x int16 (as __m256i, GCC 12 copied every sum to another register each step).
typedef short V16hi __attribute__((vector_size(32)));

// acc16 widened into sum: each column's two int16 pair sums added as int32.
template <int R>
JAXBNN_TARGET_AVX2 JAXBNN_AVX2_INLINE void WidenByteSums(V16hi (&acc16)[R][4], V8si (&sum)[R][4]) {
  const __m256i ones16 = _mm256_set1_epi16(1);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      sum[r][v] += reinterpret_cast<V8si>(_mm256_madd_epi16(reinterpret_cast<__m256i>(acc16[r][v]), ones16));
      acc16[r][v] = V16hi{};
    }
  }
}

// x: the gathered rows of the register block (row r at x + r * k_padded); or, kDirect, the first of their
// indices into job.quads.
template <int R, int kMode, bool kDirect>
JAXBNN_TARGET_AVX2 void Avx2ByteRows(const BlockJob& job, const ImageEpilogue& epi, const uint8_t* x, int64_t first,
                                     int64_t r0) {
  const auto* weights = static_cast<const int8_t*>(job.weights);
  const int64_t quads = job.k_padded / 4, stride = job.k_padded;
  [[maybe_unused]] const uint8_t* row_quads[R];
  [[maybe_unused]] int64_t quad_stride[R];
  if constexpr (kDirect) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      row_quads[r] = job.quads[first + r];
      quad_stride[r] = job.quad_stride[first + r];
    }
  }
  V8si sum[R][4];
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) {
    V8si bias;
    std::memcpy(&bias, job.bias + 8 * v, sizeof(bias));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sum[r][v] = bias;
  }
  V16hi acc16[R][4] = {};
  for (int64_t g0 = 0; g0 < quads; g0 += kAvx2ByteRun) {
    const int64_t end = std::min<int64_t>(quads, g0 + kAvx2ByteRun);
    for (int64_t g = g0; g < end; ++g) {
      const auto* wg = reinterpret_cast<const __m256i*>(weights + g * 128);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i xr =
            kDirect ? _mm256_set1_epi32(static_cast<int32_t>(Load32(row_quads[r] + g * quad_stride[r]) ^ job.to_offset))
                    : _mm256_set1_epi32(Load32(x + r * stride + 4 * g));
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          acc16[r][v] += reinterpret_cast<V16hi>(_mm256_maddubs_epi16(xr, _mm256_loadu_si256(wg + v)));
        }
      }
    }
    WidenByteSums<R>(acc16, sum);
  }
  __m256i acc[R][kAvx2Cols / 8];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[r][v] = reinterpret_cast<__m256i>(sum[r][v]);
  }
  Avx2Epilogue<R, kMode>(job, epi, acc, r0);
}

template <int R, bool kDirect>
JAXBNN_TARGET_AVX2 void Avx2ByteWindow(const BlockJob& job, const ImageEpilogue& epi, int64_t r0) {
  const auto* patches = static_cast<const uint8_t*>(job.patches);
  for (int64_t w = 0; w < job.window; ++w) {
    const int64_t first = w * job.rows + r0;
    const uint8_t* x = kDirect ? nullptr : patches + first * job.k_padded;
    switch (ModeOf(w, job.window)) {
      case kOnly: Avx2ByteRows<R, kOnly, kDirect>(job, epi, x, first, r0); break;
      case kFirst: Avx2ByteRows<R, kFirst, kDirect>(job, epi, x, first, r0); break;
      case kMiddle: Avx2ByteRows<R, kMiddle, kDirect>(job, epi, x, first, r0); break;
      case kLast: Avx2ByteRows<R, kLast, kDirect>(job, epi, x, first, r0); break;
    }
  }
}

template <bool kDirect>
JAXBNN_TARGET_AVX2 void Avx2ByteRowBlocks(const BlockJob& job, const ImageEpilogue& epi) {
  static_assert(kAvx2ByteRows == 3 && kAvx2ByteCols == kAvx2Cols, "one case per register block height");
  for (int64_t r0 = 0; r0 < job.rows; r0 += kAvx2ByteRows) {
    switch (std::min<int64_t>(kAvx2ByteRows, job.rows - r0)) {
      case 3: Avx2ByteWindow<3, kDirect>(job, epi, r0); break;
      case 2: Avx2ByteWindow<2, kDirect>(job, epi, r0); break;
      default: Avx2ByteWindow<1, kDirect>(job, epi, r0); break;
    }
  }
}

void Avx2ByteBlock(const BlockJob& job, const ImageEpilogue& epi) { Avx2ByteRowBlocks<false>(job, epi); }
void Avx2QuadBlock(const BlockJob& job, const ImageEpilogue& epi) { Avx2ByteRowBlocks<true>(job, epi); }

// --- AVX2 on the kernel's sign masks: a call of few gathered rows -------------------------------------
// A byte of the masks holds two columns' bits over a quad of the reduction (low nibble: column 2j, high
// nibble: column 2j + 1; bit i: the quad's element i), so a nibble indexes the 16 subset sums of the quad's
// levels. Each gathered row's quads become such tables (ones of the offset levels' low nibbles and ones of
// their high nibbles, at most 60 an entry, so that kAvx2LutByteRun quads' lookups add in byte lanes), and
// vpshufb looks up 32 columns at once: per quad and 64 columns one load of the masks, two nibble extractions,
// four lookups and four byte adds, where making the masks into vpmaddubsw's bytes (Avx2ByteBlock's algebra)
// took four operations per 8 columns (a dense 784 x 1024 first layer at batch 1: docs/design/decisions.md).
// A plane's sum S of the offset levels under its bits gives the dot 2 (S_P - 128 count_P) - L (binary; L: the
// row's level sum) or S_P - S_N - 128 (count_P - count_N) (ternary). The pass over the weights reads 1 / 8
// (binary) or 1 / 4 (ternary) of the kernel's bytes, where Avx2RawBlock reads all of them.

constexpr int kAvx2MaskRows = 1;          // rows of a register block
constexpr int64_t kAvx2MaskCols = 256;    // columns of a block job: its rows' tables serve all of them
// The most gathered rows of a call that reads the masks (binary, ternary): beyond, the packed bytes are faster
// (784 x 1024 on a Zen 3 VM: docs/design/decisions.md).
constexpr int64_t kAvx2MaskMaxRows[2] = {128, 16};
constexpr int64_t kAvx2LutTableBytes = 32;  // a quad's tables: low nibbles' sums, then high nibbles'
constexpr int64_t kAvx2LutByteRun = 4;      // quads summed in byte lanes: 4 * 60 = 240
constexpr int64_t kAvx2LutWordRun = 32;     // quads summed in int16: 32 * (60 + 16 * 60) = 32640

// Byte sums as 32 x uint8, a vector type as V16hi is (GCC copied __m256i sums between registers every step).
typedef unsigned char V32qu __attribute__((vector_size(32)));

// The tables of `quads` quads of offset levels from x: entry m of a quad's first 16 bytes is the sum of the
// low nibbles of its levels i with bit i of m set, of the next 16 the high nibbles'.
JAXBNN_TARGET_AVX2 void Avx2NibbleTables(const uint8_t* x, int64_t quads, uint8_t* tables) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i lane_shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  __m256i element[4], subset[4];  // every byte: the quad's element i; 0xff in the entries m with bit i set
  for (int i = 0; i < 4; ++i) {
    element[i] = _mm256_set1_epi8(static_cast<char>(i));
    alignas(32) uint8_t bytes[32];
    for (int m = 0; m < 32; ++m) bytes[m] = ((m % 16) >> i & 1) ? 0xff : 0;
    subset[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes));
  }
  for (int64_t q = 0; q < quads; ++q) {
    // the low nibbles in the low lane, the high nibbles in the high lane
    const __m256i v =
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(Load32(x + 4 * q)), lane_shift), nibble);
    __m256i t = _mm256_and_si256(_mm256_shuffle_epi8(v, element[0]), subset[0]);
#pragma GCC unroll 4
    for (int i = 1; i < 4; ++i) {
      t = _mm256_add_epi8(t, _mm256_and_si256(_mm256_shuffle_epi8(v, element[i]), subset[i]));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(tables + kAvx2LutTableBytes * q), t);
  }
}

// For the 64 columns of the masks' 16-column words word .. word + 3 (those past the row's `words` read as
// zeros where kPartial), the sums over the reduction of the offset levels under the plane's bits, as 8 x int32
// in column order.
template <bool kPartial>
JAXBNN_TARGET_AVX2 void Avx2MaskedSums(const uint32_t* plane, int64_t words, int64_t word, int64_t quads,
                                       const uint8_t* tables, V8si (&sums)[8]) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i low_high = _mm256_set1_epi16(0x1001);  // bytes (1, 16): L + 16 H
  const __m256i present = _mm256_cmpgt_epi64(_mm256_set1_epi64x(words - word), _mm256_setr_epi64x(0, 1, 2, 3));
  for (V8si& s : sums) s = V8si{};
  for (int64_t q0 = 0; q0 < quads; q0 += kAvx2LutWordRun) {
    const int64_t word_end = std::min(quads, q0 + kAvx2LutWordRun);
    // int16 sums: even columns, bytes 0-7 of each lane (low) and 8-15 (high); odd columns likewise
    V16hi even_low{}, even_high{}, odd_low{}, odd_high{};
    for (int64_t q1 = q0; q1 < word_end; q1 += kAvx2LutByteRun) {
      const int64_t run = std::min(kAvx2LutByteRun, word_end - q1);
      V32qu even_l{}, even_h{}, odd_l{}, odd_h{};  // byte sums of L and of H
#pragma GCC unroll 4
      for (int j = 0; j < kAvx2LutByteRun; ++j) {
        if (j >= run) break;
        const int64_t q = q1 + j;
        const auto* row = reinterpret_cast<const long long*>(plane + 2 * (q * words + word));
        const __m256i bits = kPartial ? _mm256_maskload_epi64(row, present)
                                      : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
        const __m256i even = _mm256_and_si256(bits, nibble);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(bits, 4), nibble);
        const auto* table = reinterpret_cast<const __m128i*>(tables + kAvx2LutTableBytes * q);
        const __m256i low = _mm256_broadcastsi128_si256(_mm_load_si128(table));
        const __m256i high = _mm256_broadcastsi128_si256(_mm_load_si128(table + 1));
        even_l += reinterpret_cast<V32qu>(_mm256_shuffle_epi8(low, even));
        even_h += reinterpret_cast<V32qu>(_mm256_shuffle_epi8(high, even));
        odd_l += reinterpret_cast<V32qu>(_mm256_shuffle_epi8(low, odd));
        odd_h += reinterpret_cast<V32qu>(_mm256_shuffle_epi8(high, odd));
      }
      const auto widen = [&](V32qu l, V32qu h, V16hi& low_half, V16hi& high_half) JAXBNN_TARGET_AVX2 {
        const __m256i lb = reinterpret_cast<__m256i>(l), hb = reinterpret_cast<__m256i>(h);
        low_half += reinterpret_cast<V16hi>(_mm256_maddubs_epi16(_mm256_unpacklo_epi8(lb, hb), low_high));
        high_half += reinterpret_cast<V16hi>(_mm256_maddubs_epi16(_mm256_unpackhi_epi8(lb, hb), low_high));
      };
      widen(even_l, even_h, even_low, even_high);
      widen(odd_l, odd_h, odd_low, odd_high);
    }
    // Lane l of mask byte j holds columns 32 l + 2 j and + 1: interleaved, each 128-bit half is 8 columns in order.
    const __m256i el = reinterpret_cast<__m256i>(even_low), eh = reinterpret_cast<__m256i>(even_high);
    const __m256i ol = reinterpret_cast<__m256i>(odd_low), oh = reinterpret_cast<__m256i>(odd_high);
    const __m256i in_order[4] = {_mm256_unpacklo_epi16(el, ol), _mm256_unpackhi_epi16(el, ol),
                                 _mm256_unpacklo_epi16(eh, oh), _mm256_unpackhi_epi16(eh, oh)};
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      sums[v] += reinterpret_cast<V8si>(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(in_order[v])));
      sums[v + 4] += reinterpret_cast<V8si>(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(in_order[v], 1)));
    }
  }
}

// The sum of `count` offset levels (u8, level + 128) less 128 * count: the levels' sum.
JAXBNN_TARGET_AVX2 JAXBNN_AVX2_INLINE int32_t Avx2LevelSum(const uint8_t* x, int64_t count) {
  const __m256i zero = _mm256_setzero_si256();
  __m256i sum = zero;
  int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    sum = _mm256_add_epi64(sum, _mm256_sad_epu8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), zero));
  }
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  int64_t total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < count; ++i) total += x[i];
  return static_cast<int32_t>(total - 128 * count);
}

// The dots of one gathered row (its tables; level_sum: its L) with 64 columns from `col` (a multiple of 64),
// through the epilogue in passes of 32 columns.
template <bool kTernary, int kMode>
JAXBNN_TARGET_AVX2 void Avx2MaskRow(const BlockJob& job, const ImageEpilogue& epi, const uint8_t* tables,
                                    int32_t level_sum, int64_t r0, int64_t col) {
  const ImageKernelMasks& m = job.masks;
  const int64_t quads = job.k_padded / 4, word = col / 16;
  const bool partial = m.words - word < 4;
  V8si plus[8], minus[8];
  const auto sums = [&](const uint32_t* plane, V8si(&out)[8]) JAXBNN_TARGET_AVX2 {
    if (partial) {
      Avx2MaskedSums<true>(plane, m.words, word, quads, tables, out);
    } else {
      Avx2MaskedSums<false>(plane, m.words, word, quads, tables, out);
    }
  };
  sums(m.plus, plus);
  if constexpr (kTernary) sums(m.minus, minus);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int half = 0; half < 2; ++half) {
    const int64_t begin = col + 32 * half;
    if (begin >= job.col_begin + job.cols) break;
    __m256i acc[1][kAvx2Cols / 8];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const int64_t c = begin + 8 * v;
      const __m256i valid =
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(epi.n - c, 0, 8))), lanes);
      const __m256i plus_count = _mm256_maskload_epi32(m.plus_count + c, valid);
      const __m256i s_plus = reinterpret_cast<__m256i>(plus[4 * half + v]);
      if constexpr (kTernary) {
        const __m256i minus_count = _mm256_maskload_epi32(m.minus_count + c, valid);
        acc[0][v] = _mm256_sub_epi32(_mm256_sub_epi32(s_plus, reinterpret_cast<__m256i>(minus[4 * half + v])),
                                     _mm256_slli_epi32(_mm256_sub_epi32(plus_count, minus_count), 7));
      } else {
        acc[0][v] = _mm256_sub_epi32(
            _mm256_slli_epi32(_mm256_sub_epi32(s_plus, _mm256_slli_epi32(plus_count, 7)), 1),
            _mm256_set1_epi32(level_sum));
      }
    }
    BlockJob block = job;
    block.col_begin = begin;
    block.tile = job.tile + (begin - job.col_begin);
    Avx2Epilogue<1, kMode>(block, epi, acc, r0);
  }
}

// Each gathered row's tables first (all window positions of the job's rows: a pool window's positions are taken
// in turn for each 64 columns), then the rows' dots.
template <bool kTernary>
JAXBNN_TARGET_AVX2 void Avx2MaskColumns(const BlockJob& job, const ImageEpilogue& epi) {
  const auto* patches = static_cast<const uint8_t*>(job.patches);
  const int64_t quads = job.k_padded / 4, gathered = job.rows * job.window;
  const int64_t row_tables = quads * kAvx2LutTableBytes;
  thread_local std::vector<uint8_t> table_bytes;
  thread_local std::vector<int32_t> level_sum_values;
  uint8_t* tables = GrowAligned(table_bytes, gathered * row_tables);
  int32_t* level_sums = Grow(level_sum_values, gathered);
  for (int64_t i = 0; i < gathered; ++i) {
    Avx2NibbleTables(patches + i * job.k_padded, quads, tables + i * row_tables);
    level_sums[i] = kTernary ? 0 : Avx2LevelSum(patches + i * job.k_padded, job.k_padded);
  }
  for (int64_t r0 = 0; r0 < job.rows; ++r0) {
    for (int64_t col = job.col_begin; col < job.col_begin + job.cols; col += 64) {
      for (int64_t w = 0; w < job.window; ++w) {
        const int64_t i = w * job.rows + r0;
        const uint8_t* t = tables + i * row_tables;
        switch (ModeOf(w, job.window)) {
          case kOnly: Avx2MaskRow<kTernary, kOnly>(job, epi, t, level_sums[i], r0, col); break;
          case kFirst: Avx2MaskRow<kTernary, kFirst>(job, epi, t, level_sums[i], r0, col); break;
          case kMiddle: Avx2MaskRow<kTernary, kMiddle>(job, epi, t, level_sums[i], r0, col); break;
          case kLast: Avx2MaskRow<kTernary, kLast>(job, epi, t, level_sums[i], r0, col); break;
        }
      }
    }
  }
}

JAXBNN_TARGET_AVX2 void Avx2MaskBlock(const BlockJob& job, const ImageEpilogue& epi) {
  if (job.masks.minus != nullptr) {
    Avx2MaskColumns<true>(job, epi);
  } else {
    Avx2MaskColumns<false>(job, epi);
  }
}

// --- AVX-512 VNNI tier: vpdpbusd on u8 quads, 16 columns per register -------------------------------------

// GCC 12 reports its own _mm512_undefined_* placeholders (inside the shift intrinsics) as maybe
// uninitialized; they are do-not-care lanes by design.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

constexpr int kVnniRows = 6;
constexpr int kVnniCols = 64;  // the last block of a call may be 32

// The accumulators are carried through the reduction loop as 16 x int32, the type of vpdpbusd itself: as
// __m512i (8 x int64) every step converts them, and GCC 12 then copied and spilled them inside the loop.
typedef int V16si __attribute__((vector_size(64)));

// acc + the products of the u8 `x` and the s8 `w`, four per lane.
JAXBNN_TARGET_VNNI inline V16si Dpbusd(V16si acc, __m512i x, __m512i w) {
  return reinterpret_cast<V16si>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc), x, w));
}

// Blocks of kVnniCols columns (the last one may be 32) as quads: four kernel rows' bytes of a column side by
// side (byte then word unpacks, then a transpose of the 128-bit lanes into column order); and their
// accumulators' start, -128 * their column sums (vpdpbusd of ones), in the same pass. Row by row across
// the blocks, so that each row's columns are read in one run.
JAXBNN_TARGET_VNNI void VnniPack(const KernelBlock& block, void* packed, int32_t* bias) {
  auto* dst = static_cast<int8_t*>(packed);
  const int64_t blocks = CeilDiv(block.cols, kVnniCols), quads = block.k_padded / 4;
  const __m512i ones = _mm512_set1_epi8(1);
  std::fill(bias, bias + block.cols, 0);
  for (int64_t g = 0; g < quads; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t col = block.col_begin + b * kVnniCols;
      const int64_t cols = std::min<int64_t>(kVnniCols, block.cols - b * kVnniCols);
      const int64_t real = std::clamp<int64_t>(block.n - col, 0, cols);
      const __mmask64 columns = real == 64 ? ~__mmask64{0} : (__mmask64{1} << real) - 1;
      __m512i rows[4];
      for (int e = 0; e < 4; ++e) {
        const int64_t kk = 4 * g + e;
        rows[e] = _mm512_setzero_si512();
        if (kk >= block.k) continue;
        const int8_t* src = block.kernel + kk * block.n + col;
        if (kk + kPrefetchRows < block.k) {
          _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchRows * block.n), _MM_HINT_T0);
        }
        rows[e] = _mm512_maskz_loadu_epi8(columns, src);
      }
      const __m512i pairs01_lo = _mm512_unpacklo_epi8(rows[0], rows[1]);
      const __m512i pairs01_hi = _mm512_unpackhi_epi8(rows[0], rows[1]);
      const __m512i pairs23_lo = _mm512_unpacklo_epi8(rows[2], rows[3]);
      const __m512i pairs23_hi = _mm512_unpackhi_epi8(rows[2], rows[3]);
      // quads_j, lane l: the quads of columns 16 l + 4 j .. 16 l + 4 j + 3
      const __m512i quads_0 = _mm512_unpacklo_epi16(pairs01_lo, pairs23_lo);
      const __m512i quads_1 = _mm512_unpackhi_epi16(pairs01_lo, pairs23_lo);
      const __m512i quads_2 = _mm512_unpacklo_epi16(pairs01_hi, pairs23_hi);
      const __m512i quads_3 = _mm512_unpackhi_epi16(pairs01_hi, pairs23_hi);
      const __m512i t0 = _mm512_shuffle_i32x4(quads_0, quads_1, 0x44);
      const __m512i t1 = _mm512_shuffle_i32x4(quads_2, quads_3, 0x44);
      const __m512i t2 = _mm512_shuffle_i32x4(quads_0, quads_1, 0xee);
      const __m512i t3 = _mm512_shuffle_i32x4(quads_2, quads_3, 0xee);
      // out[v]: columns 16 v .. 16 v + 15
      const __m512i out[4] = {_mm512_shuffle_i32x4(t0, t1, 0x88), _mm512_shuffle_i32x4(t0, t1, 0xdd),
                              _mm512_shuffle_i32x4(t2, t3, 0x88), _mm512_shuffle_i32x4(t2, t3, 0xdd)};
      int8_t* block_dst = dst + b * kVnniCols * block.k_padded + g * cols * 4;
      int32_t* block_bias = bias + b * kVnniCols;
      for (int v = 0; v < cols / 16; ++v) {
        _mm512_storeu_si512(block_dst + v * 64, out[v]);
        V16si sum;
        std::memcpy(&sum, block_bias + 16 * v, sizeof(sum));
        sum = Dpbusd(sum, ones, out[v]);
        std::memcpy(block_bias + 16 * v, &sum, sizeof(sum));
      }
    }
  }
  for (int64_t c = 0; c < block.cols; ++c) bias[c] *= -128;  // column sums reach 2**7 * 131071: times 128 fits
}

// A register block's (pooled) accumulators, columns in order: the running max of a pool window into the
// tile, or the shifted int32 store / the threshold planes' bits.
template <int R, int V, int kMode>
JAXBNN_TARGET_VNNI JAXBNN_VNNI_INLINE void VnniEpilogue(const BlockJob& job, const ImageEpilogue& epi,
                                                      __m512i (&acc)[R][V], int64_t r0) {
  if constexpr (kMode == kMiddle || kMode == kLast) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        acc[r][v] = _mm512_max_epi32(acc[r][v], _mm512_loadu_si512(job.tile + r * kMaxBlockCols + 16 * v));
      }
    }
  }
  if constexpr (kMode == kFirst || kMode == kMiddle) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) _mm512_storeu_si512(job.tile + r * kMaxBlockCols + 16 * v, acc[r][v]);
    }
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int64_t row = job.first_output + r0 + r;
    if (epi.stream != nullptr) {
      const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(epi.shift));
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const int64_t col = job.col_begin + 16 * v;
        acc[r][v] = _mm512_sra_epi32(acc[r][v], shift);
        const __mmask16 valid =
            col + 16 <= epi.n ? __mmask16{0xffff} : static_cast<__mmask16>((1u << std::max<int64_t>(0, epi.n - col)) - 1);
        if (epi.narrow) {
          acc[r][v] = _mm512_srai_epi32(_mm512_slli_epi32(acc[r][v], 16), 16);  // the low 16 bits, sign-extended
          int16_t* dst = static_cast<int16_t*>(epi.stream) + row * epi.n + col;
          if (valid == 0xffff) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(acc[r][v]));
          } else if (valid != 0) {
            _mm512_mask_cvtepi32_storeu_epi16(dst, valid, acc[r][v]);
          }
          continue;
        }
        int32_t* dst = static_cast<int32_t*>(epi.stream) + row * epi.n + col;
        if (valid == 0xffff) {
          _mm512_storeu_si512(dst, acc[r][v]);
        } else if (valid != 0) {
          _mm512_mask_storeu_epi32(dst, valid, acc[r][v]);
        }
      }
      if (epi.planes == 0) continue;
    }
    uint32_t* dst = epi.bits + row * epi.planes * epi.words + job.col_begin / kWordBits;
    for (int64_t p = 0; p < epi.planes; ++p) {
      const int32_t* bound = epi.bound + p * epi.n_padded + job.col_begin;
      const uint32_t* flip = epi.flip + p * epi.words + job.col_begin / kWordBits;
#pragma GCC unroll 8
      for (int v = 0; v < V; v += 2) {
        const uint32_t above =
            _mm512_cmpgt_epi32_mask(acc[r][v], _mm512_loadu_si512(bound + 16 * v)) |
            static_cast<uint32_t>(_mm512_cmpgt_epi32_mask(acc[r][v + 1], _mm512_loadu_si512(bound + 16 * v + 16)))
                << 16;
        dst[p * epi.words + v / 2] = above ^ flip[v / 2];
      }
    }
  }
}

template <int R, int V, int kMode>
JAXBNN_TARGET_VNNI void VnniRows(const BlockJob& job, const ImageEpilogue& epi, const uint8_t* x, int64_t r0) {
  const auto* weights = static_cast<const int8_t*>(job.weights);
  const int64_t quads = job.k_padded / 4, stride = job.k_padded;
  V16si sum[R][V];
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    V16si bias;
    std::memcpy(&bias, job.bias + 16 * v, sizeof(bias));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sum[r][v] = bias;
  }
  for (int64_t g = 0; g < quads; ++g) {
    __m512i wv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_si512(weights + (g * V + v) * 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i xr = _mm512_set1_epi32(Load32(x + r * stride + 4 * g));
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) sum[r][v] = Dpbusd(sum[r][v], xr, wv[v]);
    }
  }
  __m512i acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = reinterpret_cast<__m512i>(sum[r][v]);
  }
  VnniEpilogue<R, V, kMode>(job, epi, acc, r0);
}

template <int R, int V>
JAXBNN_TARGET_VNNI void VnniWindow(const BlockJob& job, const ImageEpilogue& epi, int64_t r0) {
  const auto* patches = static_cast<const uint8_t*>(job.patches);
  for (int64_t w = 0; w < job.window; ++w) {
    const uint8_t* x = patches + (w * job.rows + r0) * job.k_padded;
    switch (ModeOf(w, job.window)) {
      case kOnly: VnniRows<R, V, kOnly>(job, epi, x, r0); break;
      case kFirst: VnniRows<R, V, kFirst>(job, epi, x, r0); break;
      case kMiddle: VnniRows<R, V, kMiddle>(job, epi, x, r0); break;
      case kLast: VnniRows<R, V, kLast>(job, epi, x, r0); break;
    }
  }
}

template <int V>
JAXBNN_TARGET_VNNI void VnniColumns(const BlockJob& job, const ImageEpilogue& epi) {
  static_assert(kVnniRows == 6, "one case per register block height");
  for (int64_t r0 = 0; r0 < job.rows; r0 += kVnniRows) {
    switch (std::min<int64_t>(kVnniRows, job.rows - r0)) {
      case 6: VnniWindow<6, V>(job, epi, r0); break;
      case 5: VnniWindow<5, V>(job, epi, r0); break;
      case 4: VnniWindow<4, V>(job, epi, r0); break;
      case 3: VnniWindow<3, V>(job, epi, r0); break;
      case 2: VnniWindow<2, V>(job, epi, r0); break;
      default: VnniWindow<1, V>(job, epi, r0); break;
    }
  }
}

JAXBNN_TARGET_VNNI void VnniBlock(const BlockJob& job, const ImageEpilogue& epi) {
  if (job.cols == kVnniCols) {
    VnniColumns<4>(job, epi);
  } else {
    VnniColumns<2>(job, epi);
  }
}

// --- AVX-512 VNNI on the kernel as it is: a call of few gathered rows ------------------------------------
// Packing the weights is a pass over all of them per call, which a call of few gathered rows (a dense first
// layer at a small batch) does not win back. This variant reads the (k, n) kernel directly: four kernel
// rows' bytes of 64 columns become quads in registers (VnniPack's byte and word unpacks; the accumulators
// keep that lane order until a transpose before the epilogue), and the offset moves to the weights: vpdpbusd
// takes w XOR 0x80 = w + 128 as its unsigned operand and the levels as they are, and the accumulators lose
// 128 * the row's sum of levels: sum (w + 128) l - 128 sum l = sum w l (exact modulo 2**32, as above).
// A pass over the reduction covers up to 256 columns (4 / R blocks of 64 for R rows): four-line runs of each
// kernel row stream from memory about 1.4x faster than one line per row (2 cores, a 784 x 1024 kernel).

constexpr int kVnniRawRows = 4;       // rows of a register block
constexpr int kVnniRawBlocks = 4;     // 64-column blocks x rows of a register block, at most
constexpr int64_t kVnniRawCols = 256;  // columns of a block job
constexpr int64_t kVnniRawMaxRows = 64;  // the most gathered rows of a call that reads the kernel as it is

// Kernel rows 4 g .. 4 g + 3 (the first `rows` of them; the others 0) of the B 64-column blocks from
// `kernel` (`columns[b]` masks the real ones), offset by 128, times the levels 4 g .. 4 g + 3 of R rows.
template <int R, int B>
JAXBNN_TARGET_VNNI JAXBNN_VNNI_INLINE void RawQuad(const int8_t* kernel, int64_t n, const __mmask64 (&columns)[B],
                                                   int64_t rows, const int8_t* x, int64_t stride, int64_t g,
                                                   V16si (&sum)[R][B][4]) {
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i xr[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) xr[r] = _mm512_set1_epi32(Load32(x + r * stride + 4 * g));
#pragma GCC unroll 4
  for (int b = 0; b < B; ++b) {
    __m512i row[4];
#pragma GCC unroll 4
    for (int e = 0; e < 4; ++e) {
      const __m512i w = e < rows ? _mm512_maskz_loadu_epi8(columns[b], kernel + (4 * g + e) * n + 64 * b)
                                 : _mm512_setzero_si512();
      row[e] = _mm512_xor_si512(w, offset);
    }
    const __m512i pairs01_lo = _mm512_unpacklo_epi8(row[0], row[1]);
    const __m512i pairs01_hi = _mm512_unpackhi_epi8(row[0], row[1]);
    const __m512i pairs23_lo = _mm512_unpacklo_epi8(row[2], row[3]);
    const __m512i pairs23_hi = _mm512_unpackhi_epi8(row[2], row[3]);
    // quads[j], lane l: the quads of columns 16 l + 4 j .. 16 l + 4 j + 3
    const __m512i quads[4] = {
        _mm512_unpacklo_epi16(pairs01_lo, pairs23_lo), _mm512_unpackhi_epi16(pairs01_lo, pairs23_lo),
        _mm512_unpacklo_epi16(pairs01_hi, pairs23_hi), _mm512_unpackhi_epi16(pairs01_hi, pairs23_hi)};
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) sum[r][b][j] = Dpbusd(sum[r][b][j], quads[j], xr[r]);
    }
  }
}

// The sum of a gathered row's `count` levels.
JAXBNN_TARGET_VNNI JAXBNN_VNNI_INLINE int32_t LevelSum(const int8_t* x, int64_t count) {
  const __m512i ones = _mm512_set1_epi8(1);
  V16si sum = {};
  for (int64_t i = 0; i < count; i += 64) {
    const __mmask64 mask = count - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (count - i)) - 1;
    sum = Dpbusd(sum, ones, _mm512_maskz_loadu_epi8(mask, x + i));
  }
  return _mm512_reduce_add_epi32(reinterpret_cast<__m512i>(sum));
}

// R rows x B 64-column blocks of a job, from its column block `first`; the last block of the job may be 32
// columns (then its epilogue takes 2 registers).
template <int R, int B, int kMode>
JAXBNN_TARGET_VNNI void VnniRawRows(const BlockJob& job, const ImageEpilogue& epi, const int8_t* x, int64_t r0,
                                    int64_t first) {
  const int64_t n = epi.n, stride = job.k_padded, whole = job.k / 4;
  const auto* kernel = static_cast<const int8_t*>(job.weights) + 64 * first;
  __mmask64 columns[B];
#pragma GCC unroll 4
  for (int b = 0; b < B; ++b) {
    const int64_t real = std::clamp<int64_t>(n - (job.col_begin + 64 * (first + b)), 0, 64);
    columns[b] = real == 64 ? ~__mmask64{0} : (__mmask64{1} << real) - 1;
  }
  V16si sum[R][B][4] = {};
  for (int64_t g = 0; g < whole; ++g) RawQuad<R, B>(kernel, n, columns, 4, x, stride, g, sum);
  if (whole * 4 < job.k) RawQuad<R, B>(kernel, n, columns, job.k - whole * 4, x, stride, whole, sum);
  int32_t offsets[R];  // 128 * each row's level sum, wrapped as the accumulators are
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    offsets[r] = static_cast<int32_t>(static_cast<uint32_t>(LevelSum(x + r * stride, job.k_padded)) * 128u);
  }
#pragma GCC unroll 4
  for (int b = 0; b < B; ++b) {
    __m512i acc[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m512i q[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) q[j] = reinterpret_cast<__m512i>(sum[r][b][j]);
      // q[j] lane l holds columns 16 l + 4 j ..: register v takes lanes v of q[0..3], columns 16 v .. 16 v + 15
      const __m512i t0 = _mm512_shuffle_i32x4(q[0], q[1], 0x44), t1 = _mm512_shuffle_i32x4(q[2], q[3], 0x44);
      const __m512i t2 = _mm512_shuffle_i32x4(q[0], q[1], 0xee), t3 = _mm512_shuffle_i32x4(q[2], q[3], 0xee);
      const __m512i correction = _mm512_set1_epi32(offsets[r]);
      acc[r][0] = _mm512_sub_epi32(_mm512_shuffle_i32x4(t0, t1, 0x88), correction);
      acc[r][1] = _mm512_sub_epi32(_mm512_shuffle_i32x4(t0, t1, 0xdd), correction);
      acc[r][2] = _mm512_sub_epi32(_mm512_shuffle_i32x4(t2, t3, 0x88), correction);
      acc[r][3] = _mm512_sub_epi32(_mm512_shuffle_i32x4(t2, t3, 0xdd), correction);
    }
    BlockJob block = job;
    block.col_begin = job.col_begin + 64 * (first + b);
    block.tile = job.tile + 64 * (first + b);
    if (job.col_begin + job.cols - block.col_begin == 32) {
      __m512i half[R][2];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) half[r][0] = acc[r][0], half[r][1] = acc[r][1];
      VnniEpilogue<R, 2, kMode>(block, epi, half, r0);
    } else {
      VnniEpilogue<R, 4, kMode>(block, epi, acc, r0);
    }
  }
}

template <int R, int B>
JAXBNN_TARGET_VNNI void VnniRawPass(const BlockJob& job, const ImageEpilogue& epi, int64_t r0, int64_t first) {
  const auto* patches = static_cast<const int8_t*>(job.patches);
  for (int64_t w = 0; w < job.window; ++w) {
    const int8_t* x = patches + (w * job.rows + r0) * job.k_padded;
    switch (ModeOf(w, job.window)) {
      case kOnly: VnniRawRows<R, B, kOnly>(job, epi, x, r0, first); break;
      case kFirst: VnniRawRows<R, B, kFirst>(job, epi, x, r0, first); break;
      case kMiddle: VnniRawRows<R, B, kMiddle>(job, epi, x, r0, first); break;
      case kLast: VnniRawRows<R, B, kLast>(job, epi, x, r0, first); break;
    }
  }
}

template <int kValue>
using Int = std::integral_constant<int, kValue>;

// A job's rows in register blocks of up to 4, each swept over its 64-column blocks in passes of 4 / R blocks:
// pass(r0, first, Int<R>, Int<B>) for R rows from r0 and B blocks from `first` (the kernels that read the
// kernel or its masks as they are).
template <class Pass>
JAXBNN_VNNI_INLINE void ForRegisterBlocks(const BlockJob& job, Pass&& pass) {
  const int64_t blocks = CeilDiv(job.cols, 64);
  for (int64_t r0 = 0; r0 < job.rows; r0 += 4) {
    const int64_t rows = std::min<int64_t>(4, job.rows - r0);
    const int64_t per_pass = std::max<int64_t>(1, 4 / rows);
    for (int64_t first = 0; first < blocks; first += per_pass) {
      switch (rows * 8 + std::min(per_pass, blocks - first)) {
        case 4 * 8 + 1: pass(r0, first, Int<4>{}, Int<1>{}); break;
        case 3 * 8 + 1: pass(r0, first, Int<3>{}, Int<1>{}); break;
        case 2 * 8 + 2: pass(r0, first, Int<2>{}, Int<2>{}); break;
        case 2 * 8 + 1: pass(r0, first, Int<2>{}, Int<1>{}); break;
        case 1 * 8 + 4: pass(r0, first, Int<1>{}, Int<4>{}); break;
        case 1 * 8 + 3: pass(r0, first, Int<1>{}, Int<3>{}); break;
        case 1 * 8 + 2: pass(r0, first, Int<1>{}, Int<2>{}); break;
        default: pass(r0, first, Int<1>{}, Int<1>{}); break;
      }
    }
  }
}

JAXBNN_TARGET_VNNI void VnniRawBlock(const BlockJob& job, const ImageEpilogue& epi) {
  static_assert(kVnniRawRows == 4 && kVnniRawBlocks == 4, "ForRegisterBlocks' register block shapes");
  ForRegisterBlocks(job, [&](int64_t r0, int64_t first, auto rows, auto blocks) JAXBNN_TARGET_VNNI {
    VnniRawPass<decltype(rows)::value, decltype(blocks)::value>(job, epi, r0, first);
  });
}

// --- AVX-512 VNNI on the kernel's sign masks: a call of few gathered rows -----------------------------
// A kernel of -1, 0 and +1 (every zoo model's first layer) also given as its sign masks (ImageKernelMasks,
// `formats.image_kernel_masks`): one bit per weight, an eighth of the kernel's bytes, each 64-bit word the operand
// of one vpdpbusd (16 columns x 4 reduction elements). A word becomes bytes in registers (vpmovm2b: -1 where
// its bit is set), so the pass over the weights reads 1 / 8 (binary) or 1 / 4 (ternary) of the kernel's bytes
// and issues one vpdpbusd per 64 products, against VnniRawBlock's four loads, XORs and unpacks (a dense
// 784 x 1024 first layer at batch 1 on a Zen 5 VM: docs/design/decisions.md). The levels enter offset by 128
// (u8), so that:
// - binary, one mask M = [w = +1]: S = sum_{M} -(l + 128), and the dot is 2 sum_{M} l - sum l
//   = -2 S - 256 count_M - sum l;
// - ternary, masks P = [w = +1] and N = [w = -1], the bytes [N] - [P] = w: S = sum (l + 128) w, and the dot
//   is S - 128 (count_P - count_N).
// Both exact modulo 2**32 like the other tiers (the result fits int32).

constexpr int kMaskRows = 4;         // rows of a register block
constexpr int kMaskBlocks = 4;       // 64-column blocks x rows of a register block, at most
constexpr int64_t kMaskCols = 256;   // columns of a block job

// The weights of 16 columns x 4 reduction elements as bytes, from the masks' word at `offset` (in uint32) of
// each plane.
template <bool kTernary>
JAXBNN_TARGET_VNNI JAXBNN_VNNI_INLINE __m512i MaskBytes(const ImageKernelMasks& m, int64_t offset) {
  uint64_t plus;
  std::memcpy(&plus, m.plus + offset, sizeof(plus));
  const __m512i p = _mm512_movm_epi8(_cvtu64_mask64(plus));
  if constexpr (!kTernary) return p;
  uint64_t minus;
  std::memcpy(&minus, m.minus + offset, sizeof(minus));
  return _mm512_sub_epi8(_mm512_movm_epi8(_cvtu64_mask64(minus)), p);
}

// R rows x B 64-column blocks of a job from its column block `first`.
template <int R, int B, bool kTernary, int kMode>
JAXBNN_TARGET_VNNI void MaskRows(const BlockJob& job, const ImageEpilogue& epi, const int8_t* x, int64_t r0,
                                 int64_t first) {
  const ImageKernelMasks& m = job.masks;
  const int64_t stride = job.k_padded, quads = job.k_padded / 4, word = (job.col_begin + 64 * first) / 16;
  // the pass's words past the masks' last (columns past n of a 32-column last block) are read as zeros
  const int64_t real_words = std::clamp<int64_t>(m.words - word, 0, 4 * B);
  V16si sum[R][B][4] = {};
  for (int64_t g = 0; g < quads; ++g) {
    __m512i xr[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint32_t offset_levels = static_cast<uint32_t>(Load32(x + r * stride + 4 * g)) ^ 0x80808080u;
      xr[r] = _mm512_set1_epi32(static_cast<int32_t>(offset_levels));
    }
    const int64_t row = 2 * (g * m.words + word);
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i w =
            4 * b + j < real_words ? MaskBytes<kTernary>(m, row + 2 * (4 * b + j)) : _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) sum[r][b][j] = Dpbusd(sum[r][b][j], xr[r], w);
      }
    }
  }
  int32_t level_sums[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) level_sums[r] = kTernary ? 0 : LevelSum(x + r * stride, job.k_padded);
#pragma GCC unroll 4
  for (int b = 0; b < B; ++b) {
    const int64_t col = job.col_begin + 64 * (first + b);
    __m512i term[4];  // per column: 256 count_M (binary), 128 (count_P - count_N) (ternary)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const int64_t c = col + 16 * j;
      const __mmask16 valid = c + 16 <= epi.n ? __mmask16{0xffff}
                              : static_cast<__mmask16>((1u << std::clamp<int64_t>(epi.n - c, 0, 16)) - 1);
      const __m512i plus = _mm512_maskz_loadu_epi32(valid, m.plus_count + c);
      if constexpr (kTernary) {
        term[j] = _mm512_slli_epi32(_mm512_sub_epi32(plus, _mm512_maskz_loadu_epi32(valid, m.minus_count + c)), 7);
      } else {
        term[j] = _mm512_slli_epi32(plus, 8);
      }
    }
    __m512i acc[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i s = reinterpret_cast<__m512i>(sum[r][b][j]);
        acc[r][j] = kTernary ? _mm512_sub_epi32(s, term[j])
                             : _mm512_sub_epi32(_mm512_sub_epi32(_mm512_sub_epi32(_mm512_setzero_si512(),
                                                                                  _mm512_slli_epi32(s, 1)),
                                                                 term[j]),
                                                _mm512_set1_epi32(level_sums[r]));
      }
    }
    BlockJob block = job;
    block.col_begin = col;
    block.tile = job.tile + 64 * (first + b);
    if (job.col_begin + job.cols - col == 32) {
      __m512i half[R][2];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) half[r][0] = acc[r][0], half[r][1] = acc[r][1];
      VnniEpilogue<R, 2, kMode>(block, epi, half, r0);
    } else {
      VnniEpilogue<R, 4, kMode>(block, epi, acc, r0);
    }
  }
}

template <int R, int B, bool kTernary>
JAXBNN_TARGET_VNNI void MaskPass(const BlockJob& job, const ImageEpilogue& epi, int64_t r0, int64_t first) {
  const auto* patches = static_cast<const int8_t*>(job.patches);
  for (int64_t w = 0; w < job.window; ++w) {
    const int8_t* x = patches + (w * job.rows + r0) * job.k_padded;
    switch (ModeOf(w, job.window)) {
      case kOnly: MaskRows<R, B, kTernary, kOnly>(job, epi, x, r0, first); break;
      case kFirst: MaskRows<R, B, kTernary, kFirst>(job, epi, x, r0, first); break;
      case kMiddle: MaskRows<R, B, kTernary, kMiddle>(job, epi, x, r0, first); break;
      case kLast: MaskRows<R, B, kTernary, kLast>(job, epi, x, r0, first); break;
    }
  }
}

template <bool kTernary>
JAXBNN_TARGET_VNNI void MaskColumns(const BlockJob& job, const ImageEpilogue& epi) {
  static_assert(kMaskRows == 4 && kMaskBlocks == 4, "ForRegisterBlocks' register block shapes");
  ForRegisterBlocks(job, [&](int64_t r0, int64_t first, auto rows, auto blocks) JAXBNN_TARGET_VNNI {
    MaskPass<decltype(rows)::value, decltype(blocks)::value, kTernary>(job, epi, r0, first);
  });
}

JAXBNN_TARGET_VNNI void VnniMaskBlock(const BlockJob& job, const ImageEpilogue& epi) {
  if (job.masks.minus != nullptr) {
    MaskColumns<true>(job, epi);
  } else {
    MaskColumns<false>(job, epi);
  }
}

#ifdef JAXBNN_AMX

// --- AMX-INT8 tier: tdpbusd on tiles ----------------------------------------------------------------------

constexpr int kAmxRows = 32;          // gathered rows of a pass: two activation tiles of 16
constexpr int kAmxPassCols = 32;      // columns of a pass: two weight tiles of 16 (a block has 1 or 2 passes)
constexpr int kAmxDepth = 64;         // reduction bytes of a tile row (the packed reduction is a multiple)
// Where the tiles win (measured, 2-core Xeon, A/B in one process): a call of at least 32 gathered rows and a
// reduction of at least 320 levels (784 x 1024 at 256 rows 0.79 -> 0.56 ms, AlexNet's 11 x 11 x 3 1.07 ->
// 0.91 ms); shorter reductions lose to VNNI, each pass's 32 x 32 epilogue then outweighing a few tdpbusd
// (7 x 7 x 3 1.27 -> 1.78 ms, 5 x 5 x 8 4.7 -> 6.2 ms, 3 x 3 x 3 2.2x slower).
constexpr int64_t kAmxMinRows = 32;
constexpr int64_t kAmxMinReduction = 320;

// The tile palette: tiles 0-3 the int32 sums of a pass (rows 0-15 / 16-31 x columns 0-15 / 16-31), 4-5 the
// activations (16 rows x 64 levels), 6-7 the weights (16 quads x 16 columns); every tile 16 rows of 64 bytes.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// The sums of 32 rows x 32 columns (sums: row-major, 32 per row) over the reduction: x the rows' levels
// (stride x_stride), w the pass's quads (stride w_stride: the block's columns x 4 bytes).
JAXBNN_TARGET_AMX void AmxPassSums(const uint8_t* x, int64_t x_stride, const int8_t* w, int64_t w_stride,
                                   int64_t depth_steps, int32_t* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < depth_steps; ++s) {
    _tile_loadd(4, x + s * kAmxDepth, x_stride);
    _tile_loadd(5, x + 16 * x_stride + s * kAmxDepth, x_stride);
    _tile_loadd(6, w + s * (kAmxDepth / 4) * w_stride, w_stride);
    _tile_loadd(7, w + s * (kAmxDepth / 4) * w_stride + 64, w_stride);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  constexpr int64_t kRowBytes = kAmxPassCols * sizeof(int32_t);
  _tile_stored(0, sums, kRowBytes);
  _tile_stored(1, sums + 16, kRowBytes);
  _tile_stored(2, sums + 16 * kAmxPassCols, kRowBytes);
  _tile_stored(3, sums + 16 * kAmxPassCols + 16, kRowBytes);
}

// R rows of a pass's sums plus the accumulators' start, through the VNNI tier's epilogue.
template <int R, int kMode>
JAXBNN_TARGET_AMX void AmxEpilogueRows(const BlockJob& pass, const ImageEpilogue& epi, const int32_t* sums,
                                       const int32_t* bias, int64_t r0) {
  __m512i acc[R][2];
  const __m512i start[2] = {_mm512_loadu_si512(bias), _mm512_loadu_si512(bias + 16)};
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      acc[r][v] = _mm512_add_epi32(_mm512_loadu_si512(sums + r * kAmxPassCols + 16 * v), start[v]);
    }
  }
  VnniEpilogue<R, 2, kMode>(pass, epi, acc, r0);
}

// Rows r0 .. r0 + 31 (those below job.rows written) x columns 32 half .. 32 half + 31 of window position w.
// The activation tiles may read up to 31 rows past the job's: the task's patches keep them (RunTask).
template <int kMode>
JAXBNN_TARGET_AMX void AmxPass(const BlockJob& job, const ImageEpilogue& epi, int64_t r0, int64_t half, int64_t w,
                               int32_t* sums) {
  const auto* x = static_cast<const uint8_t*>(job.patches) + (w * job.rows + r0) * job.k_padded;
  const auto* weights = static_cast<const int8_t*>(job.weights) + half * kAmxPassCols * 4;
  AmxPassSums(x, job.k_padded, weights, job.cols * 4, job.k_padded / kAmxDepth, sums);
  BlockJob pass = job;
  pass.col_begin = job.col_begin + half * kAmxPassCols;
  const int32_t* bias = job.bias + half * kAmxPassCols;
  for (int64_t rr = 0; rr < kAmxRows && r0 + rr < job.rows; rr += 4) {
    pass.tile = job.tile + rr * kMaxBlockCols + half * kAmxPassCols;
    const int32_t* rows = sums + rr * kAmxPassCols;
    switch (std::min<int64_t>(4, job.rows - r0 - rr)) {
      case 4: AmxEpilogueRows<4, kMode>(pass, epi, rows, bias, r0 + rr); break;
      case 3: AmxEpilogueRows<3, kMode>(pass, epi, rows, bias, r0 + rr); break;
      case 2: AmxEpilogueRows<2, kMode>(pass, epi, rows, bias, r0 + rr); break;
      default: AmxEpilogueRows<1, kMode>(pass, epi, rows, bias, r0 + rr); break;
    }
  }
}

// A block job (VnniPack's 64 or 32 columns) in passes of 32 rows x 32 columns, each over the pool window.
// The tile configuration is per thread: loaded for the job, released after it.
JAXBNN_TARGET_AMX void AmxBlock(const BlockJob& job, const ImageEpilogue& epi) {
  static const AmxTileConfig config;
  _tile_loadconfig(&config);
  alignas(64) int32_t sums[kAmxRows * kAmxPassCols];
  for (int64_t half = 0; half < job.cols / kAmxPassCols; ++half) {
    for (int64_t r0 = 0; r0 < job.rows; r0 += kAmxRows) {
      for (int64_t w = 0; w < job.window; ++w) {
        switch (ModeOf(w, job.window)) {
          case kOnly: AmxPass<kOnly>(job, epi, r0, half, w, sums); break;
          case kFirst: AmxPass<kFirst>(job, epi, r0, half, w, sums); break;
          case kMiddle: AmxPass<kMiddle>(job, epi, r0, half, w, sums); break;
          case kLast: AmxPass<kLast>(job, epi, r0, half, w, sums); break;
        }
      }
    }
  }
  _tile_release();
}

// Whether this CPU has AMX-INT8 and the OS grants this process the tile data state (Linux: arch_prctl
// ARCH_REQ_XCOMP_PERM, once per process).
bool DetectAmx() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return false;  // OSXSAVE
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return false;  // AMX-TILE, AMX-INT8
  unsigned xcr0_low, xcr0_high;
  __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if ((xcr0_low & (3u << 17)) != (3u << 17)) return false;  // XTILECFG, XTILEDATA enabled by the OS
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

std::atomic<bool>& AmxEnabledSlot() {
  static std::atomic<bool> enabled{AmxUsable()};
  return enabled;
}
#endif  // JAXBNN_AMX

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // JAXBNN_X86

// --- tiers --------------------------------------------------------------------------------------------

// A tier: the element of its gathered rows (level 0 is Level<Tier>(0)) and of its packed weights, the
// reduction elements per 32-bit lane (kGroup), its column block (the last block of a call may be 32 columns),
// rows per register block, its packer (null: the block kernel reads the kernel as it is) and block kernel,
// and whether the levels are offset by 128 (then the packer sets the accumulators' start).
struct PortableTier {
  using Elem = int16_t;
  using Weight = int16_t;
  static constexpr int kGroup = 2, kBlockCols = kPortableCols, kRows = kPortableRows;
  static constexpr PackBlockFn kPack = PackPairs;
  static constexpr BlockFn kBlock = PortableBlock;
  static constexpr bool kOffsetLevels = false;
};

#ifdef JAXBNN_X86
struct Avx2Tier {
  using Elem = int16_t;
  using Weight = int16_t;
  static constexpr int kGroup = 2, kBlockCols = kAvx2Cols, kRows = kAvx2Rows;
  static constexpr PackBlockFn kPack = PackPairs;
  static constexpr BlockFn kBlock = Avx2Block;
  static constexpr bool kOffsetLevels = false;
};

struct Avx2RawTier {
  using Elem = int16_t;
  using Weight = int8_t;
  static constexpr int kGroup = 2, kBlockCols = kAvx2RawCols, kRows = kAvx2RawRows;
  static constexpr PackBlockFn kPack = nullptr;
  static constexpr BlockFn kBlock = Avx2RawBlock;
  static constexpr bool kOffsetLevels = false;
};

struct Avx2MaskTier {
  using Elem = uint8_t;
  using Weight = int8_t;
  static constexpr int kGroup = 4, kBlockCols = kAvx2MaskCols, kRows = kAvx2MaskRows;
  static constexpr PackBlockFn kPack = nullptr;
  static constexpr BlockFn kBlock = Avx2MaskBlock;
  static constexpr bool kOffsetLevels = true;
};

struct Avx2ByteTier {
  using Elem = uint8_t;
  using Weight = int8_t;
  static constexpr int kGroup = 4, kBlockCols = kAvx2ByteCols, kRows = kAvx2ByteRows;
  static constexpr PackBlockFn kPack = Avx2BytePack;
  static constexpr BlockFn kBlock = Avx2ByteBlock;
  static constexpr bool kOffsetLevels = true;
};

// Avx2ByteTier's products on rows read where they lie, for a kernel row's run of at most 4 bytes (kw * c <= 4:
// an MNIST-style first layer): each kernel row is one quad of the image, read with the byte after it, whose
// weight is 0 (the weights packed run-padded, KernelBlock::run), so a receptive field in the image is kh quads one
// image row apart; only fields that are not all inside it are gathered (ImageConv::QuadRows).
struct Avx2QuadTier {
  using Elem = uint8_t;
  using Weight = int8_t;
  static constexpr int kGroup = 4, kBlockCols = kAvx2ByteCols, kRows = kAvx2ByteRows;
  static constexpr PackBlockFn kPack = Avx2BytePack;
  static constexpr BlockFn kBlock = Avx2QuadBlock;
  static constexpr bool kOffsetLevels = true;
  static constexpr bool kDirectQuads = true;
};

struct VnniTier {
  using Elem = uint8_t;
  using Weight = int8_t;
  static constexpr int kGroup = 4, kBlockCols = kVnniCols, kRows = kVnniRows;
  static constexpr PackBlockFn kPack = VnniPack;
  static constexpr BlockFn kBlock = VnniBlock;
  static constexpr bool kOffsetLevels = true;
};

struct VnniRawTier {
  using Elem = int8_t;
  using Weight = int8_t;
  static constexpr int kGroup = 4, kBlockCols = kVnniRawCols, kRows = kVnniRawRows;
  static constexpr PackBlockFn kPack = nullptr;
  static constexpr BlockFn kBlock = VnniRawBlock;
  static constexpr bool kOffsetLevels = false;
};

struct VnniMaskTier {
  using Elem = int8_t;
  using Weight = int8_t;
  static constexpr int kGroup = 4, kBlockCols = kMaskCols, kRows = kMaskRows;
  static constexpr PackBlockFn kPack = nullptr;
  static constexpr BlockFn kBlock = VnniMaskBlock;
  static constexpr bool kOffsetLevels = false;
};
#endif

#ifdef JAXBNN_AMX
struct AmxTier {
  using Elem = uint8_t;
  using Weight = int8_t;
  static constexpr int kGroup = kAmxDepth, kBlockCols = kVnniCols, kRows = kAmxRows;
  static constexpr PackBlockFn kPack = VnniPack;
  static constexpr BlockFn kBlock = AmxBlock;
  static constexpr bool kOffsetLevels = true;
};
#endif

// Whether a tier reads its rows' run-padded quads where they lie: `static constexpr bool kDirectQuads = true`.
template <class Tier, class = void>
struct DirectQuads : std::false_type {};
template <class Tier>
struct DirectQuads<Tier, std::void_t<decltype(Tier::kDirectQuads)>> : std::bool_constant<Tier::kDirectQuads> {};

template <class Tier>
constexpr typename Tier::Elem Level(int8_t level) {
  if constexpr (Tier::kOffsetLevels) {
    return static_cast<uint8_t>(level) ^ 0x80u;
  } else {
    return level;
  }
}

// Per-call data, reused across calls by the calling thread (never shrinks, so no re-initialization).
struct CallScratch {
  std::vector<uint8_t> weights;  // packed, bytes of Tier::Weight
  std::vector<int32_t> bias;
  std::vector<int32_t> bound;
  std::vector<uint32_t> flip;
};

// Per-thread task data.
struct TaskScratch {
  std::vector<uint8_t> patches;  // bytes of Tier::Elem
  std::vector<const uint8_t*> quads;  // a DirectQuads tier's rows (BlockJob)
  std::vector<int64_t> quad_stride;
  std::vector<int32_t> tile;
  std::vector<uint8_t> weights;  // a task's own packed columns, bytes of Tier::Weight
  std::vector<int32_t> bias;
};

CallScratch& ThreadCallScratch() {
  thread_local CallScratch scratch;
  return scratch;
}

TaskScratch& ThreadTaskScratch() {
  thread_local TaskScratch scratch;
  return scratch;
}

template <class Tier>
class ImageConv {
 public:
  using Elem = typename Tier::Elem;
  using Weight = typename Tier::Weight;

  // levels: the operand's bytes, int8 levels or uint8 pixels (p.pixels)
  ImageConv(const ImageConv2dProblem& p, const int8_t* levels, const int8_t* kernel, const ImageKernelMasks& masks)
      : p_(p),
        levels_(levels),
        to_level_(static_cast<int8_t>(p.pixels ? 0x80 : 0)),
        kernel_(kernel),
        masks_(masks),
        levels_size_(p.batch * p.height * p.width * p.c),
        k_(p.kh * p.kw * p.c),
        run_(kDirectQuads ? p.kw * p.c : 0),
        k_padded_(kDirectQuads ? p.kh * 4 : RoundUp(k_, Tier::kGroup)),
        n_padded_(RoundUp(p.n, kWordBits)),
        window_(p.pool_h * p.pool_w),
        blocks_(CeilDiv(n_padded_, Tier::kBlockCols)) {}

  void Run(const int32_t* threshold, const uint8_t* flip, const ImageOutputs& out, ffi::ThreadPool* pool) {
    const int64_t outputs = p_.batch * p_.out_h * p_.out_w;
    if (outputs == 0) return;
    const int64_t threads = PoolThreads(pool);
    CallScratch& call = ThreadCallScratch();
    const ImageEpilogue epilogue = MakeEpilogue(threshold, flip, out, call);

    // Pooled outputs per task: their gathered rows fit kPatchBytes. With threads, enough tasks to balance:
    // the column blocks are split first (a dense layer at a small batch has few outputs, and splitting them
    // would read the weights once per task), then the outputs.
    const int64_t row_bytes = window_ * k_padded_ * static_cast<int64_t>(sizeof(Elem));
    const bool parallel =
        threads > 1 && outputs * window_ + kPackCost >= CeilDiv(kMinParallelMacs, k_padded_ * n_padded_);
    int64_t rows = RowsPerTask(std::clamp<int64_t>(kPatchBytes / row_bytes, 1, kMaxTaskRows));
    int64_t row_tasks = CeilDiv(outputs, rows), column_tasks = 1;
    if (parallel) {
      const int64_t wanted = kTasksPerThread * threads;
      column_tasks = std::min(blocks_, CeilDiv(wanted, row_tasks));
      if (row_tasks * column_tasks < wanted) {
        rows = RowsPerTask(CeilDiv(outputs, CeilDiv(wanted, column_tasks)));
        row_tasks = CeilDiv(outputs, rows);
      }
    }
    // Whole blocks per column task; rounding them up can leave fewer tasks with columns than asked for.
    const int64_t blocks_per_task = CeilDiv(blocks_, column_tasks);
    column_tasks = CeilDiv(blocks_, blocks_per_task);
    // One task per column range (a dense layer at a small batch): each packs its own columns, so that the
    // weights are read once. Else they are packed once for all tasks (unless the tier reads them as they are).
    const Weight* weights = nullptr;
    const int32_t* bias = nullptr;
    if (kPacked && row_tasks > 1) {
      auto* packed = reinterpret_cast<Weight*>(GrowAligned(call.weights, n_padded_ * k_padded_ * sizeof(Weight)));
      int32_t* packed_bias = Grow(call.bias, n_padded_);
      ParallelFor(pool, CeilDiv(blocks_, kPackBlocks), threads > 1 && n_padded_ * k_padded_ >= kMinParallelPack,
                  [&](int64_t task) {
                    const int64_t first = task * kPackBlocks;
                    Pack(first, std::min(blocks_, first + kPackBlocks), packed + BlockBegin(first) * k_padded_,
                         packed_bias + BlockBegin(first));
                  });
      weights = packed;
      bias = packed_bias;
    }
    ParallelFor(pool, row_tasks * column_tasks, parallel, [&](int64_t task) {
      const int64_t first = (task % row_tasks) * rows;
      const int64_t first_block = (task / row_tasks) * blocks_per_task;
      RunTask(first, std::min(rows, outputs - first), first_block,
              std::min(blocks_, first_block + blocks_per_task), weights, bias, epilogue);
    });
  }

 private:
  // Whole register blocks, where there is more than one.
  static int64_t RowsPerTask(int64_t rows) { return rows > Tier::kRows ? RoundUp(rows, Tier::kRows) : rows; }

  int64_t BlockBegin(int64_t block) const { return block * Tier::kBlockCols; }
  int64_t BlockCols(int64_t block) const {
    return std::min<int64_t>(Tier::kBlockCols, n_padded_ - BlockBegin(block));
  }

  static constexpr bool kPacked = Tier::kPack != nullptr;
  static constexpr bool kDirectQuads = DirectQuads<Tier>::value;

  // Blocks [first_block, end_block) of the weights into `weights` (KernelBlock) and, where the levels are
  // offset, their accumulators' start into `bias`.
  void Pack(int64_t first_block, int64_t end_block, Weight* weights, int32_t* bias) const {
    if constexpr (kPacked) {
      const int64_t begin = BlockBegin(first_block), end = std::min(n_padded_, BlockBegin(end_block));
      Tier::kPack(KernelBlock{kernel_, k_, p_.n, begin, end - begin, k_padded_, run_}, weights, bias);
    }
  }

  ImageEpilogue MakeEpilogue(const int32_t* threshold, const uint8_t* flip, const ImageOutputs& out,
                             CallScratch& call) const {
    const int64_t words = n_padded_ / kWordBits;
    ImageEpilogue epi{p_.planes, p_.shift, nullptr, nullptr, p_.n, n_padded_, words, out.stream, p_.narrow, out.bits};
    if (p_.planes == 0) return epi;
    int32_t* bound = Grow(call.bound, p_.planes * n_padded_);
    uint32_t* f = Grow(call.flip, p_.planes * words);
    constexpr int32_t kMin = std::numeric_limits<int32_t>::min(), kMax = std::numeric_limits<int32_t>::max();
    // Vectorized loops (the flags 8 a step): a call at batch 1 spends about as long here as in its products.
    for (int64_t plane = 0; plane < p_.planes; ++plane) {
      const int32_t* t = threshold + plane * p_.n;
      const uint8_t* fl = flip + plane * p_.n;
      int32_t* b = bound + plane * n_padded_;
      for (int64_t c = 0; c < p_.n; ++c) b[c] = fl[c] != 0 || t[c] == kMin ? t[c] : t[c] - 1;
      std::fill(b + p_.n, b + n_padded_, kMax);
      for (int64_t word = 0; word < words; ++word) {
        const int64_t begin = word * kWordBits, end = std::min(p_.n, begin + kWordBits);
        uint32_t bits = 0;
        int64_t c = begin;
        // 8 flags a step: each byte's bits ORed into its bit 0, then the eight gathered into a byte by a multiply
        for (; c + 8 <= end; c += 8) {
          uint64_t v;
          std::memcpy(&v, fl + c, sizeof(v));
          v |= v >> 4;
          v |= v >> 2;
          v |= v >> 1;
          bits |= static_cast<uint32_t>(((v & 0x0101010101010101u) * 0x0102040810204080u) >> 56) << (c - begin);
        }
        for (; c < end; ++c) bits |= static_cast<uint32_t>(fl[c] != 0) << (c - begin);
        f[plane * words + word] = bits;
      }
    }
    epi.bound = bound;
    epi.flip = f;
    return epi;
  }

  // Outputs [first, first + count) x column blocks [first_block, end_block); `weights` and `bias` are all the
  // packed weights, or null when the task packs its own.
  void RunTask(int64_t first, int64_t count, int64_t first_block, int64_t end_block, const Weight* weights,
               const int32_t* bias, const ImageEpilogue& epilogue) const {
    TaskScratch& scratch = ThreadTaskScratch();
    int64_t base = 0;  // the first column of `weights` and `bias`
    if (kPacked && weights == nullptr) {
      base = BlockBegin(first_block);
      const int64_t cols = std::min(n_padded_, BlockBegin(end_block)) - base;
      auto* own = reinterpret_cast<Weight*>(GrowAligned(scratch.weights, cols * k_padded_ * sizeof(Weight)));
      int32_t* own_bias = Grow(scratch.bias, cols);
      Pack(first_block, end_block, own, own_bias);
      weights = own;
      bias = own_bias;
    }
    auto* patches =
        reinterpret_cast<Elem*>(Grow(scratch.patches, ((count * window_ + Tier::kRows) * k_padded_ + kChunk) * sizeof(Elem)));
    const uint8_t** quads = nullptr;
    int64_t* quad_stride = nullptr;
    if constexpr (kDirectQuads) {
      quads = Grow(scratch.quads, count * window_);
      quad_stride = Grow(scratch.quad_stride, count * window_);
      QuadRows(first, count, quads, quad_stride, patches);
    } else {
      Gather(first, count, patches);
    }
    // XORed into a quad read where it lies: stored bytes to offset levels (pixels are their offset levels)
    const uint32_t to_offset = static_cast<uint8_t>(to_level_ ^ 0x80) * 0x01010101u;
    int32_t* tile = Grow(scratch.tile, Tier::kRows * kMaxBlockCols);
    for (int64_t block = first_block; block < end_block; ++block) {
      const int64_t col = BlockBegin(block);
      const void* block_weights = kPacked ? static_cast<const void*>(weights + (col - base) * k_padded_)
                                          : static_cast<const void*>(kernel_ + col);
      const BlockJob job{patches, k_, k_padded_, count, window_, quads, quad_stride, to_offset, block_weights, col,
                         BlockCols(block), kPacked && Tier::kOffsetLevels ? bias + (col - base) : nullptr, first, tile,
                         masks_};
      Tier::kBlock(job, epilogue);
    }
  }

  // The rows of outputs [first, first + count): window position w of output r at row w * count + r.
  void Gather(int64_t first, int64_t count, Elem* patches) const {
    switch (CeilDiv(p_.kw * p_.c, kChunk)) {
      case 1: return GatherRows<1>(first, count, patches);
      case 2: return GatherRows<2>(first, count, patches);
      case 3: return GatherRows<3>(first, count, patches);
      default: return GatherRows<0>(first, count, patches);
    }
  }

  // Rows are written in order, each overwriting what the copies of the one before wrote past its end; one
  // output row of the image at a time. kChunks: the chunks of a kernel row, or 0 for any number. The
  // problem's fields are read into locals first: the rows' stores are of byte types (the VNNI tiers'), which
  // may alias any member, so the compiler would load each field again after every store.
  template <int kChunks>
  void GatherRows(int64_t first, int64_t count, Elem* patches) const {
    const int64_t kh = p_.kh, kw = p_.kw, c = p_.c, width = p_.width, height = p_.height;
    const int64_t out_h = p_.out_h, out_w = p_.out_w, pool_h = p_.pool_h, pool_w = p_.pool_w;
    const int64_t stride_h = p_.stride_h, stride_w = p_.stride_w, pad_top = p_.pad_top, pad_left = p_.pad_left;
    const int64_t k_padded = k_padded_, tail = k_padded_ - k_, levels_size = levels_size_;
    const int8_t* const levels = levels_;
    const int8_t to_level = to_level_;
    const int64_t run = kw * c, image_row = width * c;
    const int64_t reach = (kh - 1) * image_row + RoundUp(run, kChunk);  // of the reads of a receptive field
    const Elem pad = Level<Tier>(0);
    Elem* dst = patches;
    for (int64_t wy = 0; wy < pool_h; ++wy) {
      for (int64_t wx = 0; wx < pool_w; ++wx) {
        for (int64_t o = first; o < first + count;) {
          const int64_t b = o / (out_h * out_w), oy = o / out_w % out_h, ox0 = o % out_w;
          const int64_t end = std::min(first + count, o + out_w - ox0);
          const int64_t y0 = (oy * pool_h + wy) * stride_h - pad_top;
          const bool rows_inside = y0 >= 0 && y0 + kh <= height;
          for (int64_t ox = ox0; o < end; ++o, ++ox, dst += k_padded) {
            const int64_t x0 = (ox * pool_w + wx) * stride_w - pad_left;
            const int64_t offset = ((b * height + y0) * width + x0) * c;
            if (!rows_inside || x0 < 0 || x0 + kw > width || offset + reach > levels_size) {
              GatherBorderRow(b, y0, x0, dst);
              continue;
            }
            // Inside the image (most rows): kh runs of whole chunks, a few vector moves each.
            const int8_t* src = levels + offset;
            Elem* row = dst;
            for (int64_t dy = 0; dy < kh; ++dy, src += image_row, row += run) {
              if constexpr (kChunks > 0) {
                for (int i = 0; i < kChunks; ++i) CopyChunk(src + i * kChunk, row + i * kChunk, to_level);
              } else {
                for (int64_t i = 0; i < run; i += kChunk) CopyChunk(src + i, row + i, to_level);
              }
            }
            for (int64_t i = 0; i < tail; ++i) row[i] = pad;
          }
        }
      }
    }
  }

  // A DirectQuads tier's rows of outputs [first, first + count), in Gather's order: each row's first quad and the
  // bytes from one quad to the next, in the image where every quad of the field is inside it (and readable: its
  // last quad reads a byte past the field's last run), else gathered into `border` (its kh quads side by side,
  // as stored bytes: to_level_, the byte of level 0, where out of frame). As GatherRows, one output row of the
  // image at a time.
  void QuadRows(int64_t first, int64_t count, const uint8_t** quads, int64_t* quad_stride, uint8_t* border) const {
    const int64_t kh = p_.kh, kw = p_.kw, c = p_.c, width = p_.width, height = p_.height;
    const int64_t out_h = p_.out_h, out_w = p_.out_w, pool_h = p_.pool_h, pool_w = p_.pool_w;
    const int64_t stride_h = p_.stride_h, stride_w = p_.stride_w, pad_top = p_.pad_top, pad_left = p_.pad_left;
    const int64_t image_row = width * c, reach = (kh - 1) * image_row + 4, levels_size = levels_size_;
    const auto* stored = reinterpret_cast<const uint8_t*>(levels_);
    int64_t i = 0;
    for (int64_t wy = 0; wy < pool_h; ++wy) {
      for (int64_t wx = 0; wx < pool_w; ++wx) {
        for (int64_t o = first; o < first + count;) {
          const int64_t b = o / (out_h * out_w), oy = o / out_w % out_h, ox0 = o % out_w;
          const int64_t end = std::min(first + count, o + out_w - ox0);
          const int64_t y0 = (oy * pool_h + wy) * stride_h - pad_top;
          const bool rows_inside = y0 >= 0 && y0 + kh <= height;
          for (int64_t ox = ox0; o < end; ++o, ++ox, ++i) {
            const int64_t x0 = (ox * pool_w + wx) * stride_w - pad_left;
            const int64_t offset = ((b * height + y0) * width + x0) * c;
            if (rows_inside && x0 >= 0 && x0 + kw <= width && offset + reach <= levels_size) {
              quads[i] = stored + offset;
              quad_stride[i] = image_row;
              continue;
            }
            uint8_t* row = border + i * k_padded_;
            BorderQuads(b, y0, x0, row);
            quads[i] = row;
            quad_stride[i] = 4;
          }
        }
      }
    }
  }

  // The kh quads of the receptive field whose top-left tap is (y0, x0) of image b (QuadRows).
  void BorderQuads(int64_t b, int64_t y0, int64_t x0, uint8_t* row) const {
    const auto* stored = reinterpret_cast<const uint8_t*>(levels_);
    const auto level_zero = static_cast<uint8_t>(to_level_);
    for (int64_t dy = 0; dy < p_.kh; ++dy) {
      const int64_t iy = y0 + dy;
      for (int64_t e = 0; e < 4; ++e) {
        const int64_t ix = x0 + e / p_.c;
        const bool in_frame = e < run_ && iy >= 0 && iy < p_.height && ix >= 0 && ix < p_.width;
        row[dy * 4 + e] = in_frame ? stored[((b * p_.height + iy) * p_.width + ix) * p_.c + e % p_.c] : level_zero;
      }
    }
  }

  // The level of a stored byte: itself, or a pixel p's p XOR 0x80 (p - 128).
  int8_t LevelOf(int8_t stored) const { return static_cast<int8_t>(stored ^ to_level_); }

  // kChunk stored bytes as kChunk elements, each XORed with to_level (to_level_; through locals: no aliasing
  // for the compiler to fear).
  static void CopyChunk(const int8_t* src, Elem* dst, int8_t to_level) {
    int8_t in[kChunk];
    Elem out[kChunk];
    std::memcpy(in, src, sizeof(in));
    for (int64_t j = 0; j < kChunk; ++j) out[j] = Level<Tier>(static_cast<int8_t>(in[j] ^ to_level));
    std::memcpy(dst, out, sizeof(out));
  }

  // The receptive field whose top-left tap is (y0, x0) of image b, zero past k; may write up to kChunk
  // elements past the row.
  void GatherBorderRow(int64_t b, int64_t y0, int64_t x0, Elem* dst) const {
    const int64_t run = p_.kw * p_.c;
    const Elem pad = Level<Tier>(0);
    // Taps left of the image, in it, right of it (the image may be narrower than the kernel).
    const int64_t left = std::clamp<int64_t>(-x0, 0, p_.kw);
    const int64_t right = std::clamp<int64_t>(x0 + p_.kw - p_.width, 0, p_.kw - left);
    const int64_t inside = (p_.kw - left - right) * p_.c;
    for (int64_t dy = 0; dy < p_.kh; ++dy, dst += run) {
      const int64_t iy = y0 + dy;
      if (iy < 0 || iy >= p_.height) {
        std::fill(dst, dst + run, pad);
        continue;
      }
      Elem* mid = std::fill_n(dst, left * p_.c, pad);
      if (inside > 0) {
        const int64_t offset = ((b * p_.height + iy) * p_.width + x0 + left) * p_.c;
        if (offset + RoundUp(inside, kChunk) <= levels_size_) {
          // Whole chunks: a few vector moves for the short runs of an image's first layer.
          for (int64_t i = 0; i < inside; i += kChunk) CopyChunk(levels_ + offset + i, mid + i, to_level_);
        } else {
          for (int64_t i = 0; i < inside; ++i) mid[i] = Level<Tier>(LevelOf(levels_[offset + i]));
        }
      }
      std::fill(mid + inside, dst + run, pad);
    }
    for (int64_t i = 0; i < k_padded_ - k_; ++i) dst[i] = pad;
  }

  const ImageConv2dProblem& p_;
  const int8_t* levels_;
  const int8_t to_level_;  // XORed into each stored byte: 0x80 for pixels, else 0
  const int8_t* kernel_;
  const ImageKernelMasks masks_;
  const int64_t levels_size_, k_, run_, k_padded_, n_padded_, window_, blocks_;
};

template <class Tier>
void RunTier(const ImageConv2dProblem& problem, const int8_t* levels, const int8_t* kernel,
             const ImageKernelMasks& masks, const int32_t* threshold, const uint8_t* flip, const ImageOutputs& out,
             ffi::ThreadPool* pool) {
  ImageConv<Tier>(problem, levels, kernel, masks).Run(threshold, flip, out, pool);
}

#ifdef JAXBNN_X86
// The AVX2 tiers: the kernel read as it is for a call of few gathered rows; packed beyond, as bytes where its
// values are -1, 0 and +1, else as int16 pairs.
void RunAvx2(const ImageConv2dProblem& problem, const int8_t* levels, const int8_t* kernel,
             const ImageKernelMasks& masks, const int32_t* threshold, const uint8_t* flip, const ImageOutputs& out,
             ffi::ThreadPool* pool) {
  const int64_t rows = problem.batch * problem.out_h * problem.out_w * problem.pool_h * problem.pool_w;
  const int64_t k = problem.kh * problem.kw * problem.c;
  if (masks.plus != nullptr && rows <= std::min<int64_t>(k, kAvx2MaskMaxRows[masks.minus != nullptr])) {
    return RunTier<Avx2MaskTier>(problem, levels, kernel, masks, threshold, flip, out, pool);
  }
  if (rows <= std::min<int64_t>(k, kAvx2RawMaxRows)) {
    return RunTier<Avx2RawTier>(problem, levels, kernel, masks, threshold, flip, out, pool);
  }
  if (KernelWithinUnit(kernel, k * problem.n)) {
    if (problem.kw * problem.c <= 4) {
      return RunTier<Avx2QuadTier>(problem, levels, kernel, masks, threshold, flip, out, pool);
    }
    return RunTier<Avx2ByteTier>(problem, levels, kernel, masks, threshold, flip, out, pool);
  }
  RunTier<Avx2Tier>(problem, levels, kernel, masks, threshold, flip, out, pool);
}
#endif

}  // namespace

bool AmxUsable() {
#ifdef JAXBNN_AMX
  static const bool usable = DetectAmx();
  return usable;
#else
  return false;
#endif
}

bool FirstLayerUsesAmx() {
#ifdef JAXBNN_AMX
  return AmxEnabledSlot().load(std::memory_order_relaxed);
#else
  return false;
#endif
}

bool SetFirstLayerAmx(bool enabled) {
  if (enabled && !AmxUsable()) return false;
#ifdef JAXBNN_AMX
  AmxEnabledSlot().store(enabled, std::memory_order_relaxed);
#endif
  return true;
}

void RunImageConv2d(const ImageConv2dProblem& problem, const int8_t* levels, const int8_t* kernel,
                    const ImageKernelMasks& masks, const int32_t* threshold, const uint8_t* flip,
                    const ImageOutputs& out, ffi::ThreadPool* pool) {
#ifdef JAXBNN_X86
  switch (ActiveIsa()) {
    case Isa::kAvx512:
      // VPOPCNTDQ does not imply VNNI or BW (Knights Mill has it without either).
      if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni")) {
        const int64_t rows = problem.batch * problem.out_h * problem.out_w * problem.pool_h * problem.pool_w;
#ifdef JAXBNN_AMX
        if (rows >= kAmxMinRows && problem.kh * problem.kw * problem.c >= kAmxMinReduction &&
            AmxEnabledSlot().load(std::memory_order_relaxed)) {
          return RunTier<AmxTier>(problem, levels, kernel, masks, threshold, flip, out, pool);
        }
#endif
        // Packing the kernel is one pass over it, and reading it as it is regroups it again for every
        // register block of rows: packing pays where the gathered rows outnumber the reduction (a 3x3 conv
        // over 28 x 28 packs 1.5x faster) or pass kVnniRawMaxRows (a dense 784 x 1024 layer on a Zen 5 VM:
        // equal at 64 rows, packed 20-30% faster from 128; docs/design/decisions.md).
        if (rows <= std::min<int64_t>(problem.kh * problem.kw * problem.c, kVnniRawMaxRows)) {
          if (masks.plus != nullptr) {
            return RunTier<VnniMaskTier>(problem, levels, kernel, masks, threshold, flip, out, pool);
          }
          return RunTier<VnniRawTier>(problem, levels, kernel, masks, threshold, flip, out, pool);
        }
        return RunTier<VnniTier>(problem, levels, kernel, masks, threshold, flip, out, pool);
      }
      return RunAvx2(problem, levels, kernel, masks, threshold, flip, out, pool);
    case Isa::kAvx2: return RunAvx2(problem, levels, kernel, masks, threshold, flip, out, pool);
    default: break;
  }
#endif
  RunTier<PortableTier>(problem, levels, kernel, masks, threshold, flip, out, pool);
}

}  // namespace jaxbnn::cpu
