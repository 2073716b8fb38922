// What the first-layer kernels use: predicated global loads whose latency overlaps later work (the im2col
// kernel's gathers of int8 levels, the kernels' weights; each is issued here and waited for where its register is
// first read), and the threshold planes' bounds and flip words in shared memory, the value the epilogue writes
// and compares.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/image_conv.h"

namespace jaxbnn::cuda {

// A byte into a register that keeps its value (the caller's 0) where `take` is false.
__device__ __forceinline__ void LoadByte(uint32_t& reg, const int8_t* address, int take) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p ld.global.nc.u8 %0, [%1];\n}\n"
      : "+r"(reg)
      : "l"(address), "r"(take));
}
__device__ __forceinline__ void LoadWord(uint32_t& reg, const int8_t* address, int take) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p ld.global.nc.u32 %0, [%1];\n}\n"
      : "+r"(reg)
      : "l"(address), "r"(take));
}

// 16 bytes into four registers that keep their values (the caller's zeros) where `take` is false.
__device__ __forceinline__ void LoadQuad(uint32_t (&reg)[4], const int8_t* address, int take) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "+r"(reg[0]), "+r"(reg[1]), "+r"(reg[2]), "+r"(reg[3])
      : "l"(address), "r"(take));
}

// Four loaded bytes as one word, b0 | b1 << 8 | b2 << 16 | b3 << 24 (a word load's whole word in b0, the others
// 0). In asm volatile, so that it stays after the barrier or the loads that precede it: the loads are then
// waited for there (compiled plainly, each byte's zero-extension followed its load).
__device__ __forceinline__ uint32_t Word(const uint32_t (&b)[4]) {
  uint32_t word;
  asm volatile(
      "{\n .reg .b32 t1, t2, t3;\n shl.b32 t1, %2, 8;\n shl.b32 t2, %3, 16;\n shl.b32 t3, %4, 24;\n"
      " or.b32 %0, %1, t1;\n or.b32 %0, %0, t2;\n or.b32 %0, %0, t3;\n}\n"
      : "=r"(word)
      : "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]));
  return word;
}

// The epilogue's value of a (pooled) pre-activation: pre >> shift (floor division by 2^shift), narrowed to int16
// where the stream is (its low 16 bits, sign-extended); the stream stores it and the threshold planes compare it.
__device__ __forceinline__ int StreamValue(const ImageConvProblem& p, int pre) {
  const int v = pre >> p.shift;
  return p.narrow_stream ? static_cast<int16_t>(v) : v;
}

// Whether the epilogue's values differ from the pre-activations (a shift or the int16 stream's narrowing).
__device__ __forceinline__ bool TransformsValues(const ImageConvProblem& p) { return p.shift != 0 || p.narrow_stream; }

// Each plane's bounds and flip words of the `cols` columns from col0 (bound[plane * cols + i], flip_word[(plane *
// cols + i) / 32]), by `threads` threads: bit = (v >= bound) XOR flip for the epilogue's value v (StreamValue),
// with bound = t + 1 where flipped (v <= t is the negation of v >= t + 1). t is first clamped to [INT_MIN + 1,
// INT_MAX - 1], which changes no bit: |v| <= |pre| < 2^31 - 2^14 by the handler's bound on K, or |v| <= 2^15.
// Columns past N get INT_MAX, above every value, and no flip: their bits stay 0. `cols` is a multiple of 32, so whole warps take a plane's words.
__device__ __forceinline__ void LoadImageBounds(const ImageConvProblem& p, int* bound, uint32_t* flip_word, int col0,
                                                int cols, int tid, int threads) {
  for (int i = tid; i < p.planes * cols; i += threads) {
    const int plane = i / cols, n = col0 + i % cols;
    const bool real = n < p.n;
    const int t = real ? min(max(p.threshold[plane * p.n + n], INT_MIN + 1), INT_MAX - 1) : 0;
    const bool flip = real && p.flip[plane * p.n + n] != 0;
    bound[i] = real ? t + (flip ? 1 : 0) : INT_MAX;
    const uint32_t flips = __ballot_sync(0xffffffffu, flip);
    if (i % 32 == 0) flip_word[i / 32] = flips;
  }
}

}  // namespace jaxbnn::cuda
