// XLA FFI handlers of the CUDA targets (docs/ops.md, "Native contract"). Each handler validates the call with
// common/checks.h, exactly as the CPU handlers do (both backends refuse the same calls with the same messages),
// then checks the limits of the CUDA kernels, fills a BinaryGemmProblem and launches on XLA's stream. Nothing
// is allocated at run time, so the handlers are command-buffer (CUDA graph) compatible.
#include "handlers.h"

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>

#include "binary_gemm.h"
#include "common/checks.h"
#include "common/formats.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxbnn::cuda {
namespace {

std::atomic<int> g_forced_path{static_cast<int>(KernelPath::kAuto)};
std::atomic<int> g_last_path{static_cast<int>(KernelPath::kAuto)};

// The shared checks' epilogue kind; the unqualified name in this namespace is the kernels' one.
using CheckedEpilogue = ::jaxbnn::Epilogue;

// The kernels index with int: true when the product of the non-negative `factors` fits int32.
bool ProductFitsInt32(std::initializer_list<int64_t> factors) {
  constexpr int64_t kLimit = std::numeric_limits<int32_t>::max();
  int64_t product = 1;
  for (int64_t factor : factors) {
    if (factor < 0 || (factor != 0 && product > kLimit / factor)) return false;
    product *= factor;
  }
  return true;
}

ffi::Error TooLargeForInt32(std::string_view target) {
  return checks::Invalid(target, "the operands are too large for the CUDA kernels (int32 indexing)");
}

// The limits of the CUDA kernels on top of the shared checks: they take only the default FSB tile
// (8 rows x 128 bits) and need at least one reduction word (they fill their column tables in the first
// K block).
ffi::Error CheckKernelTilesAndReduction(std::string_view target, const char* weights, int64_t tile_rows,
                                        int64_t tile_words, int64_t k_words) {
  if (tile_rows != formats::kFsbTileRows || tile_words != formats::kFsbTileWords) {
    return checks::Invalid(target, std::string(weights) + " has FSB tiles of " + std::to_string(tile_rows) +
                                       " rows x " + std::to_string(tile_words * formats::kWordBits) +
                                       " bits; the CUDA kernels take tiles of " +
                                       std::to_string(formats::kFsbTileRows) + " rows x " +
                                       std::to_string(formats::kFsbTileBits) + " bits");
  }
  if (k_words < 1) return checks::Invalid(target, "the CUDA kernels need a reduction of at least one bit, got 0");
  return ffi::Error::Success();
}

void SetEpilogue(CheckedEpilogue kind, const EpilogueOperands& operands, BinaryGemmProblem& p) {
  switch (kind) {
    case CheckedEpilogue::kInt32:
      p.epilogue = Epilogue::kInt32;
      break;
    case CheckedEpilogue::kAffine:
      p.epilogue = Epilogue::kAffine;
      p.scale = static_cast<const float*>(operands.first->untyped_data());
      p.bias = static_cast<const float*>(operands.second->untyped_data());
      break;
    case CheckedEpilogue::kThreshold:
      p.epilogue = Epilogue::kBits;
      p.threshold = static_cast<const int32_t*>(operands.first->untyped_data());
      p.flip = static_cast<const uint8_t*>(operands.second->untyped_data());
      break;
  }
}

ffi::Error Launch(std::string_view target, const BinaryGemmProblem& p, cudaStream_t stream) {
  KernelPath chosen;
  const cudaError_t err = LaunchBinaryGemm(p, static_cast<KernelPath>(g_forced_path.load()), stream, &chosen);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(target) + ": CUDA kernel launch failed: " + cudaGetErrorString(err));
  }
  g_last_path.store(static_cast<int>(chosen));
  return ffi::Error::Success();
}

// bmm is the 1x1 convolution of an (M, 1, 1, Kw) image (binary_gemm.h).
ffi::Error Bmm(std::string_view target, CheckedEpilogue kind, cudaStream_t stream, ffi::AnyBuffer a,
               ffi::AnyBuffer b, ffi::AnyBuffer b_popcount, EpilogueOperands epilogue, int64_t k, int64_t n,
               ffi::AnyBuffer out) {
  BmmProblem problem;
  if (auto error = CheckBmm(target, kind, a, b, b_popcount, epilogue, k, n, out, &problem); error.failure()) {
    return error;
  }
  if (problem.m == 0 || problem.n == 0) return ffi::Error::Success();  // empty result: no kernel to run
  if (auto error = CheckKernelTilesAndReduction(target, "operand `b`", problem.tile_rows, problem.tile_words,
                                                problem.k_words);
      error.failure()) {
    return error;
  }
  if (!ProductFitsInt32({problem.m, problem.k_words}) || !ProductFitsInt32({problem.m, problem.n})) {
    return TooLargeForInt32(target);
  }
  BinaryGemmProblem p;
  p.x = static_cast<const uint32_t*>(a.untyped_data());
  p.w = static_cast<const uint32_t*>(b.untyped_data());
  p.tap_popc = static_cast<const int32_t*>(b_popcount.untyped_data());
  p.batch = static_cast<int>(problem.m);
  p.in_h = p.in_w = 1;
  p.cw = static_cast<int>(problem.k_words);
  p.c = static_cast<int>(problem.k);
  p.out_h = p.out_w = 1;
  p.n = static_cast<int>(problem.n);
  p.w_row_tiles = static_cast<int>(problem.n_tiles);
  p.w_k_tiles = static_cast<int>(problem.k_tiles);
  p.k_words = p.cw;
  p.k_real = p.c;
  p.pooled_rows = p.batch;
  p.out = out.untyped_data();
  SetEpilogue(kind, epilogue, p);
  return Launch(target, p, stream);
}

