// The innermost CPU kernels of ternary and mixed products (TAB's TNN, TBN, BTN): dot products between a
// packed panel of reduction rows and a run of 8-column weight tile rows, from popcounts of gated XORs, in
// the instruction-set tiers of popcount_kernels.h (ActiveIsa).
//
// A ternary value t is the pair of bits a = [t >= 0], b = [t > 0] (t = (a' + b') / 2 for the ±1 values a',
// b' of the bits, docs/formats.md); it is non-zero where a == b, z = NOT (a XOR b), and then its sign bit is
// a (= b, 1 for +1). Per 64-bit word of a reduction row, with padding bits 0 in every z:
//   TNN  x . w = popc(z_x & z_w) - 2 popc(z_x & z_w & (a_x ^ b_w))   (TAB's gated XOR: 1 XOR, 2 AND, 2 popc)
//   TBN  x . w = popc(z_x) - 2 popc((a_x ^ w) & z_x)                 (w: the weight's bit; 1 XOR, 1 AND, 1 popc)
//   BTN  x . w = popc(z_w) - 2 popc((x ^ b_w) & z_w)                 (x: the activation's bit; likewise)
// popc(z_x) is a per-row term (counted while the panel is packed), popc(z_w) a per-column one (from the
// weights' plane popcounts). The panels hold (a_x, z_x) for ternary activations; the kernels form b_w and z_w
// from the weights' planes once per tile chunk.
#ifndef JAXBNN_XLA_FFI_CPU_TERNARY_DOTS_H_
#define JAXBNN_XLA_FFI_CPU_TERNARY_DOTS_H_

#include <cstdint>

#include "cpu/popcount_kernels.h"

namespace jaxbnn::cpu {

enum class Mix { kTnn, kTbn, kBtn };

// Bit planes of a panel row: (a_x, z_x) for ternary activations (TNN, TBN), the bits for BTN.
constexpr int PanelPlanes(Mix mix) { return mix == Mix::kBtn ? 1 : 2; }
// Whether the weights are ternary: (nonneg, pos) planes, from which the kernels form b_w and z_w.
constexpr bool TernaryWeights(Mix mix) { return mix != Mix::kTbn; }

// Reduction rows packed as PackedPanel's groups (popcount_kernels.h) with PanelPlanes(mix) planes side by
// side in every chunk: word w (0..3) of plane p of chunk j of row r is
//   data[(((r / 8 * chunks + j) * 8 + r % 8) * planes + p) * 4 + w].
struct MixedPanel {
  const uint32_t* data;
  int64_t rows;
  int64_t chunks;
  const int32_t* row_term;  // per row: TBN popc(z_x); 0 otherwise
};

// The weights of a run of tile rows in kernel tiles (tile rows of (chunks, 8, 4) words): ternary weights as
// their nonneg and pos planes, binary ones as their bits in `nonneg` (pos null).
struct MixedWeights {
  const uint32_t* nonneg;
  const uint32_t* pos;
  int64_t chunks;
  const uint32_t* mask;      // chunks * 4 words: the real bits of a reduction row (z_w = ~(nonneg ^ pos) & mask)
  const int32_t* col_term;   // per column of the run: BTN popc(z_w); 0 otherwise
};

// For every panel row r < rows, tile row t < tiles and row i < 8 of that tile row, the dot product above:
//   dots[r * stride + t * 8 + i] = row_term[r] + col_term[t * 8 + i] + (TNN: sum of popc(z_x & z_w))
//                                  - 2 * (sum of the gated popcounts)
using MixedDotsFn = void (*)(const MixedPanel& panel, const MixedWeights& weights, int64_t tiles, int32_t* dots,
                             int64_t stride);

MixedDotsFn MixedDotsFor(Mix mix, Isa isa);

// Lane kernels of the mixed products, as the binary ones (popcount_kernels.h, LaneDotsFn): each word of a
// reduction row is split into its nibbles once and broadcast against the nibbles of the weights of several tile
// rows, so that a byte's counts are table lookups of gated XORed nibbles.
//   Weights: a tile row as (k_words, LaneWeightPlanes(mix), 2, 8) words (MixedLaneTilesFn):
//   word k of its 8 columns in each plane (TNN, BTN: z_w, then b_w; TBN: the bits) as its low nibbles, then its
//   high nibbles; every bit of z_w outside the reduction 0.
//   Rows: LaneRows whose offsets hold PanelPlanes(mix) * k_words entries: word k of a_x (BTN: the bits) at
//   base[offsets[k]], of z_x at base[offsets[k_words + k]]; k_valid holds each row's term (TBN popc(z_x), else 0),
//   correction BTN's "zero" padding terms.
// For every output row o < rows / window, tile row t < tiles and row i < 8, with c = col_begin + t * 8 + i:
//   dots[o * stride + t * 8 + i] = max over r in [o * window, (o + 1) * window) of
//       k_valid[r] + col_term[t * 8 + i] + (TNN: sum of popc(z_x & z_w)) - 2 * (sum of the gated popcounts)
//       + correction[r][c]
using MixedLaneDotsFn = void (*)(const LaneRows& rows, const uint32_t* lane_tiles, int64_t k_words,
                                 const int32_t* col_term, int64_t col_begin, int64_t tiles, int32_t* dots,
                                 int64_t stride);

// Weight planes of a lane tile row: z_w and b_w for ternary weights, the bits for binary ones.
constexpr int LaneWeightPlanes(Mix mix) { return TernaryWeights(mix) ? 2 : 1; }

// The weights of `tiles` tile rows of kernel tiles (MixedWeights) as a lane kernel reads them, into `lanes`.
using MixedLaneTilesFn = void (*)(const MixedWeights& weights, int64_t tiles, int64_t k_words, uint32_t* lanes);

struct MixedLaneTier {
  MixedLaneDotsFn dots;
  MixedLaneTilesFn tiles;
};

// Null functions where the tier has none (the AVX-512 kernels count whole 64-bit words with VPOPCNTQ).
MixedLaneTier MixedLaneTierFor(Mix mix, Isa isa);

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_TERNARY_DOTS_H_
