// Validation of the FFI calls of docs/ops.md ("Native contract"), shared by the CPU and CUDA handlers so
// that both backends accept and refuse exactly the same calls with the same messages.
// Header-only; needs only the XLA FFI headers (no CUDA).
#ifndef JAXBNN_XLA_FFI_COMMON_CHECKS_H_
#define JAXBNN_XLA_FFI_COMMON_CHECKS_H_

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/formats.h"
#include "xla/ffi/api/ffi.h"

namespace jaxbnn {

namespace ffi = xla::ffi;

// kResidual: a residual block's second convolution (jaxbnn_bconv2d_residual_*): the stream (dot >> shift) +
// shortcut in the shortcut's type (int32 or int16), and with a threshold also the stream's packed bits.
enum class Epilogue { kInt32, kAffine, kThreshold, kResidual };

// The per-output-column operands of an epilogue: (scale, bias) for kAffine, (threshold, flip) for
// kThreshold (and a kResidual with bits), both null for kInt32.
struct EpilogueOperands {
  const ffi::AnyBuffer* first = nullptr;
  const ffi::AnyBuffer* second = nullptr;
};

// A validated bmm call: a (m, k_words) x FSB tiles (n_tiles, k_tiles, tile_rows, tile_words).
struct BmmProblem {
  int64_t m, k, n, k_words;
  int64_t n_tiles, k_tiles, tile_rows, tile_words;
  Epilogue epilogue;
};

// A validated bconv2d call on a packed NHWC image (batch, height, width, c_words).
struct Bconv2dProblem {
  int64_t batch, height, width, c, c_words, o;
  int64_t kh, kw, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right;
  bool pad_one;
  int64_t pool_h, pool_w;
  int64_t conv_h, conv_w;  // before pooling
  int64_t out_h, out_w;    // after pooling
  int64_t k_words;         // kh * kw * c_words: the words of one reduction row
  int64_t o_tiles, k_tiles, tile_rows, tile_words;
  Epilogue epilogue;
};

namespace checks {

// Largest reduction length: dot products must fit int32.
inline constexpr int64_t kMaxReduction = std::numeric_limits<int32_t>::max();
// Bound on every size attribute and extent: the kernels take them as int32, and sums and products of a
// few of them cannot overflow int64.
inline constexpr int64_t kMaxAttr = std::numeric_limits<int32_t>::max();
// Threshold planes of one threshold epilogue (a ternary output uses 2).
inline constexpr int64_t kMaxThresholdPlanes = 8;

// The product of non-negative factors, or -1 when a factor is negative or the product overflows int64.
inline int64_t CheckedProduct(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (int64_t factor : factors) {
    if (factor < 0 || __builtin_mul_overflow(product, factor, &product)) return -1;
  }
  return product;
}

inline const char* DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    default: return "an unsupported dtype";
  }
}

// Messages are built from strings and std::to_string, never iostreams: a module linked with a static C++
// runtime (-static-libstdc++, as some toolchains do) in a process that has loaded the shared one binds part
// of the locale machinery to each copy, and formatting through an ostream there crashes.
inline void AppendPiece(std::string& message, std::string_view piece) { message.append(piece); }

template <class Int, std::enable_if_t<std::is_integral_v<Int>, int> = 0>
void AppendPiece(std::string& message, Int value) {
  message += std::to_string(value);
}

template <class... Pieces>
std::string Concat(const Pieces&... pieces) {
  std::string message;
  (AppendPiece(message, pieces), ...);
  return message;
}

template <class Dims>
std::string ShapeString(const Dims& dims) {
  std::string s = "(";
  size_t i = 0;
  for (int64_t d : dims) s += Concat(i++ ? ", " : "", d);
  return s + (dims.size() == 1 ? ",)" : ")");
}

inline std::string ShapeString(std::initializer_list<int64_t> dims) { return ShapeString<>(dims); }

inline ffi::Error Invalid(std::string_view target, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + message);
}