ffi::Error Bconv2d(std::string_view target, CheckedEpilogue kind, cudaStream_t stream, ffi::AnyBuffer x,
                   ffi::AnyBuffer w, ffi::AnyBuffer w_tap_popcount, EpilogueOperands epilogue,
                   const Bconv2dAttrs& attrs, ffi::AnyBuffer out) {
  Bconv2dProblem q;
  if (auto error = CheckBconv2d(target, kind, x, w, w_tap_popcount, epilogue, attrs, out, &q); error.failure()) {
    return error;
  }
  if (q.batch == 0 || q.out_h == 0 || q.out_w == 0) return ffi::Error::Success();  // empty result
  if (auto error = CheckKernelTilesAndReduction(target, "operand `w`", q.tile_rows, q.tile_words, q.k_words);
      error.failure()) {
    return error;
  }
  if (q.pool_h * q.pool_w > kMaxPoolWindow) {
    return checks::Invalid(target, "the pool window " + std::to_string(q.pool_h) + " x " + std::to_string(q.pool_w) +
                                       " is larger than the CUDA kernels take (" + std::to_string(kMaxPoolWindow) +
                                       " elements)");
  }
  // Row origins are word offsets into the padded frame, negative at the top-left border: the whole padded
  // batch, twice over, must stay within int32. The shared checks already bound kh * kw * c by int32.
  const int64_t padded_h = q.height + q.pad_top + q.pad_bottom, padded_w = q.width + q.pad_left + q.pad_right;
  if (!ProductFitsInt32({2, q.batch, padded_h, padded_w, q.c_words}) ||
      !ProductFitsInt32({q.batch, q.out_h, q.out_w, q.o}) || !ProductFitsInt32({q.stride_h}) ||
      !ProductFitsInt32({q.stride_w})) {
    return TooLargeForInt32(target);
  }
  BinaryGemmProblem p;
  p.x = static_cast<const uint32_t*>(x.untyped_data());
  p.w = static_cast<const uint32_t*>(w.untyped_data());
  p.tap_popc = static_cast<const int32_t*>(w_tap_popcount.untyped_data());
  p.batch = static_cast<int>(q.batch);
  p.in_h = static_cast<int>(q.height);
  p.in_w = static_cast<int>(q.width);
  p.cw = static_cast<int>(q.c_words);
  p.c = static_cast<int>(q.c);
  p.kh = static_cast<int>(q.kh);
  p.kw = static_cast<int>(q.kw);
  p.stride_h = static_cast<int>(q.stride_h);
  p.stride_w = static_cast<int>(q.stride_w);
  p.pad_top = static_cast<int>(q.pad_top);
  p.pad_left = static_cast<int>(q.pad_left);
  p.pad_one = q.pad_one;
  p.pool_h = static_cast<int>(q.pool_h);
  p.pool_w = static_cast<int>(q.pool_w);
  p.out_h = static_cast<int>(q.out_h);
  p.out_w = static_cast<int>(q.out_w);
  p.n = static_cast<int>(q.o);
  p.w_row_tiles = static_cast<int>(q.o_tiles);
  p.w_k_tiles = static_cast<int>(q.k_tiles);
  p.k_words = static_cast<int>(q.k_words);
  p.k_real = static_cast<int>(q.kh * q.kw * q.c);
  p.pooled_rows = static_cast<int>(q.batch * q.out_h * q.out_w);
  p.out = out.untyped_data();
  SetEpilogue(kind, epilogue, p);
  return Launch(target, p, stream);
}

// ---- the six handlers ----

ffi::Error BmmI32(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer b_popcount, int64_t k,
                  int64_t n, ffi::Result<ffi::AnyBuffer> out) {
  return Bmm("jaxbnn_bmm_i32", CheckedEpilogue::kInt32, stream, a, b, b_popcount, {}, k, n, *out);
}

ffi::Error BmmF32(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer b_popcount,
                  ffi::AnyBuffer scale, ffi::AnyBuffer bias, int64_t k, int64_t n, ffi::Result<ffi::AnyBuffer> out) {
  return Bmm("jaxbnn_bmm_f32", CheckedEpilogue::kAffine, stream, a, b, b_popcount, {&scale, &bias}, k, n, *out);
}

ffi::Error BmmBits(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer b_popcount,
                   ffi::AnyBuffer threshold, ffi::AnyBuffer flip, int64_t k, int64_t n,
                   ffi::Result<ffi::AnyBuffer> out) {
  return Bmm("jaxbnn_bmm_bits", CheckedEpilogue::kThreshold, stream, a, b, b_popcount, {&threshold, &flip}, k, n,
             *out);
}

