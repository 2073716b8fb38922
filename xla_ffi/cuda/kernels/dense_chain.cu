// The dense-chain kernel (DenseChainKernel): a chain of small dense binary layers (ResNet-14's 512-512-512-10
// tail) in one launch. Each CTA of 8 warps copies every layer's FSB weights and column parameters into shared
// memory once (cp.async, a group per layer), then takes blocks of 16 activation rows through every layer, the
// activations between layers kept in shared memory as packed bits. A layer is mma.sync m16n8k256 AND-popc: a warp
// takes whole 32-column output words (four n8 tiles), A from the block's rows, B from the weights (an FSB tile row
// of 4 words is a fragment's b0 or b1 for 8 columns), and the word's bits go to the next layer's rows (or the
// result) from a quad's shuffles. As separate launches the tail's layers were bound by their set-up and by
// fetching their code cold (docs/design/kernels.md); B read from global memory per fragment, the chain waited on
// L2 once per k256 step and was slower than the separate kernels (docs/design/decisions.md).
#include "cuda/dense_chain.h"

#include <cstdint>

namespace jaxbnn::cuda {
namespace {

constexpr int kRows = kChainRows, kWarps = 16, kThreads = 32 * kWarps;
static_assert(kWarps == kRows, "a warp counts the popcount of one row");
constexpr int kMaxWords = kChainMaxBits / 32;
// A row's words in shared memory: 4 mod 8, so that a fragment's reads (8 rows x 4 consecutive words) hit 32 banks.
constexpr int kRowStride = kMaxWords + 4;
static_assert(kMaxWords % 8 == 0 && kRowStride % 8 == 4, "whole k256 steps, conflict-free fragments");
constexpr int kRowsBytes = 2 * kRows * kRowStride * 4;
static_assert(kRowsBytes + kRows * 4 == DenseChainSmemBytes(nullptr, nullptr, 0), "the layout DenseChainSmemBytes counts");
// A column past n: no x = 4 popc(x AND w) - 2 popc(x) reaches it (|x| <= 4 kChainMaxBits), so its bit stays 0.
constexpr int kNeverBound = 1 << 30;

__device__ __forceinline__ void MmaAndPopc(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// A layer's column parameters in shared memory, three int32 arrays of n rounded up to 32 (DenseChainSmemBytes),
// in the form the epilogue compares with x = 4 popc(x AND w) - 2 popc(x), the dot product less k - 2 popc(w):
// a bit layer's bound (its bit is (x >= bound) XOR flip: dot >= t is x >= t - k + 2 popc(w), dot <= t the negation
// of x >= t + 1 - k + 2 popc(w); t clamped to [-k - 1, k + 1], which changes no bit) and its flip words (one a 32
// columns); an affine layer's offset k - 2 popc(w), scale and bias.
struct Columns {
  int* bound;  // or the offset
  int* second;  // flip words, or the scale's bits
  int* third;   // the bias's bits (affine)
};
__device__ __forceinline__ Columns ColumnsOf(uint8_t* smem, const DenseChainLayer& layer) {
  int* at = reinterpret_cast<int*>(smem + layer.columns_at);
  const int n32 = (layer.n + 31) / 32 * 32;
  return {at, at + n32, at + 2 * n32};
}

// Issues the copies of every layer's weights into shared memory (cp.async, one group).
__device__ __forceinline__ void CopyWeights(const DenseChainProblem& p, uint8_t* smem, int tid) {
  for (int l = 0; l < p.layers; ++l) {
    const DenseChainLayer& layer = p.layer[l];
    const int bytes = static_cast<int>(DenseChainWeightBytes(layer.k, layer.n));
    const char* w = reinterpret_cast<const char*>(layer.w);
    const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(smem + layer.weights_at));
    for (int offset = 16 * tid; offset < bytes; offset += 16 * kThreads) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to + offset), "l"(w + offset) : "memory");
    }
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// A column of the chain's columns, all layers' in turn, each layer's n rounded up to 32 (whole warps a word).
struct ChainColumn {
  int layer, col;  // layer == -1: past the last layer's
};
__device__ __forceinline__ ChainColumn ChainColumnOf(const DenseChainProblem& p, int j) {
  for (int l = 0; l < p.layers; ++l) {
    const int n32 = (p.layer[l].n + 31) / 32 * 32;
    if (j < n32) return {l, j};
    j -= n32;
  }
  return {-1, 0};
}

// Derives every layer's column parameters (Columns) in shared memory, whole warps over 32 consecutive columns (the
// flip words are ballots), past n to the last word's end. A thread's loads of kColumnTurns turns, whichever layers
// they fall in, are in flight together: per layer, the layers' loads came one memory latency after another.
constexpr int kColumnTurns = 4;
__device__ __forceinline__ void LoadColumns(const DenseChainProblem& p, uint8_t* smem, int tid) {
  const int lane = tid % 32;
  int total = 0;
  for (int l = 0; l < p.layers; ++l) total += (p.layer[l].n + 31) / 32 * 32;
  for (int base = tid - lane; base < total; base += kColumnTurns * kThreads) {
    ChainColumn at[kColumnTurns];
    int popc_b[kColumnTurns], first[kColumnTurns], second[kColumnTurns];
#pragma unroll
    for (int u = 0; u < kColumnTurns; ++u) {
      at[u] = ChainColumnOf(p, base + u * kThreads + lane);
      popc_b[u] = first[u] = second[u] = 0;
      if (at[u].layer < 0) continue;
      const DenseChainLayer& layer = p.layer[at[u].layer];
      if (at[u].col >= layer.n) continue;
      const bool affine = p.affine && at[u].layer == p.layers - 1;
      popc_b[u] = __ldg(layer.popc_b + at[u].col);
      first[u] = affine ? __float_as_int(__ldg(layer.scale + at[u].col)) : __ldg(layer.threshold + at[u].col);
      second[u] = affine ? __float_as_int(__ldg(layer.bias + at[u].col)) : __ldg(layer.flip + at[u].col) != 0;
    }
#pragma unroll
    for (int u = 0; u < kColumnTurns; ++u) {
      if (at[u].layer < 0) continue;  // the same for the whole warp: its 32 columns are one word of one layer
      const DenseChainLayer& layer = p.layer[at[u].layer];
      const Columns c = ColumnsOf(smem, layer);
      const int col = at[u].col;
      const bool real = col < layer.n;
      if (p.affine && at[u].layer == p.layers - 1) {
        c.bound[col] = layer.k - 2 * popc_b[u];
        c.second[col] = first[u];
        c.third[col] = second[u];
        continue;
      }
      const bool flip = real && second[u] != 0;
      const int threshold = min(max(first[u], -layer.k - 1), layer.k + 1);
      c.bound[col] = real ? threshold + (flip ? 1 : 0) - layer.k + 2 * popc_b[u] : kNeverBound;
      const uint32_t flips = __ballot_sync(0xffffffffu, flip);
      if (lane == 0) c.second[col / 32] = static_cast<int>(flips);
    }
  }
}

// Rows row0 .. row0 + 15 of x into `rows`, the bits past k cleared, zeros past them (to the last k256 step's end)
// and past m.
__device__ __forceinline__ void LoadInputRows(const DenseChainProblem& p, uint32_t (*rows)[kRowStride], long long row0,
                                              int tid) {
  const int k = p.layer[0].k, words = (k + 31) / 32, stored = (words + 7) / 8 * 8;
  const uint32_t last_mask = k % 32 == 0 ? ~0u : (1u << (k % 32)) - 1;
#pragma unroll 4
  for (int i = tid; i < kRows * stored; i += kThreads) {
    const int r = i / stored, word = i - r * stored;
    const uint32_t v = row0 + r < p.m && word < words ? __ldg(p.x + (row0 + r) * words + word) : 0u;
    rows[r][word] = word == words - 1 ? v & last_mask : v;
  }
}

// Layer l of the chain on the block's rows `in`: its bits into `next` (or the result, rows from row0).
__device__ __forceinline__ void RunLayer(const DenseChainProblem& p, uint8_t* smem, int l,
                                         const uint32_t (*in)[kRowStride], uint32_t (*next)[kRowStride], int* popc_a,
                                         long long row0, int tid) {
  const DenseChainLayer& layer = p.layer[l];
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int k_words = (layer.k + 31) / 32, k_tiles = (k_words + 3) / 4, steps = (k_words + 7) / 8;
  const int out_words = (layer.n + 31) / 32, row_tiles = (layer.n + 7) / 8;
  const bool last = l + 1 == p.layers;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(smem + layer.weights_at);
  const Columns columns = ColumnsOf(smem, layer);
  {  // popc(x) of row `warp`
    int sum = 0;
    for (int word = lane; word < k_words; word += 32) sum += __popc(in[warp][word]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) popc_a[warp] = sum;
  }
  if (!last) {  // the next layer's words past this layer's output, to its last k256 step's end: zeros
    const int pad = (out_words + 7) / 8 * 8 - out_words;
    if (tid < kRows * pad) next[tid / pad][out_words + tid % pad] = 0;
  }
  __syncthreads();
  const int v_lo = -2 * popc_a[g], v_hi = -2 * popc_a[g + 8];
  for (int word = warp; word < out_words; word += kWarps) {
    int acc[4][4] = {};
    for (int ks = 0; ks < steps; ++ks) {
      const uint32_t a[4] = {in[g][8 * ks + t], in[g + 8][8 * ks + t], in[g][8 * ks + 4 + t], in[g + 8][8 * ks + 4 + t]};
      const bool second_tile = 2 * ks + 1 < k_tiles;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int tile = 4 * word + q;
        uint32_t b0 = 0, b1 = 0;
        if (tile < row_tiles) {
          const uint32_t* at = w + (tile * k_tiles + 2 * ks) * 32 + 4 * g + t;
          b0 = at[0];
          if (second_tile) b1 = at[32];
        }
        MmaAndPopc(acc[q], a, b0, b1);
      }
    }
    // lane (g, t) holds rows g, g + 8 at columns 8 q + 2 t + e of the word
    if (last && p.affine) {
      float* out = static_cast<float*>(p.out);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int col = 32 * word + 8 * q + 2 * t;
        const int2 offset = *reinterpret_cast<const int2*>(columns.bound + col);
        const int2 scale = *reinterpret_cast<const int2*>(columns.second + col);
        const int2 bias = *reinterpret_cast<const int2*>(columns.third + col);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const long long row = row0 + g + 8 * h;
          const int v = h == 0 ? v_lo : v_hi;
          // no contraction into an FMA: the same two roundings as the other kernels and the reference
          const float y0 = __fadd_rn(__fmul_rn(static_cast<float>(4 * acc[q][2 * h] + v + offset.x),
                                               __int_as_float(scale.x)), __int_as_float(bias.x));
          const float y1 = __fadd_rn(__fmul_rn(static_cast<float>(4 * acc[q][2 * h + 1] + v + offset.y),
                                               __int_as_float(scale.y)), __int_as_float(bias.y));
          if (row < p.m && col < layer.n) out[row * layer.n + col] = y0;
          if (row < p.m && col + 1 < layer.n) out[row * layer.n + col + 1] = y1;
        }
      }
      continue;
    }
    uint32_t bits[2] = {0, 0};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int2 bound = *reinterpret_cast<const int2*>(columns.bound + 32 * word + 8 * q + 2 * t);
      const uint32_t at = 1u << (8 * q + 2 * t);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int v = h == 0 ? v_lo : v_hi;
        bits[h] |= (4 * acc[q][2 * h] + v >= bound.x ? at : 0u) | (4 * acc[q][2 * h + 1] + v >= bound.y ? 2 * at : 0u);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the quad's columns into one word a row
      bits[h] |= __shfl_xor_sync(0xffffffffu, bits[h], 1);
      bits[h] |= __shfl_xor_sync(0xffffffffu, bits[h], 2);
    }
    const uint32_t row_bits = (t == 0 ? bits[0] : bits[1]) ^ static_cast<uint32_t>(columns.second[word]);
    if (!last) {  // lane t < 2 stores row g + 8 t
      if (t < 2) next[g + 8 * t][word] = row_bits;
    } else if (t < 2 && row0 + g + 8 * t < p.m) {
      static_cast<uint32_t*>(p.out)[(row0 + g + 8 * t) * out_words + word] = row_bits;
    }
  }
  __syncthreads();  // the next layer reads this one's rows; this one's input becomes its output
}

