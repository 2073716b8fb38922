// The first layer's GEMM form on Hopper (sm_90a): a dense first layer (ops.image_matmul, the MNIST MLP's 784 ->
// 1024) as int8 weights times int8 levels or uint8 pixels on the integer wgmma, m64n128k32.
//
// The wgmma wants both operands K-major and the weights lie as (K, N) rows, so they are transposed once per CTA:
// a CTA keeps one 128-column tile for its life, its weights resident in shared memory as the wgmma's B (core
// matrices of 8 columns x 16 bytes of K), and takes every CTAs-per-column-th row tile. The mma.sync GEMM form
// (kernels/image_conv.cu) transposes each K chunk's weights again for every 128 x 64 tile, which made the MNIST
// MLP's first layer 77% of its forward at batch 32768 (H100: 214 us, ~245 TOPS; this kernel 68 us, ~770 TOPS).
//
// The pieces, as the resident binary kernel's (kernels/wgmma_resident.cu): a producer warp per consumer warpgroup
// brings its 64 rows of each K block by TMA (128-byte swizzled rows, zeros past K and the rows) into its own ring;
// each consumer warpgroup runs its 64 x 128 tile's wgmmas and then its epilogue from the accumulators, while the
// other warpgroup's wgmmas run. The epilogue writes the stream (int32 or int16) and each threshold plane's bits,
// never the pre-activations of a thresholded layer. Pixels p (ImageConvProblem::pixels) are multiplied as they
// are (u8 x s8) and the layer's levels p - 128 recovered in the epilogue: pre = A.W - 128 * (the column's weight
// sum), exact in int32 (K <= kMaxImageWgmmaK).
#include "cuda/kernels/image_wgmma.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cuda.h>
#include <mutex>

#include "cuda/device/common.cuh"
#include "cuda/device/first_layer.cuh"
#include "cuda/device/pipeline.cuh"
#include "cuda/device/sm90.cuh"
#include "cuda/device/wgmma_s8.cuh"
#include "cuda/host/tensor_maps.h"

