// XLA FFI handlers of docs/ops.md on the CPU: validate (common/checks.h and common/ternary_checks.h, shared
// with CUDA; the first layer in cpu/image_checks.h), then run.
#include "cpu/handlers.h"

#include <exception>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/ternary_checks.h"
#include "cpu/bit_kernels.h"
#include "cpu/image_checks.h"
#include "cpu/image_kernels.h"
#include "cpu/pool_kernels.h"
#include "cpu/ternary_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jaxbnn::cpu {
namespace {

EpilogueData EpilogueDataOf(Epilogue kind, const EpilogueOperands& operands) {
  EpilogueData data{kind, nullptr, nullptr, nullptr, nullptr, 1};
  if (kind == Epilogue::kAffine) {
    data.scale = static_cast<const float*>(operands.first->untyped_data());
    data.bias = static_cast<const float*>(operands.second->untyped_data());
  } else if (kind == Epilogue::kThreshold) {
    data.threshold = static_cast<const int32_t*>(operands.first->untyped_data());
    data.flip = static_cast<const uint8_t*>(operands.second->untyped_data());
    auto dims = operands.first->dimensions();
    data.planes = dims.size() == 2 ? dims[0] : 1;  // (P, N) thresholds: the mixed targets' planes
  }
  return data;
}

template <class Run>
ffi::Error Guarded(std::string_view target, Run run) {
  try {
    run();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(target) + ": " + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error Bmm(std::string_view target, Epilogue kind, ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
               ffi::AnyBuffer b_popcount, EpilogueOperands epilogue, int64_t k, int64_t n, ffi::AnyBuffer out) {
  BmmProblem problem;
  if (auto error = CheckBmm(target, kind, a, b, b_popcount, epilogue, k, n, out, &problem); error.failure()) {
    return error;
  }
  return Guarded(target, [&] {
    RunBmm(problem, static_cast<const uint32_t*>(a.untyped_data()), static_cast<const uint32_t*>(b.untyped_data()),
           EpilogueDataOf(kind, epilogue), out.untyped_data(), &pool);
  });
}

ffi::Error BmmI32(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer b_popcount, int64_t k,
                  int64_t n, ffi::Result<ffi::AnyBuffer> out) {
  return Bmm("jaxbnn_bmm_i32", Epilogue::kInt32, pool, a, b, b_popcount, {}, k, n, *out);
}

ffi::Error BmmF32(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer b_popcount,
                  ffi::AnyBuffer scale, ffi::AnyBuffer bias, int64_t k, int64_t n, ffi::Result<ffi::AnyBuffer> out) {
  return Bmm("jaxbnn_bmm_f32", Epilogue::kAffine, pool, a, b, b_popcount, {&scale, &bias}, k, n, *out);
}

ffi::Error BmmBits(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer b_popcount,
                   ffi::AnyBuffer threshold, ffi::AnyBuffer flip, int64_t k, int64_t n,
                   ffi::Result<ffi::AnyBuffer> out) {
  return Bmm("jaxbnn_bmm_bits", Epilogue::kThreshold, pool, a, b, b_popcount, {&threshold, &flip}, k, n, *out);
}

// A chain of dense binary layers in one call (ops.bmm_chain): x (M, ceil(k_0 / 32)), then per layer its FSB
// weights, the popcounts of its rows (n,) and its epilogue's two operands: threshold (n,) int32 and flip (n,)
// uint8, or for the last layer of the _f32 target scale and bias (n,) float32. ks, ns: each layer's k and n.
// Unlike the CUDA kernel's, any number of layers of any widths.
ffi::Error BmmChain(std::string_view target, bool affine, ffi::ThreadPool pool, ffi::AnyBuffer x,
                    ffi::RemainingArgs operands, ffi::Span<const int64_t> ks, ffi::Span<const int64_t> ns,
                    ffi::AnyBuffer out) {
  using namespace checks;
  const int64_t count = static_cast<int64_t>(ks.size());
  if (count < 1 || ns.size() != ks.size()) {
    return Invalid(target, Concat("takes at least one layer, each with its k and n; got ", ks.size(), " k and ",
                                  ns.size(), " n"));
  }
  if (static_cast<int64_t>(operands.size()) != 4 * count) {
    return Invalid(target, Concat("takes four operands a layer (weights, popcounts, two epilogue operands); got ",
                                  operands.size(), " for ", count, " layers"));
  }
  for (int64_t l = 0; l < count; ++l) {
    if (ks[l] < 1 || ks[l] > kMaxReduction || ns[l] < 1 || ns[l] > kMaxAttr) {
      return Invalid(target, Concat("layer ", l, " has k=", ks[l], ", n=", ns[l], "; k must lie in [1, ",
                                    kMaxReduction, "] and n in [1, ", kMaxAttr, "]"));
    }
    if (l > 0 && ks[l] != ns[l - 1]) {
      return Invalid(target, Concat("layer ", l, " reduces over k=", ks[l], " bits, but the layer before writes n=",
                                    ns[l - 1]));
    }
  }
  if (auto e = CheckDtypeRank(target, "operand `a`", x, ffi::DataType::U32, 2, "(M, ceil(k_0/32))"); e.failure()) {
    return e;
  }
  const int64_t m = x.dimensions()[0];
  const std::string why_a = Concat("layer 0's k = ", ks[0]);
  if (auto e = CheckShape(target, "operand `a`", x, {m, formats::WordsForBits(ks[0])}, why_a.c_str()); e.failure()) {
    return e;
  }
  std::vector<ffi::AnyBuffer> buffers;
  for (int64_t i = 0; i < 4 * count; ++i) {
    auto buffer = operands.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return Invalid(target, Concat("operand ", i + 1, " is not an array"));
    buffers.push_back(*buffer);
  }
  std::vector<ChainLayer> layers;
  for (int64_t l = 0; l < count; ++l) {
    const int64_t k = ks[l], n = ns[l];
    const ffi::AnyBuffer& w = buffers[4 * l];
    const ffi::AnyBuffer& popcount = buffers[4 * l + 1];
    const std::string weights = Concat("operand `w` of layer ", l), popcounts = Concat("operand `popc` of layer ", l);
    const std::string columns = Concat("layer ", l, "'s n");
    if (auto e = CheckDtypeRank(target, weights.c_str(), w, ffi::DataType::U32, 4, "(NT, KT, BH, BW/32) of FSB tiles");
        e.failure()) {
      return e;
    }
    if (auto e = CheckFsbGeometry(target, weights.c_str(), w, n, k, columns.c_str()); e.failure()) return e;
    if (auto e = CheckDtypeRank(target, popcounts.c_str(), popcount, ffi::DataType::S32, 1, "(N,)"); e.failure()) {
      return e;
    }
    const std::string why_n = Concat(columns, " = ", n);
    if (auto e = CheckShape(target, popcounts.c_str(), popcount, {n}, why_n.c_str()); e.failure()) return e;
    const Epilogue kind = affine && l + 1 == count ? Epilogue::kAffine : Epilogue::kThreshold;
    const EpilogueOperands epilogue{&buffers[4 * l + 2], &buffers[4 * l + 3]};
    if (auto e = CheckEpilogueOperands(target, kind, epilogue, n, columns.c_str()); e.failure()) return e;
    const auto dims = w.dimensions();
    layers.push_back(ChainLayer{BmmProblem{m, k, n, formats::WordsForBits(k), dims[0], dims[1], dims[2], dims[3], kind},
                                static_cast<const uint32_t*>(w.untyped_data()), EpilogueDataOf(kind, epilogue)});
  }
  if (auto e = CheckResult(target, layers.back().problem.epilogue, out, {m}, ns[count - 1]); e.failure()) return e;
  return Guarded(target, [&] {
    RunBmmChain(layers, static_cast<const uint32_t*>(x.untyped_data()), out.untyped_data(), &pool);
  });
}

// The binding of both chain targets: a, four operands a layer, the layers' k and n.
auto BindBmmChain() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()  // a
      .RemainingArgs()        // four a layer
      .Attr<ffi::Span<const int64_t>>("ks")
      .Attr<ffi::Span<const int64_t>>("ns")
      .Ret<ffi::AnyBuffer>();
}

ffi::Error BmmChainF32(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs operands,
                       ffi::Span<const int64_t> ks, ffi::Span<const int64_t> ns, ffi::Result<ffi::AnyBuffer> out) {
  return BmmChain("jaxbnn_bmm_chain_f32", true, pool, x, operands, ks, ns, *out);
}

ffi::Error BmmChainBits(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs operands,
                        ffi::Span<const int64_t> ks, ffi::Span<const int64_t> ns, ffi::Result<ffi::AnyBuffer> out) {
  return BmmChain("jaxbnn_bmm_chain_bits", false, pool, x, operands, ks, ns, *out);
}

ffi::Error Bconv2d(std::string_view target, Epilogue kind, ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                   ffi::AnyBuffer w_tap_popcount, EpilogueOperands epilogue, const Bconv2dAttrs& attrs,
                   ffi::AnyBuffer out) {
  Bconv2dProblem problem;
  if (auto error = CheckBconv2d(target, kind, x, w, w_tap_popcount, epilogue, attrs, out, &problem);
      error.failure()) {
    return error;
  }
  return Guarded(target, [&] {
    RunBconv2d(problem, static_cast<const uint32_t*>(x.untyped_data()),
               static_cast<const uint32_t*>(w.untyped_data()),
               static_cast<const int32_t*>(w_tap_popcount.untyped_data()), EpilogueDataOf(kind, epilogue),
               out.untyped_data(), &pool);
  });
}

#define JAXBNN_BCONV2D_ATTR_PARAMS                                                                        \
  int64_t c, int64_t o, int64_t kh, int64_t kw, int64_t stride_h, int64_t stride_w, int64_t pad_top,       \
      int64_t pad_bottom, int64_t pad_left, int64_t pad_right, bool pad_one, int64_t pool_h, int64_t pool_w
#define JAXBNN_BCONV2D_ATTRS \
  Bconv2dAttrs { c, o, kh, kw, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right, pad_one, pool_h, pool_w }

ffi::Error Bconv2dI32(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer w_tap_popcount,
                      JAXBNN_BCONV2D_ATTR_PARAMS, ffi::Result<ffi::AnyBuffer> out) {
  return Bconv2d("jaxbnn_bconv2d_i32", Epilogue::kInt32, pool, x, w, w_tap_popcount, {}, JAXBNN_BCONV2D_ATTRS, *out);
}

ffi::Error Bconv2dF32(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer w_tap_popcount,
                      ffi::AnyBuffer scale, ffi::AnyBuffer bias, JAXBNN_BCONV2D_ATTR_PARAMS,
                      ffi::Result<ffi::AnyBuffer> out) {
  return Bconv2d("jaxbnn_bconv2d_f32", Epilogue::kAffine, pool, x, w, w_tap_popcount, {&scale, &bias},
                 JAXBNN_BCONV2D_ATTRS, *out);
}

ffi::Error Bconv2dBits(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer w_tap_popcount,
                       ffi::AnyBuffer threshold, ffi::AnyBuffer flip, JAXBNN_BCONV2D_ATTR_PARAMS,
                       ffi::Result<ffi::AnyBuffer> out) {
  return Bconv2d("jaxbnn_bconv2d_bits", Epilogue::kThreshold, pool, x, w, w_tap_popcount, {&threshold, &flip},
                 JAXBNN_BCONV2D_ATTRS, *out);
}

// The residual epilogue (docs/ops.md) of a convolution `problem` that its own checks validated, its stream of
// `stream_type` (int32 or int16): the shortcut's checks, then the epilogue's data in `epilogue`.
ffi::Error ResidualEpilogue(std::string_view target, ffi::DataType stream_type, Bconv2dProblem& problem,
                            ffi::AnyBuffer shortcut, EpilogueOperands threshold, int64_t shortcut_stride,
                            int64_t shift, ffi::AnyBuffer* bits, EpilogueData* epilogue) {
  int64_t planes;
  if (auto error = CheckResidual(target, problem, shortcut, stream_type, shortcut_stride, shift, threshold, bits,
                                 &planes);
      error.failure()) {
    return error;
  }
  problem.epilogue = Epilogue::kResidual;
  *epilogue = EpilogueData{Epilogue::kResidual, nullptr, nullptr, nullptr, nullptr, planes};
  if (bits != nullptr) {
    epilogue->threshold = static_cast<const int32_t*>(threshold.first->untyped_data());
    epilogue->flip = static_cast<const uint8_t*>(threshold.second->untyped_data());
  }
  const auto dims = shortcut.dimensions();
  epilogue->residual = ResidualData{shortcut.untyped_data(), stream_type == ffi::DataType::S16, dims[1], dims[2],
                                    dims[3], shortcut_stride, shift, problem.out_h, problem.out_w,
                                    bits == nullptr ? nullptr : static_cast<uint32_t*>(bits->untyped_data())};
  return ffi::Error::Success();
}

// The binary residual convolution over a stream of `stream_type`: the convolution's checks and geometry, then
// the shortcut's.
ffi::Error Bconv2dResidual(std::string_view target, ffi::DataType stream_type, ffi::ThreadPool pool, ffi::AnyBuffer x,
                           ffi::AnyBuffer w, ffi::AnyBuffer w_tap_popcount, ffi::AnyBuffer shortcut,
                           EpilogueOperands threshold, const Bconv2dAttrs& attrs, int64_t shortcut_stride, int64_t shift,
                           ffi::AnyBuffer stream, ffi::AnyBuffer* bits) {
  Bconv2dProblem problem;
  EpilogueData epilogue;
  if (auto error = CheckBconv2d(target, Epilogue::kInt32, x, w, w_tap_popcount, {}, attrs, stream, &problem,
                                stream_type);
      error.failure()) {
    return error;
  }
  if (auto error = ResidualEpilogue(target, stream_type, problem, shortcut, threshold, shortcut_stride, shift, bits,
                                    &epilogue);
      error.failure()) {
    return error;
  }
  return Guarded(target, [&] {
    RunBconv2d(problem, static_cast<const uint32_t*>(x.untyped_data()), static_cast<const uint32_t*>(w.untyped_data()),
               static_cast<const int32_t*>(w_tap_popcount.untyped_data()), epilogue, stream.untyped_data(), &pool);
  });
}

// jaxbnn_bconv2d_residual_i32 / _i16: the stream of type T.
template <ffi::DataType T>
ffi::Error Bconv2dResidualStream(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                 ffi::AnyBuffer w_tap_popcount, ffi::AnyBuffer shortcut, JAXBNN_BCONV2D_ATTR_PARAMS,
                                 int64_t shortcut_stride, int64_t shift, ffi::Result<ffi::AnyBuffer> stream) {
  return Bconv2dResidual(T == ffi::DataType::S16 ? "jaxbnn_bconv2d_residual_i16" : "jaxbnn_bconv2d_residual_i32", T,
                         pool, x, w, w_tap_popcount, shortcut, {}, JAXBNN_BCONV2D_ATTRS, shortcut_stride, shift,
                         *stream, nullptr);
}

// jaxbnn_bconv2d_residual_bits / _i16_bits: the stream of type T and its bits.
template <ffi::DataType T>
ffi::Error Bconv2dResidualStreamBits(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                     ffi::AnyBuffer w_tap_popcount, ffi::AnyBuffer shortcut, ffi::AnyBuffer threshold,
                                     ffi::AnyBuffer flip, JAXBNN_BCONV2D_ATTR_PARAMS, int64_t shortcut_stride,
                                     int64_t shift, ffi::Result<ffi::AnyBuffer> stream,
                                     ffi::Result<ffi::AnyBuffer> bits) {
  return Bconv2dResidual(T == ffi::DataType::S16 ? "jaxbnn_bconv2d_residual_i16_bits" : "jaxbnn_bconv2d_residual_bits",
                         T, pool, x, w, w_tap_popcount, shortcut, {&threshold, &flip}, JAXBNN_BCONV2D_ATTRS,
                         shortcut_stride, shift, *stream, &(*bits));
}

// Binds the attributes of docs/ops.md in order.
template <class Binding>
auto BindBconv2dAttrs(Binding binding) {
  return std::move(binding).template Attr<int64_t>("c")
      .template Attr<int64_t>("o")
      .template Attr<int64_t>("kh")
      .template Attr<int64_t>("kw")
      .template Attr<int64_t>("stride_h")
      .template Attr<int64_t>("stride_w")
      .template Attr<int64_t>("pad_top")
      .template Attr<int64_t>("pad_bottom")
      .template Attr<int64_t>("pad_left")
      .template Attr<int64_t>("pad_right")
      .template Attr<bool>("pad_one")
      .template Attr<int64_t>("pool_h")
      .template Attr<int64_t>("pool_w");
}

// The first layer: `stream` (of `stream_type`) and / or `bits` (with threshold and flip) written, the other null.
ffi::Error ImageConv2d(std::string_view target, ffi::ThreadPool pool, ffi::AnyBuffer levels, ffi::AnyBuffer kernel,
                       ffi::AnyBuffer kernel_masks, ffi::AnyBuffer kernel_counts, const ffi::AnyBuffer* threshold,
                       const ffi::AnyBuffer* flip, const ImageConv2dAttrs& attrs, ffi::AnyBuffer* stream,
                       ffi::DataType stream_type, ffi::AnyBuffer* bits) {
  ImageConv2dProblem problem;
  if (auto error =
          CheckImageConv2d(target, levels, kernel, threshold, flip, attrs, stream, stream_type, bits, &problem);
      error.failure()) {
    return error;
  }
  int64_t mask_planes = 0;
  if (auto error = CheckImageKernelMasks(target, kernel_masks, kernel_counts, problem, &mask_planes);
      error.failure()) {
    return error;
  }
  ImageKernelMasks masks;
  if (mask_planes > 0) {
    const auto* words = static_cast<const uint32_t*>(kernel_masks.untyped_data());
    const auto* counts = static_cast<const int32_t*>(kernel_counts.untyped_data());
    masks.words = formats::CeilDiv(problem.n, 16);
    masks.plus = words;
    masks.plus_count = counts;
    if (mask_planes == 2) {
      masks.minus = words + 2 * formats::CeilDiv(problem.kh * problem.kw * problem.c, 4) * masks.words;
      masks.minus_count = counts + problem.n;
    }
  }
  const ImageOutputs outputs{stream == nullptr ? nullptr : stream->untyped_data(),
                             bits == nullptr ? nullptr : static_cast<uint32_t*>(bits->untyped_data())};
  return Guarded(target, [&] {
    RunImageConv2d(problem, static_cast<const int8_t*>(levels.untyped_data()),
                   static_cast<const int8_t*>(kernel.untyped_data()), masks,
                   threshold == nullptr ? nullptr : static_cast<const int32_t*>(threshold->untyped_data()),
                   flip == nullptr ? nullptr : static_cast<const uint8_t*>(flip->untyped_data()), outputs, &pool);
  });
}

#define JAXBNN_IMAGE_ATTR_PARAMS                                                                              \
  int64_t c, int64_t n, int64_t kh, int64_t kw, int64_t stride_h, int64_t stride_w, int64_t pad_top,           \
      int64_t pad_bottom, int64_t pad_left, int64_t pad_right, int64_t pool_h, int64_t pool_w

// Every first-layer target takes the kernel's masks operands (CheckImageKernelMasks) after the kernel.
#define JAXBNN_MASK_PARAMS ffi::AnyBuffer kernel_masks, ffi::AnyBuffer kernel_counts
#define JAXBNN_MASKS kernel_masks, kernel_counts

#define JAXBNN_IMAGE_ATTRS(shift) \
  ImageConv2dAttrs { c, n, kh, kw, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right, pool_h, pool_w, shift }

ffi::Error ImageConv2dI32(ffi::ThreadPool pool, ffi::AnyBuffer levels, ffi::AnyBuffer kernel, JAXBNN_MASK_PARAMS,
                          JAXBNN_IMAGE_ATTR_PARAMS, int64_t shift, ffi::Result<ffi::AnyBuffer> out) {
  return ImageConv2d("jaxbnn_image_conv2d_i32", pool, levels, kernel, JAXBNN_MASKS, nullptr, nullptr,
                     JAXBNN_IMAGE_ATTRS(shift),
                     &(*out), ffi::DataType::S32, nullptr);
}

ffi::Error ImageConv2dI16(ffi::ThreadPool pool, ffi::AnyBuffer levels, ffi::AnyBuffer kernel, JAXBNN_MASK_PARAMS,
                          JAXBNN_IMAGE_ATTR_PARAMS, int64_t shift, ffi::Result<ffi::AnyBuffer> out) {
  return ImageConv2d("jaxbnn_image_conv2d_i16", pool, levels, kernel, JAXBNN_MASKS, nullptr, nullptr,
                     JAXBNN_IMAGE_ATTRS(shift),
                     &(*out), ffi::DataType::S16, nullptr);
}

ffi::Error ImageConv2dBits(ffi::ThreadPool pool, ffi::AnyBuffer levels, ffi::AnyBuffer kernel, JAXBNN_MASK_PARAMS,
                           ffi::AnyBuffer threshold, ffi::AnyBuffer flip, JAXBNN_IMAGE_ATTR_PARAMS,
                           ffi::Result<ffi::AnyBuffer> out) {
  return ImageConv2d("jaxbnn_image_conv2d_bits", pool, levels, kernel, JAXBNN_MASKS, &threshold, &flip,
                     JAXBNN_IMAGE_ATTRS(0),
                     nullptr, ffi::DataType::S32, &(*out));
}

ffi::Error ImageConv2dI32Bits(ffi::ThreadPool pool, ffi::AnyBuffer levels, ffi::AnyBuffer kernel,
                              JAXBNN_MASK_PARAMS, ffi::AnyBuffer threshold, ffi::AnyBuffer flip,
                              JAXBNN_IMAGE_ATTR_PARAMS, int64_t shift,
                              ffi::Result<ffi::AnyBuffer> stream, ffi::Result<ffi::AnyBuffer> bits) {
  return ImageConv2d("jaxbnn_image_conv2d_i32_bits", pool, levels, kernel, JAXBNN_MASKS, &threshold, &flip,
                     JAXBNN_IMAGE_ATTRS(shift), &(*stream), ffi::DataType::S32, &(*bits));
}

ffi::Error ImageConv2dI16Bits(ffi::ThreadPool pool, ffi::AnyBuffer levels, ffi::AnyBuffer kernel,
                              JAXBNN_MASK_PARAMS, ffi::AnyBuffer threshold, ffi::AnyBuffer flip,
                              JAXBNN_IMAGE_ATTR_PARAMS, int64_t shift,
                              ffi::Result<ffi::AnyBuffer> stream, ffi::Result<ffi::AnyBuffer> bits) {
  return ImageConv2d("jaxbnn_image_conv2d_i16_bits", pool, levels, kernel, JAXBNN_MASKS, &threshold, &flip,
                     JAXBNN_IMAGE_ATTRS(shift), &(*stream), ffi::DataType::S16, &(*bits));
}

#undef JAXBNN_IMAGE_ATTRS
#undef JAXBNN_MASKS
#undef JAXBNN_MASK_PARAMS
#undef JAXBNN_IMAGE_ATTR_PARAMS

template <class Binding>
auto BindImageAttrs(Binding binding) {
  return std::move(binding).template Attr<int64_t>("c")
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("kh")
      .template Attr<int64_t>("kw")
      .template Attr<int64_t>("stride_h")
      .template Attr<int64_t>("stride_w")
      .template Attr<int64_t>("pad_top")
      .template Attr<int64_t>("pad_bottom")
      .template Attr<int64_t>("pad_left")
      .template Attr<int64_t>("pad_right")
      .template Attr<int64_t>("pool_h")
      .template Attr<int64_t>("pool_w");
}

// The binding of a residual convolution: x, w, w_tap_popcount, shortcut [, threshold, flip], the conv's
// attributes, shortcut_stride and shift; the stream [and its bits].
template <bool kBits>
auto BindResidual() {
  using ffi::AnyBuffer;
  if constexpr (kBits) {
    return BindBconv2dAttrs(ffi::Ffi::Bind()
                                .Ctx<ffi::ThreadPool>()
                                .Arg<AnyBuffer>()   // x
                                .Arg<AnyBuffer>()   // w
                                .Arg<AnyBuffer>()   // w_tap_popcount
                                .Arg<AnyBuffer>()   // shortcut
                                .Arg<AnyBuffer>()   // threshold
                                .Arg<AnyBuffer>())  // flip
        .Attr<int64_t>("shortcut_stride")
        .Attr<int64_t>("shift")
        .Ret<AnyBuffer>()   // stream
        .Ret<AnyBuffer>();  // bits
  } else {
    return BindBconv2dAttrs(ffi::Ffi::Bind()
                                .Ctx<ffi::ThreadPool>()
                                .Arg<AnyBuffer>()   // x
                                .Arg<AnyBuffer>()   // w
                                .Arg<AnyBuffer>()   // w_tap_popcount
                                .Arg<AnyBuffer>())  // shortcut
        .Attr<int64_t>("shortcut_stride")
        .Attr<int64_t>("shift")
        .Ret<AnyBuffer>();  // stream
  }
}

// The binding of a first layer writing the stream (levels, kernel, kernel_masks, kernel_counts, its attributes
// and shift), the bits (the same operands, threshold, flip and its attributes) or both (the bits' operands,
// + shift).
enum class ImageOutputsOf { kStream, kBits, kStreamAndBits };

template <ImageOutputsOf kOutputs>
auto BindImageConv2d() {
  using ffi::AnyBuffer;
  if constexpr (kOutputs == ImageOutputsOf::kStream) {
    return BindImageAttrs(ffi::Ffi::Bind()
                              .Ctx<ffi::ThreadPool>()
                              .Arg<AnyBuffer>()   // levels
                              .Arg<AnyBuffer>()   // kernel
                              .Arg<AnyBuffer>()   // kernel_masks
                              .Arg<AnyBuffer>())  // kernel_counts
        .Attr<int64_t>("shift")
        .Ret<AnyBuffer>();
  } else if constexpr (kOutputs == ImageOutputsOf::kBits) {
    return BindImageAttrs(ffi::Ffi::Bind()
                              .Ctx<ffi::ThreadPool>()
                              .Arg<AnyBuffer>()   // levels
                              .Arg<AnyBuffer>()   // kernel
                              .Arg<AnyBuffer>()   // kernel_masks
                              .Arg<AnyBuffer>()   // kernel_counts
                              .Arg<AnyBuffer>()   // threshold
                              .Arg<AnyBuffer>())  // flip
        .Ret<AnyBuffer>();
  } else {
    return BindImageAttrs(ffi::Ffi::Bind()
                              .Ctx<ffi::ThreadPool>()
                              .Arg<AnyBuffer>()   // levels
                              .Arg<AnyBuffer>()   // kernel
                              .Arg<AnyBuffer>()   // kernel_masks
                              .Arg<AnyBuffer>()   // kernel_counts
                              .Arg<AnyBuffer>()   // threshold
                              .Arg<AnyBuffer>())  // flip
        .Attr<int64_t>("shift")
        .Ret<AnyBuffer>()   // stream
        .Ret<AnyBuffer>();  // bits
  }
}

const uint32_t* Words(const ffi::AnyBuffer* buffer) {
  return buffer == nullptr ? nullptr : static_cast<const uint32_t*>(buffer->untyped_data());
}

const int32_t* Popcounts(const ffi::AnyBuffer* buffer) {
  return buffer == nullptr ? nullptr : static_cast<const int32_t*>(buffer->untyped_data());
}

ffi::Error MixedBmm(std::string_view target, Mix mix, Epilogue kind, ffi::ThreadPool pool,
                    const MixedOperands& operands, EpilogueOperands epilogue, int64_t k, int64_t n,
                    ffi::AnyBuffer out) {
  BmmProblem problem;
  if (auto error = CheckMixedBmm(target, kind, operands, epilogue, k, n, out, &problem); error.failure()) {
    return error;
  }
  return Guarded(target, [&] {
    RunMixedBmm(mix, problem, ActivationPlanes{Words(operands.x)}, Words(operands.w),
                Popcounts(operands.w_popcount), EpilogueDataOf(kind, epilogue), out.untyped_data(), &pool);
  });
}

ffi::Error MixedConv2d(std::string_view target, Mix mix, Epilogue kind, ffi::ThreadPool pool,
                       const MixedOperands& operands, EpilogueOperands epilogue, const Bconv2dAttrs& attrs,
                       ffi::AnyBuffer out) {
  Bconv2dProblem problem;
  if (auto error = CheckMixedConv2d(target, kind, operands, epilogue, attrs, out, &problem); error.failure()) {
    return error;
  }
  return Guarded(target, [&] {
    RunMixedConv2d(mix, problem, ActivationPlanes{Words(operands.x)},
                   Words(operands.w), Popcounts(operands.w_popcount), EpilogueDataOf(kind, epilogue),
                   out.untyped_data(), &pool);
  });
}

// The residual epilogue of a ternary or mixed convolution over an int16 stream (as Bconv2dResidual).
ffi::Error MixedConv2dResidual(std::string_view target, Mix mix, ffi::ThreadPool pool, const MixedOperands& operands,
                               ffi::AnyBuffer shortcut, EpilogueOperands threshold, const Bconv2dAttrs& attrs,
                               int64_t shortcut_stride, int64_t shift, ffi::AnyBuffer stream, ffi::AnyBuffer* bits) {
  Bconv2dProblem problem;
  EpilogueData epilogue;
  if (auto error = CheckMixedConv2d(target, Epilogue::kInt32, operands, {}, attrs, stream, &problem,
                                    ffi::DataType::S16);
      error.failure()) {
    return error;
  }
  if (auto error = ResidualEpilogue(target, ffi::DataType::S16, problem, shortcut, threshold, shortcut_stride, shift,
                                    bits, &epilogue);
      error.failure()) {
    return error;
  }
  return Guarded(target, [&] {
    RunMixedConv2d(mix, problem, ActivationPlanes{Words(operands.x)},
                   Words(operands.w), Popcounts(operands.w_popcount), epilogue, stream.untyped_data(), &pool);
  });
}

// The operands of each mode (docs/ops.md): ternary activations as one operand of both planes, BTN's weights
// with their popcounts.
#define JAXBNN_MIXED_PARAMS_tnn ffi::AnyBuffer x, ffi::AnyBuffer w
#define JAXBNN_MIXED_OPERANDS_tnn MixedOperands{&x, true, &w, nullptr, true}
#define JAXBNN_MIXED_PARAMS_tbn ffi::AnyBuffer x, ffi::AnyBuffer w
#define JAXBNN_MIXED_OPERANDS_tbn MixedOperands{&x, true, &w, nullptr, false}
#define JAXBNN_MIXED_PARAMS_btn ffi::AnyBuffer a, ffi::AnyBuffer w, ffi::AnyBuffer w_popcount
#define JAXBNN_MIXED_OPERANDS_btn MixedOperands{&a, false, &w, &w_popcount, true}
#define JAXBNN_EPILOGUE_PARAMS_i32
#define JAXBNN_EPILOGUE_OPERANDS_i32 EpilogueOperands{}
#define JAXBNN_EPILOGUE_PARAMS_f32 , ffi::AnyBuffer scale, ffi::AnyBuffer bias
#define JAXBNN_EPILOGUE_OPERANDS_f32 EpilogueOperands{&scale, &bias}
#define JAXBNN_EPILOGUE_PARAMS_bits , ffi::AnyBuffer threshold, ffi::AnyBuffer flip
#define JAXBNN_EPILOGUE_OPERANDS_bits EpilogueOperands{&threshold, &flip}
#define JAXBNN_EPILOGUE_KIND_i32 Epilogue::kInt32
#define JAXBNN_EPILOGUE_KIND_f32 Epilogue::kAffine
#define JAXBNN_EPILOGUE_KIND_bits Epilogue::kThreshold

#define JAXBNN_DEFINE_MIXED(mode, Mode, epi, Epi)                                                                  \
  ffi::Error Mode##Bmm##Epi(ffi::ThreadPool pool, JAXBNN_MIXED_PARAMS_##mode JAXBNN_EPILOGUE_PARAMS_##epi,        \
                            int64_t k, int64_t n, ffi::Result<ffi::AnyBuffer> out) {                              \
    return MixedBmm("jaxbnn_" #mode "_bmm_" #epi, Mix::k##Mode, JAXBNN_EPILOGUE_KIND_##epi, pool,                \
                    JAXBNN_MIXED_OPERANDS_##mode, JAXBNN_EPILOGUE_OPERANDS_##epi, k, n, *out);                    \
  }                                                                                                               \
  ffi::Error Mode##Conv2d##Epi(ffi::ThreadPool pool, JAXBNN_MIXED_PARAMS_##mode JAXBNN_EPILOGUE_PARAMS_##epi,     \
                               int64_t c, int64_t o, int64_t kh, int64_t kw, int64_t stride_h, int64_t stride_w,  \
                               int64_t pad_top, int64_t pad_bottom, int64_t pad_left, int64_t pad_right,         \
                               bool pad_one, int64_t pool_h, int64_t pool_w, ffi::Result<ffi::AnyBuffer> out) {   \
    return MixedConv2d("jaxbnn_" #mode "_conv2d_" #epi, Mix::k##Mode, JAXBNN_EPILOGUE_KIND_##epi, pool,          \
                       JAXBNN_MIXED_OPERANDS_##mode, JAXBNN_EPILOGUE_OPERANDS_##epi,                               \
                       Bconv2dAttrs{c, o, kh, kw, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right,   \
                                    pad_one, pool_h, pool_w},                                                     \
                       *out);                                                                                     \
  }
JAXBNN_MIXED_TARGETS(JAXBNN_DEFINE_MIXED)
#undef JAXBNN_DEFINE_MIXED

#define JAXBNN_DEFINE_MIXED_RESIDUAL(mode, Mode)                                                                 \
  ffi::Error Mode##Conv2dResidualI16(ffi::ThreadPool pool, JAXBNN_MIXED_PARAMS_##mode, ffi::AnyBuffer shortcut, \
                                     JAXBNN_BCONV2D_ATTR_PARAMS, int64_t shortcut_stride, int64_t shift,         \
                                     ffi::Result<ffi::AnyBuffer> stream) {                                        \
    return MixedConv2dResidual("jaxbnn_" #mode "_conv2d_residual_i16", Mix::k##Mode, pool,                      \
                               JAXBNN_MIXED_OPERANDS_##mode, shortcut, {}, JAXBNN_BCONV2D_ATTRS, shortcut_stride, \
                               shift, *stream, nullptr);                                                          \
  }                                                                                                               \
  ffi::Error Mode##Conv2dResidualI16Bits(ffi::ThreadPool pool, JAXBNN_MIXED_PARAMS_##mode, ffi::AnyBuffer shortcut, \
                                         ffi::AnyBuffer threshold, ffi::AnyBuffer flip, JAXBNN_BCONV2D_ATTR_PARAMS,  \
                                         int64_t shortcut_stride, int64_t shift, ffi::Result<ffi::AnyBuffer> stream, \
                                         ffi::Result<ffi::AnyBuffer> bits) {                                        \
    return MixedConv2dResidual("jaxbnn_" #mode "_conv2d_residual_i16_bits", Mix::k##Mode, pool,                    \
                               JAXBNN_MIXED_OPERANDS_##mode, shortcut, {&threshold, &flip}, JAXBNN_BCONV2D_ATTRS,   \
                               shortcut_stride, shift, *stream, &(*bits));                                          \
  }
