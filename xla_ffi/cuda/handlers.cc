// XLA FFI handlers of the CUDA targets (docs/ops.md, "Native contract"). Each handler validates ranks,
// shapes and attributes, fills a BinaryGemmProblem and launches on XLA's stream. Nothing is allocated at
// run time, so the handlers are command-buffer (CUDA graph) compatible.
#include "handlers.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "binary_gemm.h"
#include "dense_chain.h"
#include "global_pool.h"
#include "image_conv.h"
#include "stream_bits.h"
#include "common/checks.h"
#include "common/formats.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxbnn::cuda {
namespace {

std::atomic<int> g_forced_path{static_cast<int>(KernelPath::kAuto)};
std::atomic<int> g_last_path{static_cast<int>(KernelPath::kAuto)};
std::atomic<uint64_t> g_handler_calls{0}, g_handler_nanoseconds{0};

// Counts a handler's call and its host time (HandlerStats), from its construction to the end of its scope.
class HandlerTimer {
 public:
  HandlerTimer() : start_(std::chrono::steady_clock::now()) {}
  ~HandlerTimer() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_);
    g_handler_calls.fetch_add(1, std::memory_order_relaxed);
    g_handler_nanoseconds.fetch_add(static_cast<uint64_t>(ns.count()), std::memory_order_relaxed);
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

using formats::CeilDiv;

std::string Dims(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

template <class Buffer>
std::optional<ffi::Error> ExpectShape(const char* what, const Buffer& buffer, std::initializer_list<int64_t> want) {
  const auto dims = buffer.dimensions();
  bool same = dims.size() == want.size();
  size_t i = 0;
  for (int64_t w : want) {
    if (!same) break;
    same = dims[i++] == w;
  }
  if (same) return std::nullopt;
  std::string expected = "(";
  i = 0;
  for (int64_t w : want) expected += (i++ ? ", " : "") + std::to_string(w);
  expected += want.size() == 1 ? ",)" : ")";
  return ffi::Error::InvalidArgument(std::string("jaxbnn CUDA: ") + what + " has shape " + Dims(dims) +
                                     ", expected " + expected);
}

ffi::Error Invalid(const std::string& message) { return ffi::Error::InvalidArgument("jaxbnn CUDA: " + message); }

bool FitsInt(int64_t v) { return v >= 0 && v <= std::numeric_limits<int32_t>::max(); }

// Whether the product of non-negative factors fits int32 (false on int64 overflow too).
bool ProductFitsInt(std::initializer_list<int64_t> factors) { return FitsInt(checks::CheckedProduct(factors)); }

// Checks the FSB weight operand of `rows` weight rows and `k_words` reduction words.
std::optional<ffi::Error> CheckWeights(const ffi::Buffer<ffi::U32>& w, int64_t rows, int64_t k_words) {
  const auto dims = w.dimensions();
  if (dims.size() != 4) return Invalid("weights must be FSB tiles of rank 4, got shape " + Dims(dims));
  if (dims[2] != formats::kFsbTileRows || dims[3] != formats::kFsbTileWords) {
    return Invalid("the CUDA kernels take FSB tiles of 8 rows x 128 bits (tile dims (8, 4)), got " + Dims(dims));
  }
  return ExpectShape("weights", w, {CeilDiv(rows, formats::kFsbTileRows), CeilDiv(k_words, formats::kFsbTileWords),
                                    formats::kFsbTileRows, formats::kFsbTileWords});
}

// Refuses reductions longer than the kernels take (kMaxReductionWords).
std::optional<ffi::Error> CheckReduction(const char* op, int64_t k_words) {
  if (k_words <= kMaxReductionWords) return std::nullopt;
  return Invalid(std::string(op) + " reduces over " + std::to_string(k_words) + " words per dot product; the CUDA " +
                 "kernels take at most " + std::to_string(kMaxReductionWords) + " (" +
                 std::to_string(32 * kMaxReductionWords) + " bits)");
}

// Refuses an int16 result (Epilogue::kInt16) of reductions whose dot products may not fit it.
std::optional<ffi::Error> CheckInt16Reduction(const char* op, Epilogue kind, int64_t k_real) {
  if (kind != Epilogue::kInt16 || k_real <= kMaxInt16Reduction) return std::nullopt;
  return Invalid(std::string(op) + "'s int16 result holds dot products of at most " +
                 std::to_string(kMaxInt16Reduction) + " products; this one reduces over " + std::to_string(k_real));
}

ffi::Error Run(BinaryGemmProblem& p, cudaStream_t stream, const ResidualOperands& residual = {}) {
  if (p.pooled_rows == 0 || p.n == 0) return ffi::Error::Success();  // empty result, nothing to launch
  KernelPath chosen;
  const cudaError_t err =
      LaunchBinaryGemm(p, static_cast<KernelPath>(g_forced_path.load()), stream, &chosen, residual);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxbnn CUDA kernel launch failed: ") + cudaGetErrorString(err));
  }
  g_last_path.store(static_cast<int>(chosen));
  return ffi::Error::Success();
}

// The epilogue operands, absent ones as null.
struct EpilogueArgs {
  Epilogue kind = Epilogue::kInt32;
  const ffi::Buffer<ffi::F32>* scale = nullptr;
  const ffi::Buffer<ffi::F32>* bias = nullptr;
  const ffi::Buffer<ffi::S32>* threshold = nullptr;
  const ffi::Buffer<ffi::U8>* flip = nullptr;
};

// The threshold planes of a bits epilogue: 1 for a threshold of shape (n,), P for (P, n), -1 for other ranks.
int64_t BitsPlanes(const EpilogueArgs& e) {
  const auto dims = e.threshold->dimensions();
  return dims.size() == 1 ? 1 : dims.size() == 2 ? dims[0] : -1;
}

// A bits epilogue's threshold of rank 1, or of rank 2 with 1 to kMaxBitsPlanes planes.
std::optional<ffi::Error> CheckBitsPlanes(const EpilogueArgs& e) {
  if (e.kind != Epilogue::kBits && (!IsResidual(e.kind) || e.threshold == nullptr)) return std::nullopt;
  const int64_t planes = BitsPlanes(e);
  if (planes >= 1 && planes <= kMaxBitsPlanes) return std::nullopt;
  return Invalid("the threshold must be (n,) or (planes, n) with 1 to " + std::to_string(kMaxBitsPlanes) +
                 " planes, got " + Dims(e.threshold->dimensions()));
}

std::optional<ffi::Error> SetEpilogue(BinaryGemmProblem& p, const EpilogueArgs& e, int64_t n) {
  p.epilogue = e.kind;
  if (e.kind == Epilogue::kAffine) {
    if (auto err = ExpectShape("scale", *e.scale, {n})) return err;
    if (auto err = ExpectShape("bias", *e.bias, {n})) return err;
    p.scale = e.scale->typed_data();
    p.bias = e.bias->typed_data();
  } else if (e.kind == Epilogue::kBits) {
    const int64_t planes = BitsPlanes(e);  // checked by the caller (CheckBitsPlanes) before the result's shape
    if (e.threshold->dimensions().size() == 1) {
      if (auto err = ExpectShape("threshold", *e.threshold, {n})) return err;
      if (auto err = ExpectShape("flip", *e.flip, {n})) return err;
    } else {
      if (auto err = ExpectShape("threshold", *e.threshold, {planes, n})) return err;
      if (auto err = ExpectShape("flip", *e.flip, {planes, n})) return err;
    }
    p.threshold = e.threshold->typed_data();
    p.flip = e.flip->typed_data();
    p.planes = static_cast<int>(planes);
  }
  return std::nullopt;
}

// The trailing dimensions of a result after its rows: (n) values, or the bits as (ceil(n/32)) words for a
// threshold of shape (n,) and (planes, ceil(n/32)) for one of (planes, n).
std::vector<int64_t> OutputTail(const EpilogueArgs& e, int64_t n) {
  if (e.kind != Epilogue::kBits) return {n};
  if (e.threshold->dimensions().size() == 1) return {CeilDiv(n, 32)};
  return {BitsPlanes(e), CeilDiv(n, 32)};
}

// The residual epilogue's operands (IsResidual): the block's input stream as the shortcut (of the stream's
// type), taken every `stride` pixels, the shift of the dot products, and the stream bits' result (null: none).
struct ResidualArgs {
  const void* shortcut = nullptr;
  ffi::Span<const int64_t> shortcut_dims;
  int64_t stride = 1, shift = 0;
  ffi::Span<const int64_t> bits_dims;
  uint32_t* bits = nullptr;
};

// Checks the residual epilogue's operands against the problem `p` and fills `operands`; `bits_tail`: the
// stream bits' shape past the pixels ((ceil(n/32)) for a threshold (n,), (P, ceil(n/32)) for (P, n)).
std::optional<ffi::Error> SetResidual(const BinaryGemmProblem& p, const ResidualArgs& r, int64_t batch, int64_t out_h,
                                      int64_t out_w, int64_t n, const std::vector<int64_t>& bits_tail,
                                      ResidualOperands& operands) {
  if (p.pool_h * p.pool_w != 1) return Invalid("bconv2d's residual epilogue takes no pool");
  if (r.shift < 0 || r.shift > 31) return Invalid("bconv2d shift must lie in [0, 31], got " + std::to_string(r.shift));
  if (r.stride < 1 || !FitsInt(r.stride)) {
    return Invalid("bconv2d shortcut_stride must lie in [1, 2^31 - 1], got " + std::to_string(r.stride));
  }
  const auto dims = r.shortcut_dims;
  if (dims.size() != 4 || dims[0] != batch || CeilDiv(dims[1], r.stride) != out_h ||
      CeilDiv(dims[2], r.stride) != out_w || dims[3] < 1 || dims[3] > n) {
    return Invalid("bconv2d shortcut has shape " + Dims(dims) + "; with shortcut_stride " + std::to_string(r.stride) +
                   " it must be (" + std::to_string(batch) + ", SH, SW, SC) with ceil(SH / stride) = " +
                   std::to_string(out_h) + ", ceil(SW / stride) = " + std::to_string(out_w) + " and 1 <= SC <= " +
                   std::to_string(n));
  }
  if (!ProductFitsInt({dims[1], dims[2]}) || !FitsInt(dims[3]) ||
      checks::CheckedProduct({dims[0], dims[1], dims[2], dims[3]}) < 0) {
    return Invalid("bconv2d shortcut too large for the CUDA kernels");
  }
  if (r.bits != nullptr) {
    std::vector<int64_t> expected{batch, out_h, out_w};
    expected.insert(expected.end(), bits_tail.begin(), bits_tail.end());
    if (std::vector<int64_t>(r.bits_dims.begin(), r.bits_dims.end()) != expected) {
      return Invalid("bconv2d stream bits have shape " + Dims(r.bits_dims) + ", expected " + Dims(expected));
    }
    if (!ProductFitsInt({batch, out_h, out_w, bits_tail.size() == 2 ? bits_tail[0] : 1, n})) {
      return Invalid("bconv2d stream bits too large for the CUDA kernels (int32 indexing)");
    }
    operands.planes = bits_tail.size() == 2 ? static_cast<int>(bits_tail[0]) : 1;
  }
  operands.shortcut = r.shortcut;
  operands.height = static_cast<int>(dims[1]);
  operands.width = static_cast<int>(dims[2]);
  operands.channels = static_cast<int>(dims[3]);
  operands.stride = static_cast<int>(r.stride);
  operands.shift = static_cast<int>(r.shift);
  operands.bits = r.bits;
  return std::nullopt;
}

// doubled_k_blocks: BinaryGemmProblem's (the bmm_doubled handlers'), 0 for the plain product.
ffi::Error Bmm(cudaStream_t stream, const ffi::Buffer<ffi::U32>& a, const ffi::Buffer<ffi::U32>& b,
               const ffi::Buffer<ffi::S32>& b_popc, int64_t k, int64_t n, const EpilogueArgs& e,
               ffi::Span<const int64_t> out_dims, void* out, int64_t doubled_k_blocks = 0) {
  const HandlerTimer timer;
  if (k < 1 || n < 1) return Invalid("bmm needs k >= 1 and n >= 1, got k=" + std::to_string(k) + ", n=" + std::to_string(n));
  const auto a_dims = a.dimensions();
  if (a_dims.size() != 2) return Invalid("bmm activations must be (M, ceil(k/32)), got " + Dims(a_dims));
  const int64_t m = a_dims[0], k_words = formats::WordsForBits(k);
  if (a_dims[1] != k_words) {
    return Invalid("bmm activations have " + std::to_string(a_dims[1]) + " words per row, k=" + std::to_string(k) +
                   " needs " + std::to_string(k_words));
  }
  if (auto err = CheckWeights(b, n, k_words)) return *err;
  if (auto err = ExpectShape("b_popc", b_popc, {n})) return *err;
  if (auto err = CheckBitsPlanes(e)) return *err;
  std::vector<int64_t> expected_out{m};
  for (int64_t d : OutputTail(e, n)) expected_out.push_back(d);
  if (std::vector<int64_t>(out_dims.begin(), out_dims.end()) != expected_out) {
    return Invalid("bmm result has shape " + Dims(out_dims) + ", expected " + Dims(expected_out));
  }
  if (!ProductFitsInt({m, k_words}) || !FitsInt(k) || !ProductFitsInt({m, std::max<int64_t>(n, 1)})) {
    return Invalid("bmm operands too large for the CUDA kernels (int32 indexing)");
  }
  if (auto err = CheckReduction("bmm", k_words)) return *err;
  if (auto err = CheckInt16Reduction("bmm", e.kind, k)) return *err;
  if (doubled_k_blocks != 0) {
    const int64_t k_blocks = CeilDiv(k_words, 32);
    if (doubled_k_blocks < 1 || doubled_k_blocks >= k_blocks || k_words > (1 << 15)) {
      return Invalid("bmm_doubled needs 1 <= doubled_k_blocks < ceil(k / 1024) = " + std::to_string(k_blocks) +
                     " and k <= 2^20, got k=" + std::to_string(k) + ", doubled_k_blocks=" +
                     std::to_string(doubled_k_blocks));
    }
  }
  BinaryGemmProblem p;
  p.x = a.typed_data();
  p.w = b.typed_data();
  p.tap_popc = b_popc.typed_data();
  p.batch = static_cast<int>(m);
  p.in_h = p.in_w = 1;
  p.cw = p.x_cw = static_cast<int>(k_words);
  p.c = static_cast<int>(k);
  p.out_h = p.out_w = 1;
  p.n = static_cast<int>(n);
  p.w_row_tiles = static_cast<int>(CeilDiv(n, formats::kFsbTileRows));
  p.w_k_tiles = static_cast<int>(CeilDiv(k_words, formats::kFsbTileWords));
  p.k_words = p.cw;
  p.k_real = p.c;
  p.pooled_rows = static_cast<int>(m);
  p.out = out;
  p.doubled_k_blocks = static_cast<int>(doubled_k_blocks);
  // A doubled product's accumulator reaches 2 D + (k - D) (D: the doubled bits): with k_real = 2 (D + k) in the
  // place of k, every x = 4 acc + k_real - 2 popc(a) lies in [-k_real, 3 k_real] as the threshold epilogues
  // assume (the caller gives each column's popcount so that the dot products lie within +-k_real).
  if (doubled_k_blocks != 0) p.k_real = static_cast<int>(2 * (doubled_k_blocks * 1024 + k));
  if (auto err = SetEpilogue(p, e, n)) return *err;
  return Run(p, stream);
}

// x_repeats: how many times each tap reads its input pixel's words (1, or 2: a side-by-side ternary product's
// repeated activation blocks, BinaryGemmProblem::x_cw; c then whole words, a multiple of 64); the input holds
// ceil(c / 32) / x_repeats words a pixel.
struct ConvAttrs {
  int64_t c, o, kh, kw, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right;
  bool pad_one;
  int64_t pool_h, pool_w, x_repeats;
};

// residual: the residual epilogue's operands where e.kind is one (IsResidual; its threshold and flip optional).
// doubled_tap_words: the bconv2d_doubled handlers' (DoubledTapWords), 0 for the plain product.
ffi::Error BConv(cudaStream_t stream, const ffi::Buffer<ffi::U32>& x, const ffi::Buffer<ffi::U32>& w,
                 const ffi::Buffer<ffi::S32>& tap_popc, const ConvAttrs& at, const EpilogueArgs& e,
                 ffi::Span<const int64_t> out_dims, void* out, const ResidualArgs* residual = nullptr,
                 int64_t doubled_tap_words = 0) {
  const HandlerTimer timer;
  if (at.c < 1 || at.o < 1 || at.kh < 1 || at.kw < 1 || at.stride_h < 1 || at.stride_w < 1 || at.pool_h < 1 ||
      at.pool_w < 1 || at.pad_top < 0 || at.pad_bottom < 0 || at.pad_left < 0 || at.pad_right < 0) {
    return Invalid("bconv2d needs c, o, kernel, stride, pool >= 1 and padding >= 0");
  }
  // Every attribute within int32 first: the sums and products below then cannot overflow int64.
  for (int64_t value : {at.c, at.o, at.kh, at.kw, at.stride_h, at.stride_w, at.pad_top, at.pad_bottom, at.pad_left,
                        at.pad_right, at.pool_h, at.pool_w}) {
    if (!FitsInt(value)) return Invalid("bconv2d attribute " + std::to_string(value) + " is beyond int32");
  }
  if (at.pool_h * at.pool_w > kMaxPoolWindow) {
    return Invalid("bconv2d pool window " + std::to_string(at.pool_h) + "x" + std::to_string(at.pool_w) +
                   " is larger than the CUDA kernels take (" + std::to_string(kMaxPoolWindow) + " elements)");
  }
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 4) return Invalid("bconv2d input must be packed NHWC (B, H, W, ceil(C/32)), got " + Dims(x_dims));
  const int64_t batch = x_dims[0], h = x_dims[1], wd = x_dims[2], cw = formats::WordsForBits(at.c);
  if ((at.x_repeats != 1 && at.x_repeats != 2) || (at.x_repeats == 2 && at.c % 64 != 0)) {
    return Invalid("bconv2d x_repeats must be 1, or 2 with c a multiple of 64, got " + std::to_string(at.x_repeats) +
                   " with c=" + std::to_string(at.c));
  }
  if (x_dims[3] * at.x_repeats != cw) {
    return Invalid("bconv2d input has " + std::to_string(x_dims[3]) + " words per pixel, c=" + std::to_string(at.c) +
                   " read " + std::to_string(at.x_repeats) + " time(s) a tap needs " +
                   std::to_string(cw / at.x_repeats));
  }
  const int64_t conv_h = (h + at.pad_top + at.pad_bottom - at.kh) / at.stride_h + 1;
  const int64_t conv_w = (wd + at.pad_left + at.pad_right - at.kw) / at.stride_w + 1;
  if (h + at.pad_top + at.pad_bottom < at.kh || wd + at.pad_left + at.pad_right < at.kw) {
    return Invalid("bconv2d kernel larger than the padded input");
  }
  const int64_t out_h = conv_h / at.pool_h, out_w = conv_w / at.pool_w;
  const int64_t taps = at.kh * at.kw, k_words = taps * cw;
  if (auto err = CheckWeights(w, at.o, k_words)) return *err;
  if (auto err = ExpectShape("w_tap_popc", tap_popc, {taps, at.o})) return *err;
  std::vector<int64_t> expected_out{batch, out_h, out_w};
  if (IsResidual(e.kind)) {
    expected_out.push_back(at.o);
  } else {
    if (auto err = CheckBitsPlanes(e)) return *err;
    for (int64_t d : OutputTail(e, at.o)) expected_out.push_back(d);
  }
  if (std::vector<int64_t>(out_dims.begin(), out_dims.end()) != expected_out) {
    return Invalid("bconv2d result has shape " + Dims(out_dims) + ", expected " + Dims(expected_out));
  }
  if (!ProductFitsInt({batch, h, wd, cw}) || !ProductFitsInt({taps, at.c}) ||
      !ProductFitsInt({batch, out_h, out_w, at.o}) || !FitsInt(k_words) || !FitsInt(conv_h) || !FitsInt(conv_w) ||
      !ProductFitsInt({h + at.pad_top, wd + at.pad_left, cw, 2})) {
    return Invalid("bconv2d operands too large for the CUDA kernels (int32 indexing)");
  }
  if (auto err = CheckReduction("bconv2d", k_words)) return *err;
  if (auto err = CheckInt16Reduction("bconv2d", e.kind, taps * at.c)) return *err;
  if (doubled_tap_words != 0) {
    const int64_t rest = cw - doubled_tap_words;
    if (doubled_tap_words < 32 || doubled_tap_words % 32 != 0 || rest < 16 || rest % 16 != 0 || at.c != 32 * cw ||
        at.x_repeats != 1 || at.pad_one || k_words > (1 << 15)) {
      return Invalid("bconv2d_doubled needs doubled_tap_words a positive multiple of 32 and c / 32 - "
                     "doubled_tap_words of 16, c a multiple of 32, x_repeats=1, zero padding and kh * kw * c <= "
                     "2^20, got c=" +
                     std::to_string(at.c) + ", doubled_tap_words=" + std::to_string(doubled_tap_words) +
                     ", x_repeats=" + std::to_string(at.x_repeats) + (at.pad_one ? ", pad_one" : "") + ", " +
                     std::to_string(taps) + " taps");
    }
  }
  BinaryGemmProblem p;
  p.x = x.typed_data();
  p.w = w.typed_data();
  p.tap_popc = tap_popc.typed_data();
  p.batch = static_cast<int>(batch);
  p.in_h = static_cast<int>(h);
  p.in_w = static_cast<int>(wd);
  p.cw = static_cast<int>(cw);
  p.x_cw = static_cast<int>(cw / at.x_repeats);
  p.c = static_cast<int>(at.c);
  p.kh = static_cast<int>(at.kh);
  p.kw = static_cast<int>(at.kw);
  p.stride_h = static_cast<int>(at.stride_h);
  p.stride_w = static_cast<int>(at.stride_w);
  p.pad_top = static_cast<int>(at.pad_top);
  p.pad_left = static_cast<int>(at.pad_left);
  p.pad_one = at.pad_one;
  p.pool_h = static_cast<int>(at.pool_h);
  p.pool_w = static_cast<int>(at.pool_w);
  p.out_h = static_cast<int>(out_h);
  p.out_w = static_cast<int>(out_w);
  p.n = static_cast<int>(at.o);
  p.w_row_tiles = static_cast<int>(CeilDiv(at.o, formats::kFsbTileRows));
  p.w_k_tiles = static_cast<int>(CeilDiv(k_words, formats::kFsbTileWords));
  p.k_words = static_cast<int>(k_words);
  p.k_real = static_cast<int>(taps * at.c);
  p.pooled_rows = static_cast<int>(batch * out_h * out_w);
  p.out = out;
  if (doubled_tap_words != 0) {
    // Every tap's doubled words count twice: as the doubled BMM's (Bmm), each tap's real count is 2 (D + c) with D
    // its doubled bits, the caller gives every tap's popcount as half of it, and so an out-of-frame tap ("zero"
    // padding: its activation bits 0) adds nothing, as a border row's correction c - 2 popc(tap) = 0 says.
    p.doubled_k_blocks = static_cast<int>(taps * doubled_tap_words / 32);
    p.c = static_cast<int>(2 * (32 * doubled_tap_words + at.c));
    p.k_real = static_cast<int>(taps * p.c);
  }
  if (!IsResidual(e.kind)) {
    if (auto err = SetEpilogue(p, e, at.o)) return *err;
    return Run(p, stream);
  }
  p.epilogue = e.kind;
  std::vector<int64_t> bits_tail;
  if (e.threshold != nullptr) {  // (o,), or (P, o) threshold planes
    if (auto err = CheckBitsPlanes(e)) return *err;
    if (e.threshold->dimensions().size() == 1) {
      if (auto err = ExpectShape("threshold", *e.threshold, {at.o})) return *err;
      if (auto err = ExpectShape("flip", *e.flip, {at.o})) return *err;
    } else {
      const int64_t planes = BitsPlanes(e);
      if (auto err = ExpectShape("threshold", *e.threshold, {planes, at.o})) return *err;
      if (auto err = ExpectShape("flip", *e.flip, {planes, at.o})) return *err;
    }
    p.threshold = e.threshold->typed_data();
    p.flip = e.flip->typed_data();
    bits_tail = OutputTail(EpilogueArgs{Epilogue::kBits, nullptr, nullptr, e.threshold, e.flip}, at.o);
  }
  ResidualOperands operands;
  if (auto err = SetResidual(p, *residual, batch, out_h, out_w, at.o, bits_tail, operands)) return *err;
  return Run(p, stream, operands);
}

