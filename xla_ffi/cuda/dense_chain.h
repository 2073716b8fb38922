// A chain of small dense binary layers in one kernel (ops.bmm_chain): the weights of every layer resident in
// shared memory, each CTA taking blocks of 16 rows through every layer with the activations between layers kept in
// shared memory as packed bits. docs/ops.md states the contract.
#ifndef JAXBNN_XLA_FFI_CUDA_DENSE_CHAIN_H_
#define JAXBNN_XLA_FFI_CUDA_DENSE_CHAIN_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxbnn::cuda {

// The most layers a chain takes, the widest reduction and output of a layer in bits (a CTA's activations of 16
// rows stay in shared memory at that width), and the most shared memory a chain's CTA takes (DenseChainSmemBytes):
// what every GPU of the mma.sync engine (sm_80 and later) gives a CTA.
inline constexpr int kChainMaxLayers = 8;
inline constexpr int kChainMaxBits = 4096;
inline constexpr int kChainMaxSmemBytes = 99 * 1024;
inline constexpr int kChainRows = 16;

// The shared memory of a chain's CTA: two blocks of 16 rows of activations (kChainMaxBits + 128 bits each), their
// popcounts, then per layer its FSB weights (ceil(n / 8) x ceil(k / 128) tiles of 128 bytes), then per layer three
// int32 arrays of its columns' parameters, n rounded up to a word's 32. ops._chain_smem_bytes mirrors it.
__host__ __device__ constexpr int64_t DenseChainWeightBytes(int64_t k, int64_t n) {
  return (n + 7) / 8 * ((k + 127) / 128) * 128;
}
__host__ __device__ constexpr int64_t DenseChainSmemBytes(const int64_t* ks, const int64_t* ns, int layers) {
  int64_t bytes = 2 * kChainRows * (kChainMaxBits / 32 + 4) * 4 + kChainRows * 4;
  for (int l = 0; l < layers; ++l) bytes += DenseChainWeightBytes(ks[l], ns[l]) + 12 * ((ns[l] + 31) / 32 * 32);
  return bytes;
}

// Layer l: dot[r, c] = the ±1 dot product of activation row r (k bits) with weight row c (FSB tiles of
// ceil(n / 8) x ceil(k / 128) tiles, popc_b[c] its +1 count). Every layer but the last writes the next one's
// activations, bit c of row r: dot >= threshold[c] (dot <= threshold[c] where flip[c]). The last writes float32
// __fadd_rn(__fmul_rn(dot, scale[c]), bias[c]) (affine) or those bits, (m, ceil(n / 32)) words with padding bits 0.
struct DenseChainLayer {
  const uint32_t* w = nullptr;
  const int32_t* popc_b = nullptr;
  const int32_t* threshold = nullptr;
  const uint8_t* flip = nullptr;
  const float* scale = nullptr;
  const float* bias = nullptr;
  int k = 0, n = 0;
  int weights_at = 0, columns_at = 0;  // byte offsets of its weights and column parameters in shared memory
};

struct DenseChainProblem {
  const uint32_t* x = nullptr;  // (m, ceil(layer[0].k / 32)); bits past k are ignored
  void* out = nullptr;          // float32 (m, n) where affine, else uint32 (m, ceil(n / 32)); n: the last layer's
  int m = 0, layers = 0;
  bool affine = false;
  DenseChainLayer layer[kChainMaxLayers];
};

// Launches the chain on `stream` (nothing for m == 0); returns the launch error, if any. The handler has
// checked the shapes: 1 to kChainMaxLayers layers, each k and n within [1, kChainMaxBits], layer l's n the
// k of layer l + 1, DenseChainSmemBytes within kChainMaxSmemBytes.
cudaError_t LaunchDenseChain(DenseChainProblem problem, cudaStream_t stream);

}  // namespace jaxbnn::cuda

#endif  // JAXBNN_XLA_FFI_CUDA_DENSE_CHAIN_H_