JAXBNN_MIXED_RESIDUAL_TARGETS(JAXBNN_DEFINE_MIXED_RESIDUAL)
#undef JAXBNN_DEFINE_MIXED_RESIDUAL
#undef JAXBNN_BCONV2D_ATTRS
#undef JAXBNN_BCONV2D_ATTR_PARAMS

ffi::Error GlobalSumBits(ffi::ThreadPool pool, ffi::AnyBuffer stream, ffi::AnyBuffer threshold, ffi::AnyBuffer flip,
                         ffi::Result<ffi::AnyBuffer> out) {
  using namespace checks;
  constexpr std::string_view target = "jaxbnn_global_sum_bits";
  const auto dims = stream.dimensions();
  if ((stream.element_type() != ffi::DataType::S16 && stream.element_type() != ffi::DataType::S32) ||
      dims.size() != 4 || dims[3] < 1) {
    return Invalid(target, Concat("stream must be int16 or int32 of rank 4 (B, H, W, C) with C >= 1, got ",
                                  DtypeName(stream.element_type()), " of shape ", ShapeString(dims)));
  }
  if (auto error = CheckDtypeRank(target, "threshold", threshold, ffi::DataType::S32, 2, "(planes, C)");
      error.failure()) {
    return error;
  }
  const int64_t planes = threshold.dimensions()[0], channels = dims[3], words = (channels + 31) / 32;
  if (planes < 1 || planes > kMaxThresholdPlanes) {
    return Invalid(target, Concat("threshold must have 1 to ", kMaxThresholdPlanes, " planes, got ", planes));
  }
  if (auto error = CheckShape(target, "threshold", threshold, {planes, channels}, "the stream's channels");
      error.failure()) {
    return error;
  }
  if (auto error = CheckDtypeRank(target, "flip", flip, ffi::DataType::U8, 2, "(planes, C)"); error.failure()) {
    return error;
  }
  if (auto error = CheckShape(target, "flip", flip, {planes, channels}, "the threshold"); error.failure()) {
    return error;
  }
  if (auto error = CheckDtypeRank(target, "result", *out, ffi::DataType::U32, 3, "(B, planes, words)");
      error.failure()) {
    return error;
  }
  if (auto error = CheckShape(target, "result", *out, {dims[0], planes, words}, "the stream and threshold");
      error.failure()) {
    return error;
  }
  GlobalSumProblem problem;
  problem.stream = stream.untyped_data();
  problem.narrow = stream.element_type() == ffi::DataType::S16;
  problem.threshold = static_cast<const int32_t*>(threshold.untyped_data());
  problem.flip = static_cast<const uint8_t*>(flip.untyped_data());
  problem.bits = static_cast<uint32_t*>(out->untyped_data());
  problem.batch = dims[0];
  problem.pixels = dims[1] * dims[2];
  problem.channels = channels;
  problem.planes = planes;
  return Guarded(target, [&] { RunGlobalSumBits(problem, &pool); });
}

}  // namespace
}  // namespace jaxbnn::cpu