namespace jaxbnn::cuda {
namespace {

constexpr int kCols = 128;           // a CTA's column tile: m64n128k32 wgmmas
constexpr int kHalfRows = 64;        // a consumer warpgroup's rows of a tile
constexpr int kTileRows = 2 * kHalfRows;
constexpr int kBlockBytes = 128;     // K bytes a stage: one 128-byte swizzled row of 4 k32 steps
constexpr int kStepBytes = 32;
constexpr int kThreads = 384;        // a producer warpgroup, two consumer warpgroups
constexpr int kStageBytes = kHalfRows * kBlockBytes;
// Stages a consumer warpgroup's ring: as many as the shared memory left by the weights holds, up to kMaxStages (7
// for the MNIST MLP's K = 784, 4 for the longest K).
constexpr int kMinStages = 4, kMaxStages = 8;
// the rings (1024-byte aligned for the swizzled boxes), the weights, then each plane's bounds and flip words, the
// pixels' column corrections and the rings' barriers
constexpr int kBoundBytes = kMaxImagePlanes * kCols * 4;
constexpr int kFlipBytes = kMaxImagePlanes * (kCols / 32) * 4;
constexpr int kCorrectionBytes = kCols * 4;
constexpr int kBarrierBytes = 2 * 2 * kMaxStages * 8;
// 1024 bytes of slack: the swizzled TMA destinations are 1024-byte aligned
constexpr int kFixedBytes = 1024 + kBoundBytes + kFlipBytes + kCorrectionBytes + kBarrierBytes;
constexpr int kMaxSmemBytes = 227 * 1024;
constexpr int kMaxSteps = kMaxImageWgmmaK / kStepBytes;
static_assert(kMaxImageWgmmaK % kStepBytes == 0, "whole k32 steps");
__host__ __device__ constexpr int RingBytes(int stages) { return 2 * stages * kStageBytes; }
__host__ __device__ constexpr int WeightBytes(int steps) { return steps * kStepBytes * kCols; }
static_assert(kFixedBytes + RingBytes(kMinStages) + WeightBytes(kMaxSteps) <= kMaxSmemBytes,
              "the longest K's weights fit beside the shortest rings");
// K <= kMaxImageWgmmaK keeps the sum of u8 x s8 products within int32 (the accumulators never wrap)
static_assert(int64_t{kMaxImageWgmmaK} * 255 * 128 < INT32_MAX, "exact pixel products");

struct ImageWgmmaLaunch {
  int rows = 0;             // output rows (the batch's pixels)
  int m_tiles = 0;          // 128-row tiles
  int ctas_per_column = 0;  // CTAs sharing a column tile's row tiles
  int steps = 0;            // k32 steps (K rounded up)
  int k_blocks = 0;         // 128-byte K blocks (stages a row tile)
  int stages = 0;           // stages a consumer warpgroup's ring
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t RingStage(uint32_t ring, int stages, int half, int s) {
  return ring + (half * stages + s) * kStageBytes;
}
__device__ __forceinline__ uint32_t RingBarrier(uint32_t bar0, int half, int s) {
  return bar0 + 8 * (half * kMaxStages + s);
}

// The column tile's weights into shared memory as the wgmmas' B: K-major core matrices of 8 columns x 16 bytes
// of K, 8-column group j's K tiles contiguous (byte (n, k) at ((n / 8) * k_tiles + k / 16) * 128 + (n % 8) * 16 +
// k % 16), zeros past K and N. Warp w takes K tiles w, w + 12, ...; lane (a = lane % 4, b = lane / 4) loads K rows
// 16 kt + 4a .. + 3 of columns 16b .. 16b + 15 (each K row's 128 bytes by 8 lanes) and stores them as 16 words of
// 4 K bytes a column. At a store the lanes write different columns (of 4-column block qq ^ (b & 1), column
// (cc + b / 2) % 4) so that the warp's 32 stores hit 32 banks; kInFlight K tiles' loads are in flight together.
__device__ __forceinline__ void LoadTransposedWeights(const ImageConvProblem& p, int steps, uint8_t* weights, int col0,
                                                      int tid) {
  constexpr int kWarps = kThreads / 32, kInFlight = 4;
  const int lane = tid % 32, warp = tid / 32, a = lane % 4, b = lane / 4;
  const int k_tiles = 2 * steps, k_total = p.c, n = col0 + 16 * b;
  const bool real_n = n < p.n;  // N % 16 == 0: the 16 columns are wholly in or out
  const int turn = b / 2;  // lane b's columns of a block go out rotated by b / 2
  for (int first = warp; first < k_tiles; first += kInFlight * kWarps) {
    uint32_t rows[kInFlight][4][4];  // [tile][K row e][4-column block]
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int kt = first + i * kWarps;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 16 * kt + 4 * a + e;
        const bool take = real_n && kt < k_tiles && k < k_total;
#pragma unroll
        for (int q = 0; q < 4; ++q) rows[i][e][q] = 0;
        LoadQuad(rows[i][e], p.kernel + (take ? static_cast<int64_t>(k) * p.n + n : 0), take);
      }
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int kt = first + i * kWarps;
      if (kt >= k_tiles) break;
#pragma unroll
      for (int qq = 0; qq < 4; ++qq) {
        const int q = qq ^ (b & 1);
        uint32_t r[4];  // K rows 4a..4a+3 of block q: byte c of r[e] is (row e, column 4q + c)
#pragma unroll
        for (int e = 0; e < 4; ++e) r[e] = (b & 1) ? rows[i][e][qq ^ 1] : rows[i][e][qq];
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) {
          const int c = (cc + turn) % 4;
          const uint32_t select = static_cast<uint32_t>(c | (4 + c) << 4);  // bytes c of x and of y
          const uint32_t low = __byte_perm(r[0], r[1], select), high = __byte_perm(r[2], r[3], select);
          const int col = 16 * b + 4 * q + c;
          *reinterpret_cast<uint32_t*>(weights + ((col / 8) * k_tiles + kt) * 128 + (col % 8) * 16 + 4 * a) =
              __byte_perm(low, high, 0x5410);
        }
      }
    }
  }
}

// 128 x the weight sum of column `col` of the resident weights (LoadTransposedWeights' layout): what the products of
// pixels lose to their levels (pixel q is level q - 128).
__device__ __forceinline__ int PixelCorrection(const uint8_t* weights, int steps, int col) {
  const int k_tiles = 2 * steps;
  const uint8_t* row = weights + (col / 8) * k_tiles * 128 + (col % 8) * 16;
  int sum = 0;
  for (int kt = 0; kt < k_tiles; ++kt) {
    const uint4 w = *reinterpret_cast<const uint4*>(row + kt * 128);
    sum = __dp4a(static_cast<int>(w.x), 0x01010101, sum);
    sum = __dp4a(static_cast<int>(w.y), 0x01010101, sum);
    sum = __dp4a(static_cast<int>(w.z), 0x01010101, sum);
    sum = __dp4a(static_cast<int>(w.w), 0x01010101, sum);
  }
  return 128 * sum;
}