#define JAXBNN_BCONV2D_ATTR_PARAMS                                                                        \
  int64_t c, int64_t o, int64_t kh, int64_t kw, int64_t stride_h, int64_t stride_w, int64_t pad_top,       \
      int64_t pad_bottom, int64_t pad_left, int64_t pad_right, bool pad_one, int64_t pool_h, int64_t pool_w
#define JAXBNN_BCONV2D_ATTRS \
  Bconv2dAttrs { c, o, kh, kw, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right, pad_one, pool_h, pool_w }

ffi::Error Bconv2dI32(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer w_tap_popcount,
                      JAXBNN_BCONV2D_ATTR_PARAMS, ffi::Result<ffi::AnyBuffer> out) {
  return Bconv2d("jaxbnn_bconv2d_i32", CheckedEpilogue::kInt32, stream, x, w, w_tap_popcount, {},
                 JAXBNN_BCONV2D_ATTRS, *out);
}

ffi::Error Bconv2dF32(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer w_tap_popcount,
                      ffi::AnyBuffer scale, ffi::AnyBuffer bias, JAXBNN_BCONV2D_ATTR_PARAMS,
                      ffi::Result<ffi::AnyBuffer> out) {
  return Bconv2d("jaxbnn_bconv2d_f32", CheckedEpilogue::kAffine, stream, x, w, w_tap_popcount, {&scale, &bias},
                 JAXBNN_BCONV2D_ATTRS, *out);
}

ffi::Error Bconv2dBits(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer w_tap_popcount,
                       ffi::AnyBuffer threshold, ffi::AnyBuffer flip, JAXBNN_BCONV2D_ATTR_PARAMS,
                       ffi::Result<ffi::AnyBuffer> out) {
  return Bconv2d("jaxbnn_bconv2d_bits", CheckedEpilogue::kThreshold, stream, x, w, w_tap_popcount,
                 {&threshold, &flip}, JAXBNN_BCONV2D_ATTRS, *out);
}

#undef JAXBNN_BCONV2D_ATTRS
#undef JAXBNN_BCONV2D_ATTR_PARAMS

}  // namespace

void SetForcedKernelPath(KernelPath path) { g_forced_path.store(static_cast<int>(path)); }
KernelPath LastKernelPath() { return static_cast<KernelPath>(g_last_path.load()); }

}  // namespace jaxbnn::cuda

// Operands and attributes in the order of docs/ops.md.
#define JAXBNN_BIND_STREAM ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
#define JAXBNN_BIND_CONV_ATTRS                                                                                     \
  .Attr<int64_t>("c").Attr<int64_t>("o").Attr<int64_t>("kh").Attr<int64_t>("kw").Attr<int64_t>("stride_h")     \
      .Attr<int64_t>("stride_w").Attr<int64_t>("pad_top").Attr<int64_t>("pad_bottom").Attr<int64_t>("pad_left") \
      .Attr<int64_t>("pad_right").Attr<bool>("pad_one").Attr<int64_t>("pool_h").Attr<int64_t>("pool_w")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmI32, jaxbnn::cuda::BmmI32,
                              JAXBNN_BIND_STREAM.Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()                // b
                                  .Arg<ffi::AnyBuffer>()                // b_popcount
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmF32, jaxbnn::cuda::BmmF32,
                              JAXBNN_BIND_STREAM.Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()                // b
                                  .Arg<ffi::AnyBuffer>()                // b_popcount
                                  .Arg<ffi::AnyBuffer>()                // scale
                                  .Arg<ffi::AnyBuffer>()                // bias
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmBits, jaxbnn::cuda::BmmBits,
                              JAXBNN_BIND_STREAM.Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()                // b
                                  .Arg<ffi::AnyBuffer>()                // b_popcount
                                  .Arg<ffi::AnyBuffer>()                // threshold
                                  .Arg<ffi::AnyBuffer>()                // flip
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvI32, jaxbnn::cuda::Bconv2dI32,
                              JAXBNN_BIND_STREAM.Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()                // w
                                  .Arg<ffi::AnyBuffer>()                // w_tap_popcount
                                      JAXBNN_BIND_CONV_ATTRS.Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvF32, jaxbnn::cuda::Bconv2dF32,
                              JAXBNN_BIND_STREAM.Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()                // w
                                  .Arg<ffi::AnyBuffer>()                // w_tap_popcount
                                  .Arg<ffi::AnyBuffer>()                // scale
                                  .Arg<ffi::AnyBuffer>()                // bias
                                      JAXBNN_BIND_CONV_ATTRS.Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvBits, jaxbnn::cuda::Bconv2dBits,
                              JAXBNN_BIND_STREAM.Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()                // w
                                  .Arg<ffi::AnyBuffer>()                // w_tap_popcount
                                  .Arg<ffi::AnyBuffer>()                // threshold
                                  .Arg<ffi::AnyBuffer>()                // flip
                                      JAXBNN_BIND_CONV_ATTRS.Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