namespace ffi = xla::ffi;
using ffi::AnyBuffer;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBmmI32, jaxbnn::cpu::BmmI32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<AnyBuffer>()  // a
                                  .Arg<AnyBuffer>()  // b
                                  .Arg<AnyBuffer>()  // b_popcount
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Ret<AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBmmF32, jaxbnn::cpu::BmmF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<AnyBuffer>()  // a
                                  .Arg<AnyBuffer>()  // b
                                  .Arg<AnyBuffer>()  // b_popcount
                                  .Arg<AnyBuffer>()  // scale
                                  .Arg<AnyBuffer>()  // bias
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Ret<AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBmmBits, jaxbnn::cpu::BmmBits,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<AnyBuffer>()  // a
                                  .Arg<AnyBuffer>()  // b
                                  .Arg<AnyBuffer>()  // b_popcount
                                  .Arg<AnyBuffer>()  // threshold
                                  .Arg<AnyBuffer>()  // flip
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Ret<AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBmmChainF32, jaxbnn::cpu::BmmChainF32, jaxbnn::cpu::BindBmmChain());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBmmChainBits, jaxbnn::cpu::BmmChainBits, jaxbnn::cpu::BindBmmChain());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBconv2dI32, jaxbnn::cpu::Bconv2dI32,
                              jaxbnn::cpu::BindBconv2dAttrs(ffi::Ffi::Bind()
                                                                .Ctx<ffi::ThreadPool>()
                                                                .Arg<AnyBuffer>()   // x
                                                                .Arg<AnyBuffer>()   // w
                                                                .Arg<AnyBuffer>())  // w_tap_popcount
                                  .Ret<AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBconv2dF32, jaxbnn::cpu::Bconv2dF32,
                              jaxbnn::cpu::BindBconv2dAttrs(ffi::Ffi::Bind()
                                                                .Ctx<ffi::ThreadPool>()
                                                                .Arg<AnyBuffer>()   // x
                                                                .Arg<AnyBuffer>()   // w
                                                                .Arg<AnyBuffer>()   // w_tap_popcount
                                                                .Arg<AnyBuffer>()   // scale
                                                                .Arg<AnyBuffer>())  // bias
                                  .Ret<AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBconv2dBits, jaxbnn::cpu::Bconv2dBits,
                              jaxbnn::cpu::BindBconv2dAttrs(ffi::Ffi::Bind()
                                                                .Ctx<ffi::ThreadPool>()
                                                                .Arg<AnyBuffer>()   // x
                                                                .Arg<AnyBuffer>()   // w
                                                                .Arg<AnyBuffer>()   // w_tap_popcount
                                                                .Arg<AnyBuffer>()   // threshold
                                                                .Arg<AnyBuffer>())  // flip
                                  .Ret<AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBconv2dResidualI32, (jaxbnn::cpu::Bconv2dResidualStream<ffi::DataType::S32>),
                              jaxbnn::cpu::BindResidual</*kBits=*/false>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBconv2dResidualBits, (jaxbnn::cpu::Bconv2dResidualStreamBits<ffi::DataType::S32>),
                              jaxbnn::cpu::BindResidual</*kBits=*/true>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBconv2dResidualI16, (jaxbnn::cpu::Bconv2dResidualStream<ffi::DataType::S16>),
                              jaxbnn::cpu::BindResidual</*kBits=*/false>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuBconv2dResidualI16Bits, (jaxbnn::cpu::Bconv2dResidualStreamBits<ffi::DataType::S16>),
                              jaxbnn::cpu::BindResidual</*kBits=*/true>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuImageConv2dI32, jaxbnn::cpu::ImageConv2dI32,
                              jaxbnn::cpu::BindImageConv2d<jaxbnn::cpu::ImageOutputsOf::kStream>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuImageConv2dI16, jaxbnn::cpu::ImageConv2dI16,
                              jaxbnn::cpu::BindImageConv2d<jaxbnn::cpu::ImageOutputsOf::kStream>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuImageConv2dBits, jaxbnn::cpu::ImageConv2dBits,
                              jaxbnn::cpu::BindImageConv2d<jaxbnn::cpu::ImageOutputsOf::kBits>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuImageConv2dI32Bits, jaxbnn::cpu::ImageConv2dI32Bits,
                              jaxbnn::cpu::BindImageConv2d<jaxbnn::cpu::ImageOutputsOf::kStreamAndBits>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuImageConv2dI16Bits, jaxbnn::cpu::ImageConv2dI16Bits,
                              jaxbnn::cpu::BindImageConv2d<jaxbnn::cpu::ImageOutputsOf::kStreamAndBits>());