// One K block's wgmmas of a consumer warpgroup: its 64-row stage against the resident weights. kSteps: the block's
// steps that hold any of K's bytes (4 but in the last block), a straight sequence each; the first block's first
// step replaces the accumulators.
template <bool kPixels, int kSteps>
__device__ __forceinline__ void IssueSteps(int (&acc)[64], uint32_t stage, uint32_t weights, int k_tiles, int kb) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    const uint64_t desc_a = SwizzledOperandDescriptor(stage + ks * kStepBytes);
    const uint64_t desc_b = OperandDescriptor(weights + (8 * kb + 2 * ks) * 128, 128, k_tiles * 128);
    if constexpr (kPixels) {
      wgmma_m64n128k32_u8s8(acc, desc_a, desc_b, (kb | ks) != 0);
    } else {
      wgmma_m64n128k32_s8s8(acc, desc_a, desc_b, (kb | ks) != 0);
    }
  }
}
template <bool kPixels>
__device__ __forceinline__ void IssueBlock(int (&acc)[64], uint32_t stage, uint32_t weights, int k_total, int k_tiles,
                                           int kb) {
  switch (min(4, (k_total - kb * kBlockBytes + kStepBytes - 1) / kStepBytes)) {  // (the same for the warpgroup)
    case 4:
      IssueSteps<kPixels, 4>(acc, stage, weights, k_tiles, kb);
      break;
    case 3:
      IssueSteps<kPixels, 3>(acc, stage, weights, k_tiles, kb);
      break;
    case 2:
      IssueSteps<kPixels, 2>(acc, stage, weights, k_tiles, kb);
      break;
    default:
      IssueSteps<kPixels, 1>(acc, stage, weights, k_tiles, kb);
  }
}

// A consumer thread's part of its warpgroup's 64 x 128 tile from the accumulators (d[i]: row g + 8 ((i >> 1) & 1)
// of the warp's 16 from row0, column 8 (i >> 2) + 2t + (i & 1)): the stream's pairs, and each plane's words, a
// word's 32 bits gathered over the 4 lanes of a quad (lane t stores word t of the tile's 4).
template <bool kPixels>
__device__ __forceinline__ void StoreTile(const ImageConvProblem& p, const int (&acc)[64], const int* bound,
                                          const uint32_t* flip_word, const int* correction, int rows, int row0,
                                          int col0, int lane) {
  const int g = lane / 4, t = lane % 4, out_words = (p.n + 31) / 32;
#pragma unroll
  for (int half_row = 0; half_row < 2; ++half_row) {
    const int row = row0 + g + 8 * half_row;
    const bool real_row = row < rows;
    int v[32];  // column 8j + 2t + e: v[2j + e]
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int pre = acc[4 * j + 2 * half_row + e] - (kPixels ? correction[8 * j + 2 * t + e] : 0);
        v[2 * j + e] = StreamValue(p, pre);
      }
    }
    if (p.out_stream != nullptr && real_row) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = col0 + 8 * j + 2 * t;
        if (col >= p.n) break;
        const int64_t at = static_cast<int64_t>(row) * p.n + col;
        if (p.narrow_stream) {
          *reinterpret_cast<uint32_t*>(static_cast<int16_t*>(p.out_stream) + at) =
              static_cast<uint16_t>(v[2 * j]) | static_cast<uint32_t>(static_cast<uint16_t>(v[2 * j + 1])) << 16;
        } else {
          *reinterpret_cast<int2*>(static_cast<int32_t*>(p.out_stream) + at) = make_int2(v[2 * j], v[2 * j + 1]);
        }
      }
    }
    for (int plane = 0; plane < p.planes; ++plane) {
      const int* plane_bound = bound + plane * kCols;
      uint32_t mine = 0;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        uint32_t bits = 0;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int j = 4 * w + jj;
          const int2 bd = *reinterpret_cast<const int2*>(plane_bound + 8 * j + 2 * t);
          bits |= uint32_t{v[2 * j] >= bd.x} << (8 * jj + 2 * t) | uint32_t{v[2 * j + 1] >= bd.y} << (8 * jj + 2 * t + 1);
        }
        bits |= __shfl_xor_sync(0xffffffffu, bits, 1);
        bits |= __shfl_xor_sync(0xffffffffu, bits, 2);
        if (w == t) mine = bits;
      }
      const int first_col = col0 + 32 * t;
      if (real_row && first_col < p.n) {
        p.out_bits[(static_cast<int64_t>(row) * p.planes + plane) * out_words + first_col / 32] =
            mine ^ flip_word[plane * (kCols / 32) + t];
      }
    }
  }
}

