// Predicated global loads whose latency overlaps later work (the first-layer kernels' gathers of int8 levels
// and weights): each is issued here and waited for where its register is first read.
#pragma once

#include <cstdint>

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

}  // namespace jaxbnn::cuda
