// One problem description for every CUDA kernel of jaxbnn: a binary convolution as an implicit GEMM.
// A bmm is the 1x1 convolution of a (M, 1, 1, Kw) image, so both ops share loaders, kernels and epilogues.
//
// GEMM view: row m = one (pre-pool) output pixel, column = output channel, reduction = taps x channel words
// (the weight matrix layout of docs/formats.md). Every dot product is computed with AND-popc:
//   a.b = K - 2 popc(a) - 2 popc(b) + 4 popc(a AND b),
// popc(a) per row from the A tiles in shared memory, popc(b) per column from the tap popcounts.
#ifndef JAXBNN_XLA_FFI_CUDA_BINARY_GEMM_H_
#define JAXBNN_XLA_FFI_CUDA_BINARY_GEMM_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxbnn::cuda {

// kResidual: a residual block's second convolution. Its int32 output is the new residual stream,
// (dot >> shift) + shortcut, and with a threshold also that stream's packed bits (the next block's input).
// kInt16: the dot products as int16, for reductions of at most 32767 products (k_real), where every dot product
// fits: half the bytes of kInt32 to store (a ResNet's narrow residual stream).
// kResidualInt16: kResidual over an int16 stream (shortcut and output int16, the sum wrapping as int16
// arithmetic does).
enum class Epilogue : int { kInt32 = 0, kAffine = 1, kBits = 2, kResidual = 3, kInt16 = 4, kResidualInt16 = 5 };

// Whether `e` is a residual epilogue (the kernels' residual instances run it).
__host__ __device__ constexpr bool IsResidual(Epilogue e) {
  return e == Epilogue::kResidual || e == Epilogue::kResidualInt16;
}

// The longest reduction (k_real) whose dot products Epilogue::kInt16 takes: |dot| <= k_real fits int16.
inline constexpr int kMaxInt16Reduction = 32767;

// Rows above / below and columns left / right of the frame covered by a receptive field.
struct FrameExcess {
  int top = 0, bottom = 0, left = 0, right = 0;
};

// How a border class is numbered (BorderClass): top t, bottom b, left l and right r excess times their strides,
// plus bottom_offset where b > 0 and right_offset where r > 0.
struct ClassNumbering {
  int top = 0, bottom = 0, left = 0, right = 0, bottom_offset = 0, right_offset = 0;
};
// Which kernel runs a problem. kAuto: wgmma on sm_90 when the rows are 16-byte aligned, else mma.sync
// (sm_80+), else the CUDA-core popcount kernel.
enum class KernelPath : int { kAuto = 0, kWgmma = 1, kMmaSync = 2, kSimt = 3 };

struct BinaryGemmProblem {
  const uint32_t* x = nullptr;         // packed NHWC input (batch, in_h, in_w, cw)
  const uint32_t* w = nullptr;         // FSB tiles (w_row_tiles, w_k_tiles, 8, 4)
  const int32_t* tap_popc = nullptr;   // (kh * kw, n): +1 count of each tap of each output channel
  int batch = 0, in_h = 0, in_w = 0, cw = 0, c = 0;
  // Words per pixel of `x` as it lies in memory: cw, or cw / 2 where each tap's reduction reads the pixel's words
  // twice (a side-by-side ternary product's repeated activation blocks, docs/ops.md: the operand is not copied
  // twice over first). Set by the caller; the kernels gather tap word w from stored word w % x_cw.
  int x_cw = 0;
  int kh = 1, kw = 1, stride_h = 1, stride_w = 1, pad_top = 0, pad_left = 0;
  bool pad_one = false;                // out-of-frame taps are -1 inputs (else they are excluded)
  int pool_h = 1, pool_w = 1;
  int out_h = 0, out_w = 0;            // pooled output size
  int n = 0;                           // output channels (GEMM columns)
  int w_row_tiles = 0, w_k_tiles = 0;  // FSB grid: ceil(n / 8), ceil(k_words / 4)
  int k_words = 0;                     // kh * kw * cw
  int k_real = 0;                      // kh * kw * c: the number of real ±1 products of a dot
  int pooled_rows = 0;                 // batch * out_h * out_w
  Epilogue epilogue = Epilogue::kInt32;
  // Epilogue::kBits: the threshold planes (1 to kMaxBitsPlanes): threshold / flip are (planes, n), out is
  // (pooled_rows, planes, ceil(n/32)), plane q's bits compare each dot product with threshold[q n + col]. Every
  // plane comes from the same accumulators: a ternary output (two planes) costs one product, not two.
  int planes = 1;
  const float* scale = nullptr;
  const float* bias = nullptr;
  const int32_t* threshold = nullptr;
  const uint8_t* flip = nullptr;
  void* out = nullptr;                 // int32 / int16 / float32 (pooled_rows, n) or uint32 (pooled_rows, planes, ceil(n/32))
  // Derived from the shape by the launcher (callers leave them): the largest excess of a receptive field at
  // each side of the frame, and whether the tiles keep the per-border-class correction table. Kernel
  // parameters, so that no thread recomputes them: the kernels did, in their set-up and in every tile's
  // bookkeeping and epilogue (C = 128 +4%, C = 512 and the 4096^3 BMM +2.5-3%).
  FrameExcess max_excess;
  bool compact_classes = false;  // border classes as (vertical, horizontal) excess pairs (UsesCompactClasses)
  ClassNumbering class_numbering;  // kernel parameters: no register holds the strides
  bool correction_table = false;
  bool edge_table = false;    // without the class table: the border rows' edge-strip sums (KeepsEdgeTable),
  bool edge_corners = false;  // and their corner blocks (KeepsEdgeCorners)
  // The products of the first doubled_k_blocks K blocks (kKBlockWords words each) count twice: the accumulators
  // are doubled once those blocks are in, before the rest of the reduction adds to them (0: none). A ternary
  // product in three blocks instead of four (docs/ops.md). In a convolution the reduction then runs every tap's
  // first DoubledTapWords words (32 doubled_k_blocks / (kh kw): the doubled blocks), then every tap's other words
  // (DoubledReductionWord). Not residual; the persistent wgmma kernel and the classic kernels run it. Last, so
  // that the other kernels' parameters keep their offsets (and those kernels their machine code).
  int doubled_k_blocks = 0;
};