__global__ void __launch_bounds__(kThreads) DenseChainKernel(const __grid_constant__ DenseChainProblem p) {
  extern __shared__ __align__(16) uint8_t smem[];
  auto rows = reinterpret_cast<uint32_t(*)[kRows][kRowStride]>(smem);
  int* popc_a = reinterpret_cast<int*>(smem + kRowsBytes);
  const int tid = threadIdx.x;
  // The parameters do not come from the previous kernel: into L2 while it finishes.
  for (int l = 0; l < p.layers; ++l) {
    const DenseChainLayer& layer = p.layer[l];
    const bool affine = p.affine && l == p.layers - 1;
    const void* arrays[4] = {layer.w, layer.popc_b, affine ? static_cast<const void*>(layer.scale) : layer.threshold,
                             affine ? static_cast<const void*>(layer.bias) : layer.flip};
    const int bytes[4] = {static_cast<int>(DenseChainWeightBytes(layer.k, layer.n)), 4 * layer.n, 4 * layer.n,
                          (affine ? 4 : 1) * layer.n};
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      for (int offset = 128 * tid; offset < bytes[a]; offset += 128 * kThreads) {
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(static_cast<const char*>(arrays[a]) + offset));
      }
    }
  }
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  // the weights' copies, the first block's rows and the columns' loads all in flight together
  CopyWeights(p, smem, tid);
  const int blocks = (p.m + kRows - 1) / kRows;
  if (blockIdx.x < blocks) LoadInputRows(p, rows[0], static_cast<long long>(blockIdx.x) * kRows, tid);
  LoadColumns(p, smem, tid);
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  for (int block = blockIdx.x; block < blocks; block += gridDim.x) {
    const long long row0 = static_cast<long long>(block) * kRows;
    if (block != blockIdx.x) LoadInputRows(p, rows[0], row0, tid);
    __syncthreads();  // the rows, and (first block) every thread's weights and columns
    for (int l = 0; l < p.layers; ++l) RunLayer(p, smem, l, rows[l & 1], rows[(l + 1) & 1], popc_a, row0, tid);
  }
}

}  // namespace