// The buffer operands of each mode and epilogue, in the order of the handlers' parameters.
#define JAXBNN_MIXED_ARGS_tnn .Arg<AnyBuffer>().Arg<AnyBuffer>()
#define JAXBNN_MIXED_ARGS_tbn .Arg<AnyBuffer>().Arg<AnyBuffer>()
#define JAXBNN_MIXED_ARGS_btn .Arg<AnyBuffer>().Arg<AnyBuffer>().Arg<AnyBuffer>()
#define JAXBNN_EPILOGUE_ARGS_i32
#define JAXBNN_EPILOGUE_ARGS_f32 .Arg<AnyBuffer>().Arg<AnyBuffer>()
#define JAXBNN_EPILOGUE_ARGS_bits .Arg<AnyBuffer>().Arg<AnyBuffer>()

#define JAXBNN_BIND_MIXED(mode, Mode, epi, Epi)                                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpu##Mode##Bmm##Epi, jaxbnn::cpu::Mode##Bmm##Epi,                          \
                                ffi::Ffi::Bind()                                                                \
                                    .Ctx<ffi::ThreadPool>() JAXBNN_MIXED_ARGS_##mode JAXBNN_EPILOGUE_ARGS_##epi \
                                    .Attr<int64_t>("k")                                                         \
                                    .Attr<int64_t>("n")                                                         \
                                    .Ret<AnyBuffer>());                                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                                \
      JaxbnnCpu##Mode##Conv2d##Epi, jaxbnn::cpu::Mode##Conv2d##Epi,                                             \
      jaxbnn::cpu::BindBconv2dAttrs(                                                                            \
          ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() JAXBNN_MIXED_ARGS_##mode JAXBNN_EPILOGUE_ARGS_##epi)          \
          .Ret<AnyBuffer>());
