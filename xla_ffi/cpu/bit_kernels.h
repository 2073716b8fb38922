// CPU bmm and direct bconv2d on packed bits (docs/formats.md), with fused epilogues and max-pool.
#ifndef JAXBNN_XLA_FFI_CPU_BIT_KERNELS_H_
#define JAXBNN_XLA_FFI_CPU_BIT_KERNELS_H_

#include <cstdint>
#include <vector>

#include "common/checks.h"
#include "cpu/epilogue.h"
#include "xla/ffi/api/ffi.h"

namespace jaxbnn::cpu {

// Output: int32 or float32 (rows, n), or packed uint32 (rows, ceil(n/32)) for the threshold epilogue.
void RunBmm(const BmmProblem& problem, const uint32_t* a, const uint32_t* b_tiles, const EpilogueData& epilogue,
            void* out, ffi::ThreadPool* pool);

// One layer of a chain (RunBmmChain): its product as RunBmm takes it (m the chain's rows), its FSB weights and
// its epilogue: kThreshold (one plane) for every layer but the last, which may be kAffine.
struct ChainLayer {
  BmmProblem problem;
  const uint32_t* b_tiles;
  EpilogueData epilogue;
};

// RunBmm layer after layer, each layer's packed bits the next one's activations, in one call: the layers run
// as steps of one parallel loop (one hop to the pool for the whole chain, where a call a layer took one each),
// the bits between them in buffers of at most kChainRoundBytes a layer, the rows in rounds where they need more.
// Output: the last layer's, as RunBmm writes it.
inline constexpr int64_t kChainRoundBytes = 1 << 20;
void RunBmmChain(const std::vector<ChainLayer>& layers, const uint32_t* a, void* out, ffi::ThreadPool* pool);

// w_tap_popcount: int32 (kh * kw, o), the "zero" padding correction (docs/formats.md).
void RunBconv2d(const Bconv2dProblem& problem, const uint32_t* x, const uint32_t* w_tiles,
                const int32_t* w_tap_popcount, const EpilogueData& epilogue, void* out, ffi::ThreadPool* pool);

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_BIT_KERNELS_H_