struct ImageConvAttrs {
  int64_t c, n, kh, kw, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right, pool_h, pool_w;
};

// A first layer's results: the stream (int32, or int16 where narrow; (B, OH, OW, N)) and / or the threshold
// planes' bits (uint32 (B, OH, OW, planes, ceil(N/32))); a null pointer where the call has no such result.
struct ImageConvResults {
  void* stream = nullptr;
  ffi::Span<const int64_t> stream_dims;
  bool narrow = false;
  uint32_t* bits = nullptr;
  ffi::Span<const int64_t> bits_dims;
};

// The first layer (ops.image_conv2d): int8 levels or uint8 pixels (B, H, W, C), an int8 HWIO kernel (KH, KW, C, N),
// the pooled pre-activations >> shift (narrowed to int16 for an int16 stream) as the stream and / or compared with
// threshold / flip (planes, N) as the bits (ImageConvProblem).
ffi::Error ImageConv(cudaStream_t stream, const ffi::AnyBuffer& levels, const ffi::Buffer<ffi::S8>& kernel,
                     const ImageConvAttrs& at, const ffi::Buffer<ffi::S32>* threshold, const ffi::Buffer<ffi::U8>* flip,
                     int64_t shift, const ImageConvResults& results) {
  const HandlerTimer timer;
  for (int64_t value : {at.c, at.n, at.kh, at.kw, at.stride_h, at.stride_w, at.pool_h, at.pool_w}) {
    if (value < 1 || !FitsInt(value)) return Invalid("image_conv2d needs c, n, kernel, stride, pool in [1, 2^31 - 1]");
  }
  for (int64_t value : {at.pad_top, at.pad_bottom, at.pad_left, at.pad_right}) {
    if (!FitsInt(value)) return Invalid("image_conv2d padding must lie in [0, 2^31 - 1]");
  }
  if (shift < 0 || shift > 31) return Invalid("image_conv2d shift must lie in [0, 31], got " + std::to_string(shift));
  if (at.pool_h * at.pool_w > kMaxImagePoolWindow) {
    return Invalid("image_conv2d pool window " + std::to_string(at.pool_h) + "x" + std::to_string(at.pool_w) +
                   " is larger than the kernel takes (" + std::to_string(kMaxImagePoolWindow) + " elements)");
  }
  if (levels.element_type() != ffi::S8 && levels.element_type() != ffi::U8) {
    return Invalid("image_conv2d takes int8 levels or uint8 pixels");
  }
  const auto x_dims = levels.dimensions();
  if (x_dims.size() != 4 || x_dims[3] != at.c) {
    return Invalid("image_conv2d levels must be (B, H, W, " + std::to_string(at.c) + "), got " + Dims(x_dims));
  }
  if (auto err = ExpectShape("kernel", kernel, {at.kh, at.kw, at.c, at.n})) return *err;
  const int64_t batch = x_dims[0], h = x_dims[1], wd = x_dims[2];
  if (h + at.pad_top + at.pad_bottom < at.kh || wd + at.pad_left + at.pad_right < at.kw) {
    return Invalid("image_conv2d kernel larger than the padded image");
  }
  const int64_t out_h = ((h + at.pad_top + at.pad_bottom - at.kh) / at.stride_h + 1) / at.pool_h;
  const int64_t out_w = ((wd + at.pad_left + at.pad_right - at.kw) / at.stride_w + 1) / at.pool_w;
  const int64_t planes = threshold ? threshold->dimensions().size() == 2 ? threshold->dimensions()[0] : -1 : 0;
  if (threshold) {
    if (planes < 1 || planes > kMaxImagePlanes) {
      return Invalid("image_conv2d threshold must be (planes, n) with 1 to " + std::to_string(kMaxImagePlanes) +
                     " planes, got " + Dims(threshold->dimensions()));
    }
    if (auto err = ExpectShape("threshold", *threshold, {planes, at.n})) return *err;
    if (auto err = ExpectShape("flip", *flip, {planes, at.n})) return *err;
  }
  if ((results.bits != nullptr) != (threshold != nullptr)) {
    return Invalid("image_conv2d has threshold planes exactly where it has a bits result");
  }
  if (results.stream != nullptr && (results.stream_dims.size() != 4 || results.stream_dims[0] != batch ||
                                    results.stream_dims[1] != out_h || results.stream_dims[2] != out_w ||
                                    results.stream_dims[3] != at.n)) {
    return Invalid("image_conv2d stream result has shape " + Dims(results.stream_dims) + ", not the (B, OH, OW, N) " +
                   Dims(std::vector<int64_t>{batch, out_h, out_w, at.n}) + " of the call");
  }
  if (threshold && (results.bits_dims.size() != 5 || results.bits_dims[0] != batch || results.bits_dims[1] != out_h ||
                    results.bits_dims[2] != out_w || results.bits_dims[3] != planes ||
                    results.bits_dims[4] != CeilDiv(at.n, 32))) {
    return Invalid("image_conv2d bits result has shape " + Dims(results.bits_dims) + ", not the (B, OH, OW, planes, " +
                   "ceil(N/32)) " + Dims(std::vector<int64_t>{batch, out_h, out_w, planes, CeilDiv(at.n, 32)}) + " of the call");
  }
  if (at.kh * at.kw * at.c > std::numeric_limits<int32_t>::max() / (int64_t{1} << 14)) {
    return Invalid("image_conv2d reduces over " + std::to_string(at.kh * at.kw * at.c) +
                   " int8 products per output, more than are sure to sum within int32");
  }
  // int32: the level and weight indices and the pooled pixels (a tile's rows); the outputs are indexed in int64
  if (!ProductFitsInt({batch, h, wd, at.c}) || !ProductFitsInt({at.kh, at.kw, at.c, at.n}) ||
      !ProductFitsInt({batch, out_h, out_w}) || !FitsInt(batch * out_h * out_w + 128) ||
      !FitsInt(h + at.pad_top + at.pad_bottom) || !FitsInt(wd + at.pad_left + at.pad_right) ||
      CeilDiv(at.n, kImageTileColumns) > kMaxImageColumnTiles) {
    return Invalid("image_conv2d operands too large for the CUDA kernel (int32 indexing)");
  }
  ImageConvProblem p;
  p.levels = static_cast<const int8_t*>(levels.untyped_data());
  p.pixels = levels.element_type() == ffi::U8;
  p.kernel = kernel.typed_data();
  p.threshold = threshold ? threshold->typed_data() : nullptr;
  p.flip = flip ? flip->typed_data() : nullptr;
  p.out_stream = results.stream;
  p.out_bits = results.bits;
  p.narrow_stream = results.narrow;
  p.batch = static_cast<int>(batch);
  p.in_h = static_cast<int>(h);
  p.in_w = static_cast<int>(wd);
  p.c = static_cast<int>(at.c);
  p.n = static_cast<int>(at.n);
  p.kh = static_cast<int>(at.kh);
  p.kw = static_cast<int>(at.kw);
  p.stride_h = static_cast<int>(at.stride_h);
  p.stride_w = static_cast<int>(at.stride_w);
  p.pad_top = static_cast<int>(at.pad_top);
  p.pad_left = static_cast<int>(at.pad_left);
  p.pool_h = static_cast<int>(at.pool_h);
  p.pool_w = static_cast<int>(at.pool_w);
  p.out_h = static_cast<int>(out_h);
  p.out_w = static_cast<int>(out_w);
  p.planes = static_cast<int>(planes);
  p.shift = static_cast<int>(shift);
  const cudaError_t err = LaunchImageConv(p, stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxbnn CUDA image_conv2d launch failed: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// Global pooling of a stream (B, H, W, C), int16 or int32, into threshold planes' bits (B, planes, ceil(C / 32)).
ffi::Error GlobalSumBitsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> threshold,
                             ffi::Buffer<ffi::U8> flip, ffi::ResultBuffer<ffi::U32> out) {
  const HandlerTimer timer;
  if (x.element_type() != ffi::S16 && x.element_type() != ffi::S32) {
    return Invalid("global_sum_bits takes an int16 or int32 stream");
  }
  const auto dims = x.dimensions();
  if (dims.size() != 4 || dims[3] < 1) {
    return Invalid("global_sum_bits stream must be (B, H, W, C) with C >= 1, got " + Dims(dims));
  }
  const auto t_dims = threshold.dimensions();
  if (t_dims.size() != 2 || t_dims[0] < 1 || t_dims[0] > kMaxGlobalSumPlanes || t_dims[1] != dims[3]) {
    return Invalid("global_sum_bits threshold must be (planes, " + std::to_string(dims[3]) + ") with 1 to " +
                   std::to_string(kMaxGlobalSumPlanes) + " planes, got " + Dims(t_dims));
  }
  const int64_t batch = dims[0], pixels = dims[1] * dims[2], channels = dims[3], planes = t_dims[0];
  if (auto err = ExpectShape("flip", flip, {planes, channels})) return *err;
  if (auto err = ExpectShape("the bits result", *out, {batch, planes, CeilDiv(channels, 32)})) return *err;
  // int32: the images, pixels, channels and (image, word) items; the elements are indexed in int64
  if (!FitsInt(batch) || !ProductFitsInt({dims[1], dims[2]}) || !FitsInt(channels) ||
      checks::CheckedProduct({batch, pixels, channels}) < 0 ||
      !FitsInt(checks::CheckedProduct({batch, CeilDiv(channels, 32)}))) {
    return Invalid("global_sum_bits stream too large for the CUDA kernel");
  }
  GlobalSumProblem p;
  p.stream = x.untyped_data();
  p.narrow = x.element_type() == ffi::S16;
  p.threshold = threshold.typed_data();
  p.flip = flip.typed_data();
  p.out_bits = out->typed_data();
  p.batch = static_cast<int>(batch);
  p.pixels = static_cast<int>(pixels);
  p.channels = static_cast<int>(channels);
  p.planes = static_cast<int>(planes);
  const cudaError_t err = LaunchGlobalSumBits(p, stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxbnn CUDA global_sum_bits launch failed: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// The threshold planes of a stream (..., C), int16 or int32, pixel by pixel: bits (..., planes, ceil(C / 32)).
ffi::Error StreamBitsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> threshold,
                          ffi::Buffer<ffi::U8> flip, ffi::ResultBuffer<ffi::U32> out) {
  const HandlerTimer timer;
  if (x.element_type() != ffi::S16 && x.element_type() != ffi::S32) {
    return Invalid("stream_bits takes an int16 or int32 stream");
  }
  const auto dims = x.dimensions();
  if (dims.size() < 1 || dims.back() < 1) {
    return Invalid("stream_bits stream must be (..., C) with C >= 1, got " + Dims(dims));
  }
  const int64_t channels = dims.back();
  const auto t_dims = threshold.dimensions();
  if (t_dims.size() != 2 || t_dims[0] < 1 || t_dims[0] > kMaxStreamBitsPlanes || t_dims[1] != channels) {
    return Invalid("stream_bits threshold must be (planes, " + std::to_string(channels) + ") with 1 to " +
                   std::to_string(kMaxStreamBitsPlanes) + " planes, got " + Dims(t_dims));
  }
  const int64_t planes = t_dims[0];
  if (auto err = ExpectShape("flip", flip, {planes, channels})) return *err;
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows = checks::CheckedProduct({rows, dims[i]});
  const auto o_dims = out->dimensions();
  bool out_matches = o_dims.size() == dims.size() + 1 && o_dims[dims.size() - 1] == planes &&
                     o_dims[dims.size()] == CeilDiv(channels, 32);
  for (size_t i = 0; out_matches && i + 1 < dims.size(); ++i) out_matches = o_dims[i] == dims[i];
  if (!out_matches) return Invalid("stream_bits result must be (..., " + std::to_string(planes) + ", " +
                                   std::to_string(CeilDiv(channels, 32)) + "), got " + Dims(o_dims));
  // int64: the rows and the elements (and the bits' words); int32: the channels
  if (rows < 0 || !FitsInt(channels) || checks::CheckedProduct({rows, channels}) < 0 ||
      checks::CheckedProduct({rows, planes, CeilDiv(channels, 32)}) < 0) {
    return Invalid("stream_bits stream too large for the CUDA kernel");
  }
  StreamBitsProblem p;
  p.stream = x.untyped_data();
  p.narrow = x.element_type() == ffi::S16;
  p.threshold = threshold.typed_data();
  p.flip = flip.typed_data();
  p.out_bits = out->typed_data();
  p.rows = rows;
  p.channels = static_cast<int>(channels);
  p.planes = static_cast<int>(planes);
  const cudaError_t err = LaunchStreamBits(p, stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxbnn CUDA stream_bits launch failed: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// A chain of dense binary layers in one kernel (ops.bmm_chain): x (M, ceil(k_0 / 32)), then per layer its FSB
// weights, the popcounts of its rows (n,), and its epilogue's two operands: threshold (n,) int32 and flip (n,)
// uint8, or for an affine last layer scale and bias (n,) float32. ks, ns: each layer's k and n.
ffi::Error BmmChain(cudaStream_t stream, const ffi::Buffer<ffi::U32>& x, const ffi::RemainingArgs& layers,
                    ffi::Span<const int64_t> ks, ffi::Span<const int64_t> ns, bool affine,
                    ffi::Span<const int64_t> out_dims, void* out) {
  const HandlerTimer timer;
  const int64_t count = static_cast<int64_t>(ks.size());
  if (count < 1 || count > kChainMaxLayers || ns.size() != ks.size()) {
    return Invalid("bmm_chain takes 1 to " + std::to_string(kChainMaxLayers) + " layers, each with its k and n; got " +
                   std::to_string(ks.size()) + " k and " + std::to_string(ns.size()) + " n");
  }
  if (static_cast<int64_t>(layers.size()) != 4 * count) {
    return Invalid("bmm_chain takes four operands a layer (weights, popcounts, two epilogue operands); got " +
                   std::to_string(layers.size()) + " for " + std::to_string(count) + " layers");
  }
  for (int64_t l = 0; l < count; ++l) {
    if (ks[l] < 1 || ks[l] > kChainMaxBits || ns[l] < 1 || ns[l] > kChainMaxBits) {
      return Invalid("bmm_chain layer " + std::to_string(l) + " has k=" + std::to_string(ks[l]) + ", n=" +
                     std::to_string(ns[l]) + "; each must lie in [1, " + std::to_string(kChainMaxBits) + "]");
    }
    if (l > 0 && ks[l] != ns[l - 1]) {
      return Invalid("bmm_chain layer " + std::to_string(l) + " reduces over k=" + std::to_string(ks[l]) +
                     " bits, but the layer before writes n=" + std::to_string(ns[l - 1]));
    }
  }
  const int64_t smem = DenseChainSmemBytes(ks.begin(), ns.begin(), static_cast<int>(count));
  if (smem > kChainMaxSmemBytes) {
    return Invalid("bmm_chain's layers need " + std::to_string(smem) + " bytes of shared memory a CTA (weights and "
                   "columns); the kernel takes at most " + std::to_string(kChainMaxSmemBytes));
  }
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2 || x_dims[1] != formats::WordsForBits(ks[0])) {
    return Invalid("bmm_chain activations must be (M, " + std::to_string(formats::WordsForBits(ks[0])) + "), got " +
                   Dims(x_dims));
  }
  const int64_t m = x_dims[0], n_out = ns[count - 1];
  const std::vector<int64_t> expected_out{m, affine ? n_out : formats::WordsForBits(n_out)};
  if (std::vector<int64_t>(out_dims.begin(), out_dims.end()) != expected_out) {
    return Invalid("bmm_chain result has shape " + Dims(out_dims) + ", expected " + Dims(expected_out));
  }
  if (!ProductFitsInt({m, formats::WordsForBits(ks[0])}) || !ProductFitsInt({m, n_out})) {
    return Invalid("bmm_chain operands too large for the CUDA kernel (int32 indexing)");
  }
  DenseChainProblem p;
  p.x = x.typed_data();
  p.out = out;
  p.m = static_cast<int>(m);
  p.layers = static_cast<int>(count);
  p.affine = affine;
  for (int64_t l = 0; l < count; ++l) {
    const std::string name = "bmm_chain layer " + std::to_string(l);
    const auto w = layers.get<ffi::Buffer<ffi::U32>>(4 * l);
    const auto popc = layers.get<ffi::Buffer<ffi::S32>>(4 * l + 1);
    if (!w.has_value() || !popc.has_value()) {
      return Invalid(name + " needs uint32 FSB weights and int32 popcounts");
    }
    if (auto err = CheckWeights(*w, ns[l], formats::WordsForBits(ks[l]))) return *err;
    if (auto err = ExpectShape((name + " popcounts").c_str(), *popc, {ns[l]})) return *err;
    DenseChainLayer& layer = p.layer[l];
    layer.w = w->typed_data();
    layer.popc_b = popc->typed_data();
    layer.k = static_cast<int>(ks[l]);
    layer.n = static_cast<int>(ns[l]);
    if (affine && l == count - 1) {
      const auto scale = layers.get<ffi::Buffer<ffi::F32>>(4 * l + 2);
      const auto bias = layers.get<ffi::Buffer<ffi::F32>>(4 * l + 3);
      if (!scale.has_value() || !bias.has_value()) return Invalid(name + " needs float32 scale and bias");
      if (auto err = ExpectShape((name + " scale").c_str(), *scale, {ns[l]})) return *err;
      if (auto err = ExpectShape((name + " bias").c_str(), *bias, {ns[l]})) return *err;
      layer.scale = scale->typed_data();
      layer.bias = bias->typed_data();
    } else {
      const auto threshold = layers.get<ffi::Buffer<ffi::S32>>(4 * l + 2);
      const auto flip = layers.get<ffi::Buffer<ffi::U8>>(4 * l + 3);
      if (!threshold.has_value() || !flip.has_value()) {
        return Invalid(name + " needs an int32 threshold and a uint8 flip");
      }
      if (auto err = ExpectShape((name + " threshold").c_str(), *threshold, {ns[l]})) return *err;
      if (auto err = ExpectShape((name + " flip").c_str(), *flip, {ns[l]})) return *err;
      layer.threshold = threshold->typed_data();
      layer.flip = flip->typed_data();
    }
  }
  const cudaError_t err = LaunchDenseChain(p, stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxbnn CUDA bmm_chain launch failed: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

ffi::Error BmmChainF32Impl(cudaStream_t stream, ffi::Buffer<ffi::U32> x, ffi::RemainingArgs layers,
                           ffi::Span<const int64_t> ks, ffi::Span<const int64_t> ns, ffi::ResultBuffer<ffi::F32> out) {
  return BmmChain(stream, x, layers, ks, ns, true, out->dimensions(), out->untyped_data());
}

ffi::Error BmmChainBitsImpl(cudaStream_t stream, ffi::Buffer<ffi::U32> x, ffi::RemainingArgs layers,
                            ffi::Span<const int64_t> ks, ffi::Span<const int64_t> ns, ffi::ResultBuffer<ffi::U32> out) {
  return BmmChain(stream, x, layers, ks, ns, false, out->dimensions(), out->untyped_data());
}

// ---- the handlers ----

ffi::Error BmmI32Impl(cudaStream_t stream, ffi::Buffer<ffi::U32> a, ffi::Buffer<ffi::U32> b,
                      ffi::Buffer<ffi::S32> b_popc, int64_t k, int64_t n, ffi::ResultBuffer<ffi::S32> out) {
  return Bmm(stream, a, b, b_popc, k, n, EpilogueArgs{}, out->dimensions(), out->untyped_data());
}

ffi::Error BmmI16Impl(cudaStream_t stream, ffi::Buffer<ffi::U32> a, ffi::Buffer<ffi::U32> b,
                      ffi::Buffer<ffi::S32> b_popc, int64_t k, int64_t n, ffi::ResultBuffer<ffi::S16> out) {
  return Bmm(stream, a, b, b_popc, k, n, EpilogueArgs{Epilogue::kInt16}, out->dimensions(), out->untyped_data());
}

ffi::Error BmmF32Impl(cudaStream_t stream, ffi::Buffer<ffi::U32> a, ffi::Buffer<ffi::U32> b,
                      ffi::Buffer<ffi::S32> b_popc, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias, int64_t k,
                      int64_t n, ffi::ResultBuffer<ffi::F32> out) {
  EpilogueArgs e{Epilogue::kAffine, &scale, &bias, nullptr, nullptr};
  return Bmm(stream, a, b, b_popc, k, n, e, out->dimensions(), out->untyped_data());
}

ffi::Error BmmBitsImpl(cudaStream_t stream, ffi::Buffer<ffi::U32> a, ffi::Buffer<ffi::U32> b,
                       ffi::Buffer<ffi::S32> b_popc, ffi::Buffer<ffi::S32> threshold, ffi::Buffer<ffi::U8> flip,
                       int64_t k, int64_t n, ffi::ResultBuffer<ffi::U32> out) {
  EpilogueArgs e{Epilogue::kBits, nullptr, nullptr, &threshold, &flip};
  return Bmm(stream, a, b, b_popc, k, n, e, out->dimensions(), out->untyped_data());
}

// The products whose first doubled_k_blocks K blocks of 1024 bits count twice (BinaryGemmProblem::doubled_k_blocks):
// a ternary product's three-block form (jaxbnn.ops).
ffi::Error BmmDoubledI32Impl(cudaStream_t stream, ffi::Buffer<ffi::U32> a, ffi::Buffer<ffi::U32> b,
                             ffi::Buffer<ffi::S32> b_popc, int64_t k, int64_t n, int64_t doubled_k_blocks,
                             ffi::ResultBuffer<ffi::S32> out) {
  return Bmm(stream, a, b, b_popc, k, n, EpilogueArgs{}, out->dimensions(), out->untyped_data(), doubled_k_blocks);
}

ffi::Error BmmDoubledF32Impl(cudaStream_t stream, ffi::Buffer<ffi::U32> a, ffi::Buffer<ffi::U32> b,
                             ffi::Buffer<ffi::S32> b_popc, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias,
                             int64_t k, int64_t n, int64_t doubled_k_blocks, ffi::ResultBuffer<ffi::F32> out) {
  EpilogueArgs e{Epilogue::kAffine, &scale, &bias, nullptr, nullptr};
  return Bmm(stream, a, b, b_popc, k, n, e, out->dimensions(), out->untyped_data(), doubled_k_blocks);
}

ffi::Error BmmDoubledBitsImpl(cudaStream_t stream, ffi::Buffer<ffi::U32> a, ffi::Buffer<ffi::U32> b,
                              ffi::Buffer<ffi::S32> b_popc, ffi::Buffer<ffi::S32> threshold, ffi::Buffer<ffi::U8> flip,
                              int64_t k, int64_t n, int64_t doubled_k_blocks, ffi::ResultBuffer<ffi::U32> out) {
  EpilogueArgs e{Epilogue::kBits, nullptr, nullptr, &threshold, &flip};
  return Bmm(stream, a, b, b_popc, k, n, e, out->dimensions(), out->untyped_data(), doubled_k_blocks);
}

#define JAXBNN_CONV_ATTR_PARAMS                                                                             \
  int64_t c, int64_t o, int64_t kh, int64_t kw, int64_t stride_h, int64_t stride_w, int64_t pad_top,       \
      int64_t pad_bottom, int64_t pad_left, int64_t pad_right, bool pad_one, int64_t pool_h, int64_t pool_w, \
      int64_t x_repeats
#define JAXBNN_CONV_ATTRS                                                                                       \
  ConvAttrs {                                                                                                   \
    c, o, kh, kw, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right, pad_one, pool_h, pool_w, x_repeats \
  }

ffi::Error BConvI32Impl(cudaStream_t stream, ffi::Buffer<ffi::U32> x, ffi::Buffer<ffi::U32> w,
                        ffi::Buffer<ffi::S32> tap_popc, JAXBNN_CONV_ATTR_PARAMS, ffi::ResultBuffer<ffi::S32> out) {
  return BConv(stream, x, w, tap_popc, JAXBNN_CONV_ATTRS, EpilogueArgs{}, out->dimensions(), out->untyped_data());
}

ffi::Error BConvI16Impl(cudaStream_t stream, ffi::Buffer<ffi::U32> x, ffi::Buffer<ffi::U32> w,
                        ffi::Buffer<ffi::S32> tap_popc, JAXBNN_CONV_ATTR_PARAMS, ffi::ResultBuffer<ffi::S16> out) {
  return BConv(stream, x, w, tap_popc, JAXBNN_CONV_ATTRS, EpilogueArgs{Epilogue::kInt16}, out->dimensions(),
               out->untyped_data());
}

ffi::Error BConvF32Impl(cudaStream_t stream, ffi::Buffer<ffi::U32> x, ffi::Buffer<ffi::U32> w,
                        ffi::Buffer<ffi::S32> tap_popc, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias,
                        JAXBNN_CONV_ATTR_PARAMS, ffi::ResultBuffer<ffi::F32> out) {
  EpilogueArgs e{Epilogue::kAffine, &scale, &bias, nullptr, nullptr};
  return BConv(stream, x, w, tap_popc, JAXBNN_CONV_ATTRS, e, out->dimensions(), out->untyped_data());
}

ffi::Error BConvBitsImpl(cudaStream_t stream, ffi::Buffer<ffi::U32> x, ffi::Buffer<ffi::U32> w,
                         ffi::Buffer<ffi::S32> tap_popc, ffi::Buffer<ffi::S32> threshold, ffi::Buffer<ffi::U8> flip,
                         JAXBNN_CONV_ATTR_PARAMS, ffi::ResultBuffer<ffi::U32> out) {
  EpilogueArgs e{Epilogue::kBits, nullptr, nullptr, &threshold, &flip};
  return BConv(stream, x, w, tap_popc, JAXBNN_CONV_ATTRS, e, out->dimensions(), out->untyped_data());
}

// The convolutions whose every tap's first doubled_tap_words words count twice (DoubledTapWords):
// a ternary convolution in three blocks instead of four (docs/ops.md).
ffi::Error BConvDoubledI32Impl(cudaStream_t stream, ffi::Buffer<ffi::U32> x, ffi::Buffer<ffi::U32> w,
                               ffi::Buffer<ffi::S32> tap_popc, JAXBNN_CONV_ATTR_PARAMS, int64_t doubled_tap_words,
                               ffi::ResultBuffer<ffi::S32> out) {
  return BConv(stream, x, w, tap_popc, JAXBNN_CONV_ATTRS, EpilogueArgs{}, out->dimensions(), out->untyped_data(),
               nullptr, doubled_tap_words);
}

ffi::Error BConvDoubledF32Impl(cudaStream_t stream, ffi::Buffer<ffi::U32> x, ffi::Buffer<ffi::U32> w,
                               ffi::Buffer<ffi::S32> tap_popc, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias,
                               JAXBNN_CONV_ATTR_PARAMS, int64_t doubled_tap_words, ffi::ResultBuffer<ffi::F32> out) {
  EpilogueArgs e{Epilogue::kAffine, &scale, &bias, nullptr, nullptr};
  return BConv(stream, x, w, tap_popc, JAXBNN_CONV_ATTRS, e, out->dimensions(), out->untyped_data(), nullptr,
               doubled_tap_words);
}

ffi::Error BConvDoubledBitsImpl(cudaStream_t stream, ffi::Buffer<ffi::U32> x, ffi::Buffer<ffi::U32> w,
                                ffi::Buffer<ffi::S32> tap_popc, ffi::Buffer<ffi::S32> threshold,
                                ffi::Buffer<ffi::U8> flip, JAXBNN_CONV_ATTR_PARAMS, int64_t doubled_tap_words,
                                ffi::ResultBuffer<ffi::U32> out) {
  EpilogueArgs e{Epilogue::kBits, nullptr, nullptr, &threshold, &flip};
  return BConv(stream, x, w, tap_popc, JAXBNN_CONV_ATTRS, e, out->dimensions(), out->untyped_data(), nullptr,
               doubled_tap_words);
}

// The residual convolution over a stream of type T (S32: Epilogue::kResidual, S16: kResidualInt16).
template <ffi::DataType T>
ffi::Error BConvResidualImpl(cudaStream_t stream, ffi::Buffer<ffi::U32> x, ffi::Buffer<ffi::U32> w,
                             ffi::Buffer<ffi::S32> tap_popc, ffi::Buffer<T> shortcut, JAXBNN_CONV_ATTR_PARAMS,
                             int64_t shortcut_stride, int64_t shift, ffi::ResultBuffer<T> stream_out) {
  const EpilogueArgs e{T == ffi::S16 ? Epilogue::kResidualInt16 : Epilogue::kResidual, nullptr, nullptr, nullptr,
                       nullptr};
  const ResidualArgs r{shortcut.untyped_data(), shortcut.dimensions(), shortcut_stride, shift, {}, nullptr};
  return BConv(stream, x, w, tap_popc, JAXBNN_CONV_ATTRS, e, stream_out->dimensions(), stream_out->untyped_data(), &r);
}

// The same with the stream's bits against threshold / flip.
template <ffi::DataType T>
ffi::Error BConvResidualBitsImpl(cudaStream_t stream, ffi::Buffer<ffi::U32> x, ffi::Buffer<ffi::U32> w,
                                 ffi::Buffer<ffi::S32> tap_popc, ffi::Buffer<T> shortcut,
                                 ffi::Buffer<ffi::S32> threshold, ffi::Buffer<ffi::U8> flip, JAXBNN_CONV_ATTR_PARAMS,
                                 int64_t shortcut_stride, int64_t shift, ffi::ResultBuffer<T> stream_out,
                                 ffi::ResultBuffer<ffi::U32> bits) {
  const EpilogueArgs e{T == ffi::S16 ? Epilogue::kResidualInt16 : Epilogue::kResidual, nullptr, nullptr, &threshold,
                       &flip};
  const ResidualArgs r{shortcut.untyped_data(), shortcut.dimensions(), shortcut_stride, shift, bits->dimensions(),
                       bits->typed_data()};
  return BConv(stream, x, w, tap_popc, JAXBNN_CONV_ATTRS, e, stream_out->dimensions(), stream_out->untyped_data(), &r);
}

#define JAXBNN_IMAGE_ATTR_PARAMS                                                                            \
  int64_t c, int64_t n, int64_t kh, int64_t kw, int64_t stride_h, int64_t stride_w, int64_t pad_top,       \
      int64_t pad_bottom, int64_t pad_left, int64_t pad_right, int64_t pool_h, int64_t pool_w
#define JAXBNN_IMAGE_ATTRS \
  ImageConvAttrs { c, n, kh, kw, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right, pool_h, pool_w }

// The stream alone, int32 (S32) or int16 (S16).
template <ffi::DataType T>
ffi::Error ImageConvStreamImpl(cudaStream_t stream, ffi::AnyBuffer levels, ffi::Buffer<ffi::S8> kernel,
                               JAXBNN_IMAGE_ATTR_PARAMS, int64_t shift, ffi::ResultBuffer<T> out) {
  ImageConvResults results;
  results.stream = out->untyped_data();
  results.stream_dims = out->dimensions();
  results.narrow = T == ffi::S16;
  return ImageConv(stream, levels, kernel, JAXBNN_IMAGE_ATTRS, nullptr, nullptr, shift, results);
}

ffi::Error ImageConvBitsImpl(cudaStream_t stream, ffi::AnyBuffer levels, ffi::Buffer<ffi::S8> kernel,
                             ffi::Buffer<ffi::S32> threshold, ffi::Buffer<ffi::U8> flip, JAXBNN_IMAGE_ATTR_PARAMS,
                             ffi::ResultBuffer<ffi::U32> out) {
  ImageConvResults results;
  results.bits = out->typed_data();
  results.bits_dims = out->dimensions();
  return ImageConv(stream, levels, kernel, JAXBNN_IMAGE_ATTRS, &threshold, &flip, 0, results);
}

// The stream (T: S32 or S16) and its threshold planes' bits, from the same values.
template <ffi::DataType T>
ffi::Error ImageConvStreamBitsImpl(cudaStream_t stream, ffi::AnyBuffer levels, ffi::Buffer<ffi::S8> kernel,
                                   ffi::Buffer<ffi::S32> threshold, ffi::Buffer<ffi::U8> flip, JAXBNN_IMAGE_ATTR_PARAMS,
                                   int64_t shift, ffi::ResultBuffer<T> stream_out, ffi::ResultBuffer<ffi::U32> bits) {
  ImageConvResults results;
  results.stream = stream_out->untyped_data();
  results.stream_dims = stream_out->dimensions();
  results.narrow = T == ffi::S16;
  results.bits = bits->typed_data();
  results.bits_dims = bits->dimensions();
  return ImageConv(stream, levels, kernel, JAXBNN_IMAGE_ATTRS, &threshold, &flip, shift, results);
}

}  // namespace

void SetForcedKernelPath(KernelPath path) { g_forced_path.store(static_cast<int>(path)); }
KernelPath LastKernelPath() { return static_cast<KernelPath>(g_last_path.load()); }
HandlerStats GetHandlerStats() { return {g_handler_calls.load(), g_handler_nanoseconds.load()}; }

}  // namespace jaxbnn::cuda

#define JAXBNN_BIND_STREAM ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
#define JAXBNN_BIND_CONV_ATTRS                                                                                     \
  .Attr<int64_t>("c").Attr<int64_t>("o").Attr<int64_t>("kh").Attr<int64_t>("kw").Attr<int64_t>("stride_h")     \
      .Attr<int64_t>("stride_w").Attr<int64_t>("pad_top").Attr<int64_t>("pad_bottom").Attr<int64_t>("pad_left") \
      .Attr<int64_t>("pad_right").Attr<bool>("pad_one").Attr<int64_t>("pool_h").Attr<int64_t>("pool_w")     \
      .Attr<int64_t>("x_repeats")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmI32, jaxbnn::cuda::BmmI32Impl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::Buffer<ffi::S32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmI16, jaxbnn::cuda::BmmI16Impl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::Buffer<ffi::S16>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmF32, jaxbnn::cuda::BmmF32Impl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmBits, jaxbnn::cuda::BmmBitsImpl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmChainF32, jaxbnn::cuda::BmmChainF32Impl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .RemainingArgs()
                                  .Attr<ffi::Span<const int64_t>>("ks")
                                  .Attr<ffi::Span<const int64_t>>("ns")
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmChainBits, jaxbnn::cuda::BmmChainBitsImpl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .RemainingArgs()
                                  .Attr<ffi::Span<const int64_t>>("ks")
                                  .Attr<ffi::Span<const int64_t>>("ns")
                                  .Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmDoubledI32, jaxbnn::cuda::BmmDoubledI32Impl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("doubled_k_blocks")
                                  .Ret<ffi::Buffer<ffi::S32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmDoubledF32, jaxbnn::cuda::BmmDoubledF32Impl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("doubled_k_blocks")
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBmmDoubledBits, jaxbnn::cuda::BmmDoubledBitsImpl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("doubled_k_blocks")
                                  .Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvI32, jaxbnn::cuda::BConvI32Impl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>() JAXBNN_BIND_CONV_ATTRS.Ret<ffi::Buffer<ffi::S32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvI16, jaxbnn::cuda::BConvI16Impl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>() JAXBNN_BIND_CONV_ATTRS.Ret<ffi::Buffer<ffi::S16>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvF32, jaxbnn::cuda::BConvF32Impl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() JAXBNN_BIND_CONV_ATTRS.Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvBits, jaxbnn::cuda::BConvBitsImpl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>() JAXBNN_BIND_CONV_ATTRS.Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvDoubledI32, jaxbnn::cuda::BConvDoubledI32Impl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>() JAXBNN_BIND_CONV_ATTRS.Attr<int64_t>("doubled_tap_words")
                                  .Ret<ffi::Buffer<ffi::S32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvDoubledF32, jaxbnn::cuda::BConvDoubledF32Impl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>() JAXBNN_BIND_CONV_ATTRS.Attr<int64_t>("doubled_tap_words")
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvDoubledBits, jaxbnn::cuda::BConvDoubledBitsImpl,
                              JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>() JAXBNN_BIND_CONV_ATTRS.Attr<int64_t>("doubled_tap_words")
                                  .Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

#define JAXBNN_BIND_RESIDUAL(T)                                                                             \
  JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()                                                           \
      .Arg<ffi::Buffer<ffi::U32>>()                                                                         \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                         \
      .Arg<ffi::Buffer<T>>() JAXBNN_BIND_CONV_ATTRS.Attr<int64_t>("shortcut_stride")                        \
      .Attr<int64_t>("shift")                                                                               \
      .Ret<ffi::Buffer<T>>()
#define JAXBNN_BIND_RESIDUAL_BITS(T)                                                                        \
  JAXBNN_BIND_STREAM.Arg<ffi::Buffer<ffi::U32>>()                                                           \
      .Arg<ffi::Buffer<ffi::U32>>()                                                                         \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                         \
      .Arg<ffi::Buffer<T>>()                                                                                \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                         \
      .Arg<ffi::Buffer<ffi::U8>>() JAXBNN_BIND_CONV_ATTRS.Attr<int64_t>("shortcut_stride")                  \
      .Attr<int64_t>("shift")                                                                               \
      .Ret<ffi::Buffer<T>>()                                                                                \
      .Ret<ffi::Buffer<ffi::U32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvResidualI32, jaxbnn::cuda::BConvResidualImpl<ffi::S32>,
                              JAXBNN_BIND_RESIDUAL(ffi::S32), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvResidualBits, jaxbnn::cuda::BConvResidualBitsImpl<ffi::S32>,
                              JAXBNN_BIND_RESIDUAL_BITS(ffi::S32), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvResidualI16, jaxbnn::cuda::BConvResidualImpl<ffi::S16>,
                              JAXBNN_BIND_RESIDUAL(ffi::S16), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaBConvResidualI16Bits, jaxbnn::cuda::BConvResidualBitsImpl<ffi::S16>,
                              JAXBNN_BIND_RESIDUAL_BITS(ffi::S16), {ffi::Traits::kCmdBufferCompatible});

#define JAXBNN_BIND_IMAGE_ATTRS                                                                                    \
  .Attr<int64_t>("c").Attr<int64_t>("n").Attr<int64_t>("kh").Attr<int64_t>("kw").Attr<int64_t>("stride_h")     \
      .Attr<int64_t>("stride_w").Attr<int64_t>("pad_top").Attr<int64_t>("pad_bottom").Attr<int64_t>("pad_left") \
      .Attr<int64_t>("pad_right").Attr<int64_t>("pool_h").Attr<int64_t>("pool_w")

#define JAXBNN_BIND_IMAGE_STREAM(T)                                                                                \
  JAXBNN_BIND_STREAM.Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S8>>() JAXBNN_BIND_IMAGE_ATTRS.Attr<int64_t>(     \
      "shift").Ret<ffi::Buffer<T>>()
#define JAXBNN_BIND_IMAGE_STREAM_BITS(T)                                                                           \
  JAXBNN_BIND_STREAM.Arg<ffi::AnyBuffer>()                                                                         \
      .Arg<ffi::Buffer<ffi::S8>>()                                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                                \
      .Arg<ffi::Buffer<ffi::U8>>() JAXBNN_BIND_IMAGE_ATTRS.Attr<int64_t>("shift")                                  \
      .Ret<ffi::Buffer<T>>()                                                                                       \
      .Ret<ffi::Buffer<ffi::U32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaImageConvI32, jaxbnn::cuda::ImageConvStreamImpl<ffi::S32>,
                              JAXBNN_BIND_IMAGE_STREAM(ffi::S32), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaImageConvI16, jaxbnn::cuda::ImageConvStreamImpl<ffi::S16>,
                              JAXBNN_BIND_IMAGE_STREAM(ffi::S16), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaImageConvI32Bits, jaxbnn::cuda::ImageConvStreamBitsImpl<ffi::S32>,
                              JAXBNN_BIND_IMAGE_STREAM_BITS(ffi::S32), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaImageConvI16Bits, jaxbnn::cuda::ImageConvStreamBitsImpl<ffi::S16>,
                              JAXBNN_BIND_IMAGE_STREAM_BITS(ffi::S16), {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaImageConvBits, jaxbnn::cuda::ImageConvBitsImpl,
                              JAXBNN_BIND_STREAM.Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>() JAXBNN_BIND_IMAGE_ATTRS.Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaGlobalSumBits, jaxbnn::cuda::GlobalSumBitsImpl,
                              JAXBNN_BIND_STREAM.Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbnnCudaStreamBits, jaxbnn::cuda::StreamBitsImpl,
                              JAXBNN_BIND_STREAM.Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});
