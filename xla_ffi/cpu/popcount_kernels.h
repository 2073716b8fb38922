// The innermost CPU kernel: popcounts of (x XOR w) AND mask between panel rows and one 8-row FSB tile row,
// in several instruction-set tiers chosen at run time, so one binary runs on any x86-64 (or other CPU).
#ifndef JAXBNN_XLA_FFI_CPU_POPCOUNT_KERNELS_H_
#define JAXBNN_XLA_FFI_CPU_POPCOUNT_KERNELS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace jaxbnn::cpu {

// Rows of 128-bit chunks (4 words each) to be reduced against weights in the default FSB tile.
struct PanelView {
  const uint32_t* data;  // rows x row_words
  const uint32_t* mask;  // rows x row_words, or a single row shared by all rows when mask_stride == 0
  int64_t row_words;     // chunks * 4
  int64_t mask_stride;   // row_words or 0
};

// For each of the first `rows` panel rows r and each tile row i in [0, 8):
//   popcounts[r * 8 + i] = sum over chunks j of popc((x[r, j] XOR w[i, j]) AND mask[r, j])
// where `tile_row` points at the (chunks, 8, 4) words of one row of default FSB tiles.
using TileRowPopcountFn = void (*)(const PanelView& panel, int rows, const uint32_t* tile_row,
                                   int64_t chunks, int32_t* popcounts);

enum class Isa { kGeneric, kPopcnt, kAvx2, kAvx512 };

const char* IsaName(Isa isa);
// Tiers this CPU can run, best first (kGeneric is always last).
std::vector<Isa> SupportedIsas();
// The tier used by the handlers: the best supported one unless a test forced another.
Isa ActiveIsa();
// Returns false (and changes nothing) when `name` is not a supported tier.
bool ForceIsa(const std::string& name);
TileRowPopcountFn TileRowPopcountFor(Isa isa);

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_POPCOUNT_KERNELS_H_
