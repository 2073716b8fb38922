// Validation of the jaxbnn_image_conv2d_{i32,i16,bits,i32_bits,i16_bits} FFI calls (docs/ops.md "Native contract"): the first
// layer, int8 image levels (or the uint8 pixels they come from) times int8 weight values. Header-only on top
// of common/checks.h and free of CPU code, so that another backend's handlers can refuse the same calls with
// the same messages.
#ifndef JAXBNN_XLA_FFI_CPU_IMAGE_CHECKS_H_
#define JAXBNN_XLA_FFI_CPU_IMAGE_CHECKS_H_

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

#include "common/checks.h"
#include "xla/ffi/api/ffi.h"

namespace jaxbnn {

// The attributes of a jaxbnn_image_conv2d_* call, as named in docs/ops.md (shift: the calls writing the stream).
struct ImageConv2dAttrs {
  int64_t c, n, kh, kw, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right, pool_h, pool_w, shift;
};

// A validated image_conv2d call on int8 levels or uint8 pixels (batch, height, width, c) and an int8 HWIO
// kernel.
struct ImageConv2dProblem {
  int64_t batch, height, width, c, n;
  int64_t kh, kw, stride_h, stride_w, pad_top, pad_left;
  int64_t pool_h, pool_w;
  int64_t out_h, out_w;  // after pooling
  int64_t planes;        // threshold planes of the bits output; 0 without one
  int64_t shift;         // of the stream output
  bool pixels;           // the operand holds uint8 pixels p, whose levels p - 128 (p XOR 0x80) the layer takes
  bool narrow = false;   // the stream output is int16 (its values' low 16 bits)
};

namespace checks {

// int8 x int8 products reach 2**14 in magnitude: this many of them always sum within int32.
inline constexpr int64_t kMaxImageReduction = std::numeric_limits<int32_t>::max() / (int64_t{1} << 14);

}  // namespace checks

// Validates a jaxbnn_image_conv2d_* call: `stream` the stream result of `stream_type` (int32 or int16), null
// for the bits alone; `threshold`, `flip` and the `bits` result null for the stream alone. On success fills
// `problem`.
inline ffi::Error CheckImageConv2d(std::string_view target, const ffi::AnyBuffer& levels,
                                   const ffi::AnyBuffer& kernel, const ffi::AnyBuffer* threshold,
                                   const ffi::AnyBuffer* flip, const ImageConv2dAttrs& attrs,
                                   const ffi::AnyBuffer* stream, ffi::DataType stream_type,
                                   const ffi::AnyBuffer* bits_out, ImageConv2dProblem* problem) {
  using namespace checks;
  const bool bits = threshold != nullptr;
  if (auto e = CheckConvAttrs(target,
                              {{"c", attrs.c}, {"n", attrs.n}, {"kh", attrs.kh}, {"kw", attrs.kw},
                               {"stride_h", attrs.stride_h}, {"stride_w", attrs.stride_w}, {"pool_h", attrs.pool_h},
                               {"pool_w", attrs.pool_w}},
                              {{"pad_top", attrs.pad_top}, {"pad_bottom", attrs.pad_bottom},
                               {"pad_left", attrs.pad_left}, {"pad_right", attrs.pad_right}});
      e.failure()) {
    return e;
  }
  if (stream != nullptr) {
    if (auto e = CheckAttrRange(target, "shift", attrs.shift, 0, 31); e.failure()) return e;
  }
  // kh, kw <= 2**31 - 1: their product fits int64.
  if (attrs.kh * attrs.kw > kMaxImageReduction / attrs.c) {
    return Invalid(target, "the reduction kh * kw * c = " + std::to_string(attrs.kh) + " * " +
                               std::to_string(attrs.kw) + " * " + std::to_string(attrs.c) + " exceeds " +
                               std::to_string(kMaxImageReduction) +
                               " int8 products, the most that always sum within int32");
  }

  const bool pixels = levels.element_type() == ffi::DataType::U8;
  if (!pixels && levels.element_type() != ffi::DataType::S8) {
    return Invalid(target, Concat("operand `levels` must be int8 levels or uint8 pixels (B, H, W, C), got ",
                                  DtypeName(levels.element_type())));
  }
  if (auto e = CheckDtypeRank(target, "operand `levels`", levels, pixels ? ffi::DataType::U8 : ffi::DataType::S8, 4,
                              "(B, H, W, C)");
      e.failure()) {
    return e;
  }
  auto dims = levels.dimensions();
  const int64_t batch = dims[0], height = dims[1], width = dims[2];
  std::string why_c = "c = " + std::to_string(attrs.c);
  if (auto e = CheckShape(target, "operand `levels`", levels, {batch, height, width, attrs.c}, why_c.c_str());
      e.failure()) {
    return e;
  }
  // Each term is at most int32's maximum: the sums fit int64.
  if (height > kMaxAttr || width > kMaxAttr) {
    return Invalid(target, "operand `levels` of shape " + ShapeString(dims) + " has an extent beyond int32");
  }
  const int64_t padded_h = height + attrs.pad_top + attrs.pad_bottom;
  const int64_t padded_w = width + attrs.pad_left + attrs.pad_right;
  if (padded_h > kMaxAttr || padded_w > kMaxAttr) {
    return Invalid(target, Concat("the padded image ", padded_h, " x ", padded_w, " has an extent beyond int32"));
  }
  if (padded_h < attrs.kh || padded_w < attrs.kw) {
    return Invalid(target, Concat("the kernel ", attrs.kh, " x ", attrs.kw, " is larger than the padded image ",
                                  padded_h, " x ", padded_w));
  }
  const int64_t out_h = ((padded_h - attrs.kh) / attrs.stride_h + 1) / attrs.pool_h;
  const int64_t out_w = ((padded_w - attrs.kw) / attrs.stride_w + 1) / attrs.pool_w;

  if (auto e = CheckDtypeRank(target, "operand `kernel`", kernel, ffi::DataType::S8, 4, "(KH, KW, C, N)");
      e.failure()) {
    return e;
  }
  std::string why_kernel = "kh = " + std::to_string(attrs.kh) + ", kw = " + std::to_string(attrs.kw) +
                           ", c = " + std::to_string(attrs.c) + ", n = " + std::to_string(attrs.n);
  if (auto e = CheckShape(target, "operand `kernel`", kernel, {attrs.kh, attrs.kw, attrs.c, attrs.n},
                          why_kernel.c_str());
      e.failure()) {
    return e;
  }

  int64_t planes = 0;
  if (bits) {
    if (auto e = CheckDtypeRank(target, "operand `threshold`", *threshold, ffi::DataType::S32, 2, "(P, N)");
        e.failure()) {
      return e;
    }
    planes = threshold->dimensions()[0];
    if (planes < 1 || planes > kMaxThresholdPlanes) {
      return Invalid(target, "operand `threshold` of shape " + ShapeString(threshold->dimensions()) + " has " +
                                 std::to_string(planes) + " planes; 1 to " + std::to_string(kMaxThresholdPlanes) +
                                 " are supported");
    }
    std::string why_n = "n = " + std::to_string(attrs.n) + " (one value per output channel)";
    if (auto e = CheckShape(target, "operand `threshold`", *threshold, {planes, attrs.n}, why_n.c_str());
        e.failure()) {
      return e;
    }
    if (auto e = CheckDtypeRank(target, "operand `flip`", *flip, ffi::DataType::U8, 2, "(P, N)"); e.failure()) {
      return e;
    }
    std::string why_flip = "operand `threshold` " + ShapeString(threshold->dimensions());
    if (auto e = CheckShape(target, "operand `flip`", *flip, {planes, attrs.n}, why_flip.c_str()); e.failure()) {
      return e;
    }
    if (auto e = CheckResult(target, Epilogue::kThreshold, *bits_out, {batch, out_h, out_w, planes}, attrs.n);
        e.failure()) {
      return e;
    }
  }
  if (stream != nullptr) {
    if (auto e = CheckResult(target, Epilogue::kInt32, *stream, {batch, out_h, out_w}, attrs.n, stream_type);
        e.failure()) {
      return e;
    }
  }
  *problem = ImageConv2dProblem{batch,         height,        width,       attrs.c,     attrs.n,
                                attrs.kh,      attrs.kw,      attrs.stride_h, attrs.stride_w, attrs.pad_top,
                                attrs.pad_left, attrs.pool_h, attrs.pool_w, out_h,       out_w,
                                planes,        stream != nullptr ? attrs.shift : 0, pixels,
                                stream != nullptr && stream_type == ffi::DataType::S16};
  return ffi::Error::Success();
}

// Validates the kernel masks operands of a jaxbnn_image_conv2d_* call on the CPU (`formats.image_kernel_masks`):
// `masks` uint32 (P, ceil(K / 4), ceil(N / 16), 2) and `counts` int32 (P, N), K = kh kw c, with P = 0 (no masks),
// 1 (a binary kernel's) or 2 (a ternary kernel's). On success sets `planes` to P.
inline ffi::Error CheckImageKernelMasks(std::string_view target, const ffi::AnyBuffer& masks,
                                        const ffi::AnyBuffer& counts, const ImageConv2dProblem& p, int64_t* planes) {
  using namespace checks;
  using formats::CeilDiv;
  if (auto e = CheckDtypeRank(target, "operand `kernel_masks`", masks, ffi::DataType::U32, 4, "(P, K/4, N/16, 2)");
      e.failure()) {
    return e;
  }
  const int64_t count = masks.dimensions()[0];
  if (count < 0 || count > 2) {
    return Invalid(target, Concat("operand `kernel_masks` of shape ", ShapeString(masks.dimensions()), " has ", count,
                                  " planes; 0 (none), 1 (a binary kernel's) or 2 (a ternary kernel's)"));
  }
  const int64_t k = p.kh * p.kw * p.c;
  std::string why = Concat("the kernel's K = ", k, ", N = ", p.n, " and ", count, " planes");
  if (auto e = CheckShape(target, "operand `kernel_masks`", masks, {count, CeilDiv(k, 4), CeilDiv(p.n, 16), 2},
                          why.c_str());
      e.failure()) {
    return e;
  }
  if (auto e = CheckDtypeRank(target, "operand `kernel_counts`", counts, ffi::DataType::S32, 2, "(P, N)");
      e.failure()) {
    return e;
  }
  if (auto e = CheckShape(target, "operand `kernel_counts`", counts, {count, p.n}, why.c_str()); e.failure()) {
    return e;
  }
  *planes = count;
  return ffi::Error::Success();
}

}  // namespace jaxbnn

#endif  // JAXBNN_XLA_FFI_CPU_IMAGE_CHECKS_H_