// `what` ("operand `a`") must have dtype `dtype` and rank `rank`.
inline ffi::Error CheckDtypeRank(std::string_view target, const char* what, const ffi::AnyBuffer& buffer,
                                 ffi::DataType dtype, size_t rank, const char* layout) {
  if (buffer.element_type() != dtype || buffer.dimensions().size() != rank) {
    return Invalid(target, Concat(what, " must be ", DtypeName(dtype), " of rank ", rank, " ", layout, ", got ",
                                  DtypeName(buffer.element_type()), " of shape ", ShapeString(buffer.dimensions())));
  }
  return ffi::Error::Success();
}

// `what` must have exactly the shape `expected` (dtype and rank already checked).
inline ffi::Error CheckShape(std::string_view target, const char* what, const ffi::AnyBuffer& buffer,
                             std::initializer_list<int64_t> expected, const char* why) {
  auto dims = buffer.dimensions();
  bool same = dims.size() == expected.size();
  size_t i = 0;
  for (int64_t d : expected) same = same && dims[i++] == d;
  if (!same) {
    return Invalid(target,
                   Concat(what, " has shape ", ShapeString(dims), " but ", why, " requires ", ShapeString(expected)));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckAttrRange(std::string_view target, const char* name, int64_t value, int64_t lo,
                                 int64_t hi) {
  if (value < lo || value > hi) {
    return Invalid(target, Concat("attribute ", name, " = ", value, " is out of range [", lo, ", ", hi, "]"));
  }
  return ffi::Error::Success();
}

// The geometry attributes of a convolution target: channel counts, kernel, strides and pool in
// [1, kMaxAttr], paddings in [0, kMaxAttr]. `positive` names them as the target's attributes do.
inline ffi::Error CheckConvAttrs(std::string_view target,
                                 std::initializer_list<std::pair<const char*, int64_t>> positive,
                                 std::initializer_list<std::pair<const char*, int64_t>> paddings) {
  for (const auto& [name, value] : positive) {
    if (auto e = CheckAttrRange(target, name, value, 1, kMaxAttr); e.failure()) return e;
  }
  for (const auto& [name, value] : paddings) {
    if (auto e = CheckAttrRange(target, name, value, 0, kMaxAttr); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// The tile geometry of FSB weights (n_tiles, k_tiles, tile_rows, tile_words) must be able to hold a bit
// matrix of `rows` rows and `bits` reduction bits; see docs/formats.md "FSB tiles".
inline ffi::Error CheckFsbGeometry(std::string_view target, const char* what, const ffi::AnyBuffer& w,
                                   int64_t rows, int64_t bits, const char* rows_name) {
  auto dims = w.dimensions();
  int64_t tile_rows = dims[2], tile_words = dims[3];
  if (tile_rows < 1 || tile_words < 1) {
    return Invalid(target, std::string(what) + " has an empty tile " + ShapeString(dims) +
                               "; FSB tiles are (row tiles, reduction tiles, tile rows, tile words)");
  }
  int64_t tile_bits = tile_words * formats::kWordBits;
  std::string why = std::string("(") + rows_name + " = " + std::to_string(rows) + ", " +
                    std::to_string(bits) + " reduction bits, tile " + std::to_string(tile_rows) + " x " +
                    std::to_string(tile_bits) + " bits)";
  return CheckShape(target, what, w,
                    {formats::CeilDiv(rows, tile_rows), formats::CeilDiv(bits, tile_bits), tile_rows,
                     tile_words},
                    why.c_str());
}

inline ffi::Error CheckEpilogueOperands(std::string_view target, Epilogue epilogue,
                                        const EpilogueOperands& operands, int64_t columns,
                                        const char* columns_name) {
  if (epilogue == Epilogue::kInt32) return ffi::Error::Success();
  bool affine = epilogue == Epilogue::kAffine;
  const char* first = affine ? "operand `scale`" : "operand `threshold`";
  const char* second = affine ? "operand `bias`" : "operand `flip`";
  ffi::DataType first_dtype = affine ? ffi::DataType::F32 : ffi::DataType::S32;
  ffi::DataType second_dtype = affine ? ffi::DataType::F32 : ffi::DataType::U8;
  std::string why = std::string("one value per output column (") + columns_name + " = " +
                    std::to_string(columns) + ")";
  if (auto e = CheckDtypeRank(target, first, *operands.first, first_dtype, 1, "(N,)"); e.failure()) return e;
  if (auto e = CheckShape(target, first, *operands.first, {columns}, why.c_str()); e.failure()) return e;
  if (auto e = CheckDtypeRank(target, second, *operands.second, second_dtype, 1, "(N,)"); e.failure()) {
    return e;
  }
  return CheckShape(target, second, *operands.second, {columns}, why.c_str());
}

// The result buffer: integers of `int_type` (int32, or a narrower stream's type) / float32 (..., columns) or
// packed uint32 (..., ceil(columns / 32)).
inline ffi::Error CheckResult(std::string_view target, Epilogue epilogue, const ffi::AnyBuffer& out,
                              const std::vector<int64_t>& leading, int64_t columns,
                              ffi::DataType int_type = ffi::DataType::S32) {
  ffi::DataType dtype = epilogue == Epilogue::kInt32    ? int_type
                        : epilogue == Epilogue::kAffine ? ffi::DataType::F32
                                                        : ffi::DataType::U32;
  int64_t last = epilogue == Epilogue::kThreshold ? formats::WordsForBits(columns) : columns;
  if (out.element_type() != dtype) {
    return Invalid(target, std::string("result must be ") + DtypeName(dtype) + ", got " +
                               DtypeName(out.element_type()));
  }
  auto dims = out.dimensions();
  bool same = dims.size() == leading.size() + 1 && dims[dims.size() - 1] == last;
  size_t i = 0;
  for (int64_t d : leading) same = same && dims[i++] == d;
  if (!same) {
    return Invalid(target, Concat("result has shape ", ShapeString(dims), ", expected leading dims ",
                                  ShapeString(leading), " and a last dim of ", last));
  }
  return ffi::Error::Success();
}

// The threshold planes of a `_bits` call (every product's: a ternary output's two planes, and more): 0 where threshold and flip are (columns,) as in checks.h (one
// plane, no plane axis in the result), else P where they are (P, columns) (P planes, a plane axis before the
// words). Other epilogues: 0.
inline ffi::Error CheckThresholdPlanes(std::string_view target, Epilogue epilogue, const EpilogueOperands& operands,
                                       int64_t columns, const char* columns_name, int64_t* planes) {
  *planes = 0;
  if (epilogue != Epilogue::kThreshold || operands.first->dimensions().size() != 2) {
    return CheckEpilogueOperands(target, epilogue, operands, columns, columns_name);
  }
  const ffi::AnyBuffer& threshold = *operands.first;
  if (auto e = CheckDtypeRank(target, "operand `threshold`", threshold, ffi::DataType::S32, 2, "(P, N)");
      e.failure()) {
    return e;
  }
  const int64_t count = threshold.dimensions()[0];
  if (count < 1 || count > kMaxThresholdPlanes) {
    return Invalid(target, "operand `threshold` of shape " + ShapeString(threshold.dimensions()) + " has " +
                               std::to_string(count) + " planes; 1 to " + std::to_string(kMaxThresholdPlanes) +
                               " are supported");
  }
  std::string why = std::string("one value per output column (") + columns_name + " = " +
                    std::to_string(columns) + ") of each plane";
  if (auto e = CheckShape(target, "operand `threshold`", threshold, {count, columns}, why.c_str()); e.failure()) {
    return e;
  }
  if (auto e = CheckDtypeRank(target, "operand `flip`", *operands.second, ffi::DataType::U8, 2, "(P, N)");
      e.failure()) {
    return e;
  }
  if (auto e = CheckShape(target, "operand `flip`", *operands.second, {count, columns}, why.c_str()); e.failure()) {
    return e;
  }
  *planes = count;
  return ffi::Error::Success();
}

// The epilogue operands (threshold planes included, CheckThresholdPlanes) and the result they give:
// (leading..., columns), or with P threshold planes packed (leading..., P, ceil(columns / 32)).
inline ffi::Error CheckEpilogueAndResult(std::string_view target, Epilogue epilogue, const EpilogueOperands& operands,
                                         int64_t columns, const char* columns_name, const ffi::AnyBuffer& out,
                                         std::vector<int64_t> leading, ffi::DataType int_type = ffi::DataType::S32) {
  int64_t planes;
  if (auto e = CheckThresholdPlanes(target, epilogue, operands, columns, columns_name, &planes); e.failure()) return e;
  if (planes) leading.push_back(planes);
  return CheckResult(target, epilogue, out, leading, columns, int_type);
}

}  // namespace checks

// Validates a jaxbnn_bmm_{i32,f32,bits} call; on success fills `problem`.
inline ffi::Error CheckBmm(std::string_view target, Epilogue epilogue, const ffi::AnyBuffer& a,
                           const ffi::AnyBuffer& b, const ffi::AnyBuffer& b_popcount,
                           const EpilogueOperands& epilogue_operands, int64_t k, int64_t n,
                           const ffi::AnyBuffer& out, BmmProblem* problem) {
  using namespace checks;
  if (auto e = CheckAttrRange(target, "k", k, 0, kMaxReduction); e.failure()) return e;
  if (auto e = CheckAttrRange(target, "n", n, 0, kMaxAttr); e.failure()) return e;
  if (auto e = CheckDtypeRank(target, "operand `a`", a, ffi::DataType::U32, 2, "(M, ceil(k/32))");
      e.failure()) {
    return e;
  }
  int64_t m = a.dimensions()[0];
  int64_t k_words = formats::WordsForBits(k);
  std::string why_a = "k = " + std::to_string(k);
  if (auto e = CheckShape(target, "operand `a`", a, {m, k_words}, why_a.c_str()); e.failure()) return e;
  if (auto e = CheckDtypeRank(target, "operand `b`", b, ffi::DataType::U32, 4,
                              "(NT, KT, BH, BW/32) of FSB tiles");
      e.failure()) {
    return e;
  }
  if (auto e = CheckFsbGeometry(target, "operand `b`", b, n, k, "n"); e.failure()) return e;
  if (auto e = CheckDtypeRank(target, "operand `b_popcount`", b_popcount, ffi::DataType::S32, 1, "(N,)");
      e.failure()) {
    return e;
  }
  std::string why_n = "n = " + std::to_string(n);
  if (auto e = CheckShape(target, "operand `b_popcount`", b_popcount, {n}, why_n.c_str()); e.failure()) {
    return e;
  }
  if (auto e = CheckEpilogueAndResult(target, epilogue, epilogue_operands, n, "n", out, {m}); e.failure()) return e;
  auto b_dims = b.dimensions();
  *problem = BmmProblem{m, k, n, k_words, b_dims[0], b_dims[1], b_dims[2], b_dims[3], epilogue};
  return ffi::Error::Success();
}

// The attributes of a jaxbnn_bconv2d_* call, as named in docs/ops.md.
struct Bconv2dAttrs {
  int64_t c, o, kh, kw, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right;
  bool pad_one;
  int64_t pool_h, pool_w;
};

// Validates the geometry attributes of a convolution call and its packed NHWC image operand `x` (named
// `x_name`; `planes` > 0: ternary activations, (B, H, W, planes, ceil(c/32)), each pixel's planes side by
// side); on success fills the geometry fields of `problem` (every field but the weights' tile shape and the
// epilogue).
inline ffi::Error CheckConvInput(std::string_view target, const Bconv2dAttrs& attrs, const ffi::AnyBuffer& x,
                                 const char* x_name, Bconv2dProblem* problem, int64_t planes = 0) {
  using namespace checks;
  if (auto e = CheckConvAttrs(target,
                              {{"c", attrs.c}, {"o", attrs.o}, {"kh", attrs.kh}, {"kw", attrs.kw},
                               {"stride_h", attrs.stride_h}, {"stride_w", attrs.stride_w}, {"pool_h", attrs.pool_h},
                               {"pool_w", attrs.pool_w}},
                              {{"pad_top", attrs.pad_top}, {"pad_bottom", attrs.pad_bottom},
                               {"pad_left", attrs.pad_left}, {"pad_right", attrs.pad_right}});
      e.failure()) {
    return e;
  }
  int64_t c_words = formats::WordsForBits(attrs.c);
  if (attrs.kh * attrs.kw > kMaxReduction / attrs.c) {
    return Invalid(target, "the reduction kh * kw * c = " + std::to_string(attrs.kh) + " * " +
                               std::to_string(attrs.kw) + " * " + std::to_string(attrs.c) +
                               " does not fit int32");
  }
  if (attrs.kh * attrs.kw > kMaxReduction / (c_words * formats::kWordBits)) {
    return Invalid(target, "the reduction row of kh * kw = " + std::to_string(attrs.kh * attrs.kw) +
                               " taps of " + std::to_string(c_words) + " words does not fit int32 bits");
  }
  int64_t k_words = attrs.kh * attrs.kw * c_words;

  if (auto e = CheckDtypeRank(target, x_name, x, ffi::DataType::U32, planes > 0 ? 5 : 4,
                              planes > 0 ? "(B, H, W, 2, ceil(c/32))" : "(B, H, W, ceil(c/32))");
      e.failure()) {
    return e;
  }
  auto x_dims = x.dimensions();
  int64_t batch = x_dims[0], height = x_dims[1], width = x_dims[2];
  std::string why_x = "c = " + std::to_string(attrs.c);
  if (planes > 0) {
    why_x += " and the " + std::to_string(planes) + " planes of ternary activations";
    if (auto e = CheckShape(target, x_name, x, {batch, height, width, planes, c_words}, why_x.c_str());
        e.failure()) {
      return e;
    }
  } else if (auto e = CheckShape(target, x_name, x, {batch, height, width, c_words}, why_x.c_str()); e.failure()) {
    return e;
  }
  // Each term is at most int32's maximum (buffer dims included, checked next): the sums fit int64.
  if (height > kMaxAttr || width > kMaxAttr) {
    return Invalid(target, std::string(x_name) + " of shape " + ShapeString(x_dims) + " has an extent beyond int32");
  }
  int64_t padded_h = height + attrs.pad_top + attrs.pad_bottom;
  int64_t padded_w = width + attrs.pad_left + attrs.pad_right;
  if (padded_h > kMaxAttr || padded_w > kMaxAttr) {
    return Invalid(target, Concat("the padded input ", padded_h, " x ", padded_w, " has an extent beyond int32"));
  }
  if (padded_h < attrs.kh || padded_w < attrs.kw) {
    return Invalid(target, Concat("the kernel ", attrs.kh, " x ", attrs.kw, " is larger than the padded input ",
                                  padded_h, " x ", padded_w));
  }
  int64_t conv_h = (padded_h - attrs.kh) / attrs.stride_h + 1;
  int64_t conv_w = (padded_w - attrs.kw) / attrs.stride_w + 1;
  *problem = Bconv2dProblem{batch,         height,      width,         attrs.c,        c_words,
                            attrs.o,       attrs.kh,    attrs.kw,      attrs.stride_h, attrs.stride_w,
                            attrs.pad_top, attrs.pad_bottom, attrs.pad_left, attrs.pad_right,
                            attrs.pad_one, attrs.pool_h, attrs.pool_w, conv_h,        conv_w,
                            conv_h / attrs.pool_h, conv_w / attrs.pool_w, k_words, 0, 0,
                            0,             0,           Epilogue::kInt32};
  return ffi::Error::Success();
}

// Validates a jaxbnn_bconv2d_{i32,f32,bits} call (`int_type`: that of an integer result); on success fills
// `problem`.
inline ffi::Error CheckBconv2d(std::string_view target, Epilogue epilogue, const ffi::AnyBuffer& x,
                               const ffi::AnyBuffer& w, const ffi::AnyBuffer& w_tap_popcount,
                               const EpilogueOperands& epilogue_operands, const Bconv2dAttrs& attrs,
                               const ffi::AnyBuffer& out, Bconv2dProblem* problem,
                               ffi::DataType int_type = ffi::DataType::S32) {
  using namespace checks;
  Bconv2dProblem p;
  if (auto e = CheckConvInput(target, attrs, x, "operand `x`", &p); e.failure()) return e;
  const int64_t k_bits = p.k_words * formats::kWordBits;
  if (auto e = CheckDtypeRank(target, "operand `w`", w, ffi::DataType::U32, 4,
                              "(OT, KT, BH, BW/32) of FSB tiles");
      e.failure()) {
    return e;
  }
  if (auto e = CheckFsbGeometry(target, "operand `w`", w, attrs.o, k_bits, "o"); e.failure()) return e;
  if (auto e = CheckDtypeRank(target, "operand `w_tap_popcount`", w_tap_popcount, ffi::DataType::S32, 2,
                              "(kh*kw, o)");
      e.failure()) {
    return e;
  }
  std::string why_taps = "kh * kw = " + std::to_string(attrs.kh * attrs.kw) + " taps and o = " +
                         std::to_string(attrs.o);
  if (auto e = CheckShape(target, "operand `w_tap_popcount`", w_tap_popcount, {attrs.kh * attrs.kw, attrs.o},
                          why_taps.c_str());
      e.failure()) {
    return e;
  }
  if (auto e = CheckEpilogueAndResult(target, epilogue, epilogue_operands, attrs.o, "o", out,
                                      {p.batch, p.out_h, p.out_w}, int_type);
      e.failure()) {
    return e;
  }
  auto w_dims = w.dimensions();
  p.o_tiles = w_dims[0], p.k_tiles = w_dims[1], p.tile_rows = w_dims[2], p.tile_words = w_dims[3];
  p.epilogue = epilogue;
  *problem = p;
  return ffi::Error::Success();
}

// Validates the residual operands of a jaxbnn_bconv2d_residual_{i32,bits,i16,i16_bits} call whose convolution
// `p` (unpooled, its stream of `stream_type` int32 or int16) CheckBconv2d validated: the shortcut of that type
// (B, SH, SW, SC) with ceil(SH / stride) = OH, ceil(SW / stride) = OW and 1 <= SC <= o, the shift in [0, 31],
// the stride >= 1; with `bits` (else null), threshold and flip (o,) and the bits result uint32 (B, OH, OW,
// ceil(o/32)), or (P, o) and (B, OH, OW, P, ceil(o/32)) for P planes (`planes`: 1 where they are (o,)).
inline ffi::Error CheckResidual(std::string_view target, const Bconv2dProblem& p, const ffi::AnyBuffer& shortcut,
                                ffi::DataType stream_type, int64_t stride, int64_t shift,
                                const EpilogueOperands& threshold, const ffi::AnyBuffer* bits, int64_t* planes) {
  using namespace checks;
  *planes = 1;
  if (p.pool_h * p.pool_w != 1) return Invalid(target, "the residual epilogue takes no pool");
  if (auto e = CheckAttrRange(target, "shortcut_stride", stride, 1, kMaxAttr); e.failure()) return e;
  if (auto e = CheckAttrRange(target, "shift", shift, 0, 31); e.failure()) return e;
  if (auto e = CheckDtypeRank(target, "operand `shortcut`", shortcut, stream_type, 4, "(B, SH, SW, SC)");
      e.failure()) {
    return e;
  }
  auto dims = shortcut.dimensions();
  if (dims[0] != p.batch || formats::CeilDiv(dims[1], stride) != p.out_h ||
      formats::CeilDiv(dims[2], stride) != p.out_w || dims[3] < 1 || dims[3] > p.o) {
    return Invalid(target, Concat("operand `shortcut` has shape ", ShapeString(dims), "; with shortcut_stride ", stride,
                                  " it must be (", p.batch, ", SH, SW, SC) with ceil(SH / stride) = ", p.out_h,
                                  ", ceil(SW / stride) = ", p.out_w, " and 1 <= SC <= ", p.o));
  }
  if (CheckedProduct({dims[0], dims[1], dims[2], dims[3]}) < 0) {
    return Invalid(target, "operand `shortcut` has more elements than int64 counts");
  }
  if (bits == nullptr) return ffi::Error::Success();
  if (auto e = CheckEpilogueAndResult(target, Epilogue::kThreshold, threshold, p.o, "o", *bits,
                                      {p.batch, p.out_h, p.out_w});
      e.failure()) {
    return e;
  }
  if (threshold.first->dimensions().size() == 2) *planes = threshold.first->dimensions()[0];
  return ffi::Error::Success();
}

}  // namespace jaxbnn

#endif  // JAXBNN_XLA_FFI_COMMON_CHECKS_H_
