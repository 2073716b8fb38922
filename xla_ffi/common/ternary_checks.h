// Validation of the ternary and mixed FFI calls of docs/ops.md (jaxbnn_{tnn,tbn,btn}_bmm_* and
// jaxbnn_{tnn,tbn,btn}_conv2d_*), with the pieces and messages of checks.h; their threshold epilogue also
// takes several planes of thresholds (a ternary output's two).
// Header-only; needs only the XLA FFI headers (no CUDA).
#ifndef JAXBNN_XLA_FFI_COMMON_TERNARY_CHECKS_H_
#define JAXBNN_XLA_FFI_COMMON_TERNARY_CHECKS_H_

#include <initializer_list>
#include <string>
#include <string_view>

#include "common/checks.h"

namespace jaxbnn {

// The operands of a ternary or mixed call: ternary activations (`ternary_activations`) are one operand holding
// both planes of each row (or pixel) side by side, (..., 2, words): the nonneg plane's words, then the pos
// plane's, as a threshold epilogue of two planes writes them; binary ones one plane (..., words). Ternary
// weights are FSB tiles of 2 * n rows (the nonneg plane's, then the pos plane's), binary weights n rows; the
// popcounts of the weights' rows (or taps) where the product needs them (BTN), else `w_popcount` null.
struct MixedOperands {
  const ffi::AnyBuffer* x;
  bool ternary_activations;
  const ffi::AnyBuffer* w;
  const ffi::AnyBuffer* w_popcount;
  bool ternary_weights;
};

namespace checks {

// FSB weights of n (binary) or 2 * n (ternary) rows and `bits` reduction bits, and the popcounts of
// ternary weights, operand `popcount_name` of shape `popcount_shape` (its last dim 2 * n).
inline ffi::Error CheckMixedWeights(std::string_view target, const MixedOperands& operands, int64_t n,
                                    int64_t bits, const char* n_name, const char* popcount_name,
                                    std::initializer_list<int64_t> popcount_shape, const char* popcount_layout,
                                    const std::string& why_popcount) {
  const bool ternary = operands.ternary_weights;
  if (auto e = CheckDtypeRank(target, "operand `w`", *operands.w, ffi::DataType::U32, 4,
                              "(NT, KT, BH, BW/32) of FSB tiles");
      e.failure()) {
    return e;
  }
  const std::string rows_name = ternary ? std::string("2 * ") + n_name : std::string(n_name);
  if (auto e = CheckFsbGeometry(target, "operand `w`", *operands.w, ternary ? 2 * n : n, bits, rows_name.c_str());
      e.failure()) {
    return e;
  }
  if (operands.w_popcount == nullptr) return ffi::Error::Success();
  if (auto e = CheckDtypeRank(target, popcount_name, *operands.w_popcount, ffi::DataType::S32,
                              popcount_shape.size(), popcount_layout);
      e.failure()) {
    return e;
  }
  return CheckShape(target, popcount_name, *operands.w_popcount, popcount_shape, why_popcount.c_str());
}

}  // namespace checks

// Validates a jaxbnn_{tnn,tbn,btn}_bmm_{i32,f32,bits} call; on success fills `problem` (n: output columns;
// the tile shape: that of `w`).
inline ffi::Error CheckMixedBmm(std::string_view target, Epilogue epilogue, const MixedOperands& operands,
                                const EpilogueOperands& epilogue_operands, int64_t k, int64_t n,
                                const ffi::AnyBuffer& out, BmmProblem* problem) {
  using namespace checks;
  if (auto e = CheckAttrRange(target, "k", k, 0, kMaxReduction); e.failure()) return e;
  if (auto e = CheckAttrRange(target, "n", n, 0, kMaxAttr / 2); e.failure()) return e;
  const bool planes = operands.ternary_activations;
  const char* a_name = planes ? "operand `x`" : "operand `a`";
  if (auto e = CheckDtypeRank(target, a_name, *operands.x, ffi::DataType::U32, planes ? 3 : 2,
                              planes ? "(M, 2, ceil(k/32))" : "(M, ceil(k/32))");
      e.failure()) {
    return e;
  }
  int64_t m = operands.x->dimensions()[0];
  int64_t k_words = formats::WordsForBits(k);
  std::string why_a = "k = " + std::to_string(k) + (planes ? " and the 2 planes of ternary activations" : "");
  if (auto e = planes ? CheckShape(target, a_name, *operands.x, {m, 2, k_words}, why_a.c_str())
                      : CheckShape(target, a_name, *operands.x, {m, k_words}, why_a.c_str());
      e.failure()) {
    return e;
  }
  std::string why_popcount = "the two planes of n = " + std::to_string(n) + " output columns";
  if (auto e = CheckMixedWeights(target, operands, n, k, "n", "operand `w_popcount`", {2 * n}, "(2 * n,)",
                                 why_popcount);
      e.failure()) {
    return e;
  }
  if (auto e = CheckEpilogueAndResult(target, epilogue, epilogue_operands, n, "n", out, {m}); e.failure()) return e;
  auto w_dims = operands.w->dimensions();
  *problem = BmmProblem{m, k, n, k_words, w_dims[0], w_dims[1], w_dims[2], w_dims[3], epilogue};
  return ffi::Error::Success();
}

// Validates a jaxbnn_{tnn,tbn,btn}_conv2d_{i32,f32,bits} call (the attributes of jaxbnn_bconv2d_*; `int_type`:
// that of an integer result, the residual targets' int16 stream); on success fills `problem` (o: output
// channels).
inline ffi::Error CheckMixedConv2d(std::string_view target, Epilogue epilogue, const MixedOperands& operands,
                                   const EpilogueOperands& epilogue_operands, const Bconv2dAttrs& attrs,
                                   const ffi::AnyBuffer& out, Bconv2dProblem* problem,
                                   ffi::DataType int_type = ffi::DataType::S32) {
  using namespace checks;
  if (auto e = CheckAttrRange(target, "o", attrs.o, 1, kMaxAttr / 2); e.failure()) return e;
  Bconv2dProblem p;
  if (auto e = CheckConvInput(target, attrs, *operands.x, "operand `x`", &p, operands.ternary_activations ? 2 : 0);
      e.failure()) {
    return e;
  }
  std::string why_popcount = "kh * kw = " + std::to_string(attrs.kh * attrs.kw) + " taps and the two planes of o = " +
                             std::to_string(attrs.o) + " output channels";
  if (auto e = CheckMixedWeights(target, operands, attrs.o, p.k_words * formats::kWordBits, "o",
                                 "operand `w_tap_popcount`", {attrs.kh * attrs.kw, 2 * attrs.o}, "(kh*kw, 2 * o)",
                                 why_popcount);
      e.failure()) {
    return e;
  }
  if (auto e = CheckEpilogueAndResult(target, epilogue, epilogue_operands, attrs.o, "o", out,
                                      {p.batch, p.out_h, p.out_w}, int_type);
      e.failure()) {
    return e;
  }
  auto w_dims = operands.w->dimensions();
  p.o_tiles = w_dims[0], p.k_tiles = w_dims[1], p.tile_rows = w_dims[2], p.tile_words = w_dims[3];
  p.epilogue = epilogue;
  *problem = p;
  return ffi::Error::Success();
}

}  // namespace jaxbnn

#endif  // JAXBNN_XLA_FFI_COMMON_TERNARY_CHECKS_H_