// A producer's walk over its half's stages: K block kb of row tile tile_m next, the ring's `issued` copies so far.
struct Feed {
  int tile_m = 0, kb = 0, issued = 0;
  LaunchRingPosition at;
};
// Issues the walk's next copy (waiting for its stage to be read where the ring has gone round); false where the
// walk is done.
__device__ __forceinline__ bool FeedStage(Feed& f, const CUtensorMap& a_map, const ImageWgmmaLaunch& L, uint32_t ring,
                                          uint32_t full0, uint32_t empty0, int half) {
  if (f.tile_m >= L.m_tiles) return false;
  if (f.issued >= L.stages) BarrierWait(RingBarrier(empty0, half, f.at.stage), f.at.phase ^ 1);
  const uint32_t full = RingBarrier(full0, half, f.at.stage);
  BarrierArriveExpectBytes(full, kStageBytes);
  TensorCopy(RingStage(ring, L.stages, half, f.at.stage), a_map, f.kb * kBlockBytes,
             f.tile_m * kTileRows + kHalfRows * half, full);
  ++f.issued;
  f.at.Advance(L.stages);
  if (++f.kb == L.k_blocks) {
    f.kb = 0;
    f.tile_m += L.ctas_per_column;
  }
  return true;
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// grid: column tiles x ctas_per_column CTAs; CTA b takes column tile b / ctas_per_column and row tiles
// b % ctas_per_column, + ctas_per_column, ... a_map: the levels (or pixels) as rows of K bytes in boxes of 64 rows x
// 128 bytes, 128-byte swizzle. All threads first bring the weights, the bounds and the column corrections; then
// producer warps 0 and 1 feed consumer warpgroups 0 and 1 (rows 0-63 and 64-127 of each row tile).
template <bool kPixels>
__global__ void __launch_bounds__(kThreads, 1)
    ImageWgmmaKernel(const ImageConvProblem p, const __grid_constant__ CUtensorMap a_map, const ImageWgmmaLaunch L) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - SmemAddress(smem_raw) % 1024) % 1024;
  uint8_t* weights = smem + RingBytes(L.stages);
  int* bound = reinterpret_cast<int*>(weights + WeightBytes(L.steps));
  uint32_t* flip_word = reinterpret_cast<uint32_t*>(bound + kMaxImagePlanes * kCols);
  int* correction = reinterpret_cast<int*>(flip_word + kMaxImagePlanes * kCols / 32);
  uint64_t* barriers = reinterpret_cast<uint64_t*>(correction + kCols);
  const uint32_t ring = SmemAddress(smem), weights_at = SmemAddress(weights);
  const uint32_t full0 = SmemAddress(barriers);           // [half][stage]: the stage landed
  const uint32_t empty0 = full0 + 2 * kMaxStages * 8;       // [half][stage]: its 4 consumer warps read it
  const int tid = threadIdx.x;
  const int first_tile = blockIdx.x % L.ctas_per_column, col0 = blockIdx.x / L.ctas_per_column * kCols;
  if (tid == 0) {
    PrefetchTensorMap(a_map);
    for (int i = 0; i < 2 * kMaxStages; ++i) {
      BarrierInit(full0 + 8 * i, 1);
      BarrierInit(empty0 + 8 * i, 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the barriers are initialized
  // lane 0 of warps 0 and 1 feed consumer warpgroups 0 and 1: their first stages go out before the weights load
  const bool feeder = tid < 64 && tid % 32 == 0;
  Feed feed;
  feed.tile_m = first_tile;
  if (feeder) {
    for (int i = 0; i < L.stages && FeedStage(feed, a_map, L, ring, full0, empty0, tid / 32); ++i) {
    }
  }
  LoadTransposedWeights(p, L.steps, weights, col0, tid);
  if (p.planes > 0) LoadImageBounds(p, bound, flip_word, col0, kCols, tid, kThreads);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the weights, written here, read by the wgmmas
  __syncthreads();

  if (tid < 128) {  // the producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (kPixels && tid >= 64) {  // warps 2 and 3: the pixels' column corrections, under the first tile's wgmmas
      correction[tid - 64] = PixelCorrection(weights, L.steps, tid - 64);
      correction[tid] = PixelCorrection(weights, L.steps, tid);
      asm volatile("bar.arrive 1, 320;\n" ::: "memory");  // to the consumer warpgroups' first epilogue
    }
    if (feeder) {
      while (FeedStage(feed, a_map, L, ring, full0, empty0, tid / 32)) {
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int ctid = tid - 128, half = ctid / 128, warp = ctid % 128 / 32, lane = tid % 32;
  LaunchRingPosition at;
  for (int tile_m = first_tile; tile_m < L.m_tiles; tile_m += L.ctas_per_column) {
    int acc[64];
    int previous_stage = 0;
    for (int kb = 0; kb < L.k_blocks; ++kb) {
      BarrierWait(RingBarrier(full0, half, at.stage), at.phase);
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      IssueBlock<kPixels>(acc, RingStage(ring, L.stages, half, at.stage), weights_at, p.c, 2 * L.steps, kb);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      // the previous block's wgmmas are done with its stage
      if (kb > 0 && lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(RingBarrier(empty0, half, previous_stage)) : "memory");
      previous_stage = at.stage;
      at.Advance(L.stages);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    if (kPixels && tile_m == first_tile) asm volatile("bar.sync 1, 320;\n" ::: "memory");  // the corrections
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(RingBarrier(empty0, half, previous_stage)) : "memory");
    StoreTile<kPixels>(p, acc, bound, flip_word, correction, L.rows, tile_m * kTileRows + kHalfRows * half + 16 * warp,
                       col0, lane);
  }
#endif
}

}  // namespace

bool ImageWgmmaTakes(const ImageConvProblem& p) {
  if (!ImageGemmTakes(p) || p.c > kMaxImageWgmmaK || TensorMapEncoder() == nullptr) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return false;
  static std::once_flag asked[64];
  static bool hopper[64];
  std::call_once(asked[device], [&] {
    int major = 0, minor = 0;
    hopper[device] = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                     cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
                     major == 9 && minor == 0;
  });
  return hopper[device];
}

cudaError_t LaunchImageWgmma(const ImageConvProblem& p, cudaStream_t stream) {
  const int64_t rows = int64_t{p.batch} * p.out_h * p.out_w;
  ImageWgmmaLaunch L;
  L.rows = static_cast<int>(rows);  // int32 by the handler's checks
  L.m_tiles = static_cast<int>((rows + kTileRows - 1) / kTileRows);
  L.steps = (p.c + kStepBytes - 1) / kStepBytes;
  L.k_blocks = (p.c + kBlockBytes - 1) / kBlockBytes;
  L.stages = std::min(kMaxStages, (kMaxSmemBytes - kFixedBytes - WeightBytes(L.steps)) / RingBytes(1));
  const int smem = kFixedBytes + RingBytes(L.stages) + WeightBytes(L.steps);
  const int col_tiles = (p.n + kCols - 1) / kCols;
  int device = 0, sms = 0;
  cudaError_t err;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;
  // a CTA an SM: each column tile's row tiles shared out over the SMs it gets
  L.ctas_per_column = std::max(1, std::min(L.m_tiles, sms / col_tiles));
  const int64_t ctas = int64_t{col_tiles} * L.ctas_per_column;
  if (ctas > INT32_MAX) return cudaErrorInvalidValue;
  TensorMapRecipe r;
  r.rank = 2;
  r.dims[0] = static_cast<cuuint64_t>(p.c);
  r.dims[1] = static_cast<cuuint64_t>(rows);
  r.strides[0] = static_cast<cuuint64_t>(p.c);
  r.box[0] = kBlockBytes;
  r.box[1] = kHalfRows;
  r.swizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  CUtensorMap a_map;
  if (!Encode(r, p.levels, a_map)) return cudaErrorInvalidValue;
  const void* kernel = p.pixels ? reinterpret_cast<const void*>(&ImageWgmmaKernel<true>)
                                : reinterpret_cast<const void*>(&ImageWgmmaKernel<false>);
  static std::once_flag raised[2][64];
  static cudaError_t raise_errors[2][64];
  if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
  std::call_once(raised[p.pixels][device], [&] {  // the largest size the kernel takes
    raise_errors[p.pixels][device] =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmemBytes);
  });
  if ((err = raise_errors[p.pixels][device]) != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(ctas));
  if (p.pixels) {
    ImageWgmmaKernel<true><<<grid, kThreads, smem, stream>>>(p, a_map, L);
  } else {
    ImageWgmmaKernel<false><<<grid, kThreads, smem, stream>>>(p, a_map, L);
  }
  return cudaGetLastError();
}

}  // namespace jaxbnn::cuda