cudaError_t LaunchDenseChain(DenseChainProblem p, cudaStream_t stream) {
  if (p.m == 0) return cudaSuccess;
  int64_t ks[kChainMaxLayers], ns[kChainMaxLayers];
  int at = kRowsBytes + kRows * 4;
  for (int l = 0; l < p.layers; ++l) {
    ks[l] = p.layer[l].k;
    ns[l] = p.layer[l].n;
    p.layer[l].weights_at = at;
    at += static_cast<int>(DenseChainWeightBytes(ks[l], ns[l]));
  }
  for (int l = 0; l < p.layers; ++l) {
    p.layer[l].columns_at = at;
    at += 12 * ((p.layer[l].n + 31) / 32 * 32);
  }
  const int smem = static_cast<int>(DenseChainSmemBytes(ks, ns, p.layers));
  if (smem != at || smem > kChainMaxSmemBytes) return cudaErrorInvalidValue;  // the handler checked it
  int device = 0, major = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaFuncSetAttribute(DenseChainKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t config = {};
  const int blocks = (p.m + kRows - 1) / kRows;
  config.gridDim = dim3(static_cast<unsigned>(blocks < sms ? blocks : sms));  // each CTA copies the weights once
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  // sm_90: a programmatic dependent launch, its prefetches under the previous kernel's tail (`griddepcontrol.wait`
  // keeps every global read after it)
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attr;
  config.numAttrs = major >= 9 ? 1 : 0;
  return cudaLaunchKernelEx(&config, DenseChainKernel, p);
}

}  // namespace jaxbnn::cuda