JAXBNN_MIXED_TARGETS(JAXBNN_BIND_MIXED)
#undef JAXBNN_BIND_MIXED

#define JAXBNN_BIND_MIXED_RESIDUAL(mode, Mode)                                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpu##Mode##Conv2dResidualI16, jaxbnn::cpu::Mode##Conv2dResidualI16,        \
                                jaxbnn::cpu::BindBconv2dAttrs(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()               \
                                                                  JAXBNN_MIXED_ARGS_##mode.Arg<AnyBuffer>())       \
                                    .Attr<int64_t>("shortcut_stride")                                               \
                                    .Attr<int64_t>("shift")                                                         \
                                    .Ret<AnyBuffer>());                                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpu##Mode##Conv2dResidualI16Bits, jaxbnn::cpu::Mode##Conv2dResidualI16Bits, \
                                jaxbnn::cpu::BindBconv2dAttrs(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()               \
                                                                  JAXBNN_MIXED_ARGS_##mode.Arg<AnyBuffer>()        \
                                                                      .Arg<AnyBuffer>()                             \
                                                                      .Arg<AnyBuffer>())                            \
                                    .Attr<int64_t>("shortcut_stride")                                               \
                                    .Attr<int64_t>("shift")                                                         \
                                    .Ret<AnyBuffer>()                                                               \
                                    .Ret<AnyBuffer>());
JAXBNN_MIXED_RESIDUAL_TARGETS(JAXBNN_BIND_MIXED_RESIDUAL)
#undef JAXBNN_BIND_MIXED_RESIDUAL

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCpuGlobalSumBits, jaxbnn::cpu::GlobalSumBits,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<AnyBuffer>()  // stream
                                  .Arg<AnyBuffer>()  // threshold
                                  .Arg<AnyBuffer>()  // flip
                                  .Ret<AnyBuffer>());