// A doubled product's doubled words per tap (BinaryGemmProblem::doubled_k_blocks): a multiple of 32 in a
// convolution, followed by a multiple of 16 (LaunchBinaryGemm), so that no copy or TMA box crosses from one tap's
// run of the reduction into the next.
__host__ __device__ inline int DoubledTapWords(const BinaryGemmProblem& p) {
  return p.doubled_k_blocks * 32 / (p.kh * p.kw);
}

// The residual epilogue's operands (IsResidual, unpooled): out[row, col] = (dot >> shift) +
// shortcut[b, s oh, s ow, col] (0 for col >= channels), the shortcut (batch, height, width, channels) of the
// stream's type (int32; int16 with kResidualInt16) taken every s = stride pixels (ceil(height / s) = out_h,
// ceil(width / s) = out_w, channels <= n); with
// `bits` (else null) also the stream's bits (pooled_rows, planes, ceil(n/32)) against the problem's threshold /
// flip (planes, n): plane q's bit is out >= threshold[q n + col] (<= where flip). A ternary conv1 after the block
// takes two planes: the wgmma kernels' staged epilogue (int16 stream) writes both from the sum; elsewhere the
// launcher writes them by a stream-bits pass after the kernel. A kernel parameter after the problem's, so that
// the other epilogues' kernels keep their parameters (and their machine code) as they are.
struct ResidualOperands {
  const void* shortcut = nullptr;  // int32, or int16 with Epilogue::kResidualInt16 (as the output)
  int height = 0, width = 0, channels = 0, stride = 1, shift = 0;
  uint32_t* bits = nullptr;
  int planes = 1;  // the stream bits' threshold planes: 1 to kMaxBitsPlanes
};

// The largest pool window (pool_h * pool_w) the kernels take: a window must fit in one CTA's rows.
inline constexpr int kMaxPoolWindow = 64;
// The most threshold planes (BinaryGemmProblem::planes) the bit epilogues write from one product: a ternary
// output's two (TileColumns keeps the second plane's parameters where the affine epilogue keeps its own).
inline constexpr int kMaxBitsPlanes = 2;
// The longest reduction the kernels take, in 32-bit words (k_words; 2^21 bits): the threshold epilogue
// keeps its integers below 2^25 in magnitude (ColumnBound, StoreBitsRows).
inline constexpr int kMaxReductionWords = 1 << 16;

// Launches the kernel for `problem` on `stream`; returns the launch error, if any. `path` forces a kernel
// when it can run the problem (falls back to kAuto's choice otherwise). `chosen` (may be null) receives
// the kernel that ran. `residual`: the operands of a residual epilogue (IsResidual).
cudaError_t LaunchBinaryGemm(const BinaryGemmProblem& problem, KernelPath path, cudaStream_t stream,
                             KernelPath* chosen, const ResidualOperands& residual = {});

}  // namespace jaxbnn::cuda

#endif  // JAXBNN_XLA_FFI_CUDA_BINARY_GEMM_H_
