// CPU ceilings of the popcount products: the cost of one word of each product's inner loop, in units of one
// float32 FMA of the same width, from register-only loops of independent accumulators, as the kernels of
// xla_ffi/cpu run them. The last column is the most a product can gain over a float32 layer running at the FMA
// peak: the word's products per FMA's products over the word's cost.
//   AVX-512 VPOPCNTDQ (the panel kernels): a 512-bit word of 8 output columns x 64 products, in 512-bit FMAs (16
//   products).
//   AVX2 (the lane kernels): the low and the high nibbles of a 32-bit word of 8 output columns, 8 x 32 products, in
//   256-bit FMAs (8 products); the row word's nibbles are split once for several tile rows, so they are registers
//   here.
// Each tier runs where the CPU has it. Build: g++ -O2 benchmarks/ceiling/cpu_words.cc -o cpu_words
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>

alignas(64) static uint64_t panel[16];  // the broadcast activation words

// Eight words a loop: accumulators zmm0-7 (TNN: zmm0-7 and zmm24-28, 16-18), temporaries zmm8-15 and
// zmm16-23, weight registers zmm29-31; rax: the panel.
#define JAXBNN_LOOP(name, word)                                                                             \
  __attribute__((noinline, target("avx512f"))) void name(long n) {                                                             \
    for (long i = 0; i < n; i++) {                                                                          \
      asm volatile(word(0, 8, 24) word(1, 9, 25) word(2, 10, 26) word(3, 11, 27) word(4, 12, 28)           \
                       word(5, 13, 16) word(6, 14, 17) word(7, 15, 18)::"a"(panel)                          \
                   : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",  \
                     "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", \
                     "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "memory");   \
    }                                                                                                       \
  }

#define R(x) "%%zmm" #x
// float32: one FMA (16 products)
#define FMA(a, t, u) "vfmadd231ps %%zmm30, %%zmm31, " R(a) "\n"
// BNN: XOR with the broadcast panel word, popcount, add
#define BNN(a, t, u) "vpxorq 8(%%rax)%{1to8%}, %%zmm30, " R(t) "\n vpopcntq " R(t) ", " R(t) "\n vpaddq " R(t) ", " R(a) ", " R(a) "\n"
// TBN / BTN: the gated XOR (one VPTERNLOGQ on a broadcast word), popcount, add
#define GATED(a, t, u) "vpbroadcastq 8(%%rax), " R(t) "\n vpternlogq $0x28, %%zmm31, %%zmm30, " R(t) "\n vpopcntq " R(t) ", " R(t) "\n vpaddq " R(t) ", " R(a) ", " R(a) "\n"
// TNN, TAB's form: g = z_x & z_w, popcount into accumulator a; the gated XOR of g in place, popcount into
// accumulator u
#define TNN(a, t, u) "vpandq 8(%%rax)%{1to8%}, %%zmm30, " R(t) "\n vpopcntq " R(t) ", %%zmm19\n vpaddq %%zmm19, " R(a) ", " R(a) "\n" \
  "vpternlogq $0x60, 16(%%rax)%{1to8%}, %%zmm31, " R(t) "\n vpopcntq " R(t) ", " R(t) "\n vpaddq " R(t) ", " R(u) ", " R(u) "\n"
// TNN as two ±1 x ternary products: two gated XORs on the two activation planes, one accumulator
#define TNN_TWO(a, t, u) GATED(a, t, u) "vpbroadcastq 16(%%rax), %%zmm19\n vpternlogq $0x28, %%zmm31, %%zmm30, %%zmm19\n vpopcntq %%zmm19, %%zmm19\n vpaddq %%zmm19, " R(a) ", " R(a) "\n"

JAXBNN_LOOP(fma, FMA)
JAXBNN_LOOP(bnn, BNN)
JAXBNN_LOOP(gated, GATED)
JAXBNN_LOOP(tnn, TNN)
JAXBNN_LOOP(tnn_two, TNN_TWO)

alignas(32) static uint32_t lane_weights[32];  // a lane tile row's word: two planes' low and high nibbles

// AVX2, eight words a loop: accumulators ymm0-3 (FMA: ymm0-7), temporaries ymm4-9 (word a: MOD4(a)), the nibble-count table ymm10
// (doubled: ymm11), the row word's nibbles ymm12-15 (a_x / the bits low, high; z_x low, high); rax: the weights,
// read as memory operands as the kernels read them.
#define JAXBNN_LOOP_AVX2(name, word)                                                                        \
  __attribute__((noinline)) void name(long n) {                                                             \
    for (long i = 0; i < n; i++) {                                                                          \
      asm volatile(word(0, 4, 5) word(1, 6, 7) word(2, 8, 9) word(3, 4, 5) word(4, 6, 7) word(5, 8, 9)     \
                       word(6, 4, 5) word(7, 6, 7)::"a"(lane_weights)                                         \
                   : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "memory"); \
    }                                                                                                       \
  }

#define Y_(x) "%%ymm" #x
#define Y(x) Y_(x)
#define ACC(a) Y(a) ", " Y(a)
// the four accumulators of the popcount words
#define MOD4_0 0
#define MOD4_1 1
#define MOD4_2 2
#define MOD4_3 3
#define MOD4_4 0
#define MOD4_5 1
#define MOD4_6 2
#define MOD4_7 3
#define MOD4(a) MOD4_##a
// float32: one FMA (8 products); eight accumulators
#define FMA_AVX2(a, t, u) "vfmadd231ps %%ymm12, %%ymm13, " Y(a) "\n"
// BNN: per nibble half, XOR with the weights' nibbles, look up, add
#define BNN_HALF(a, t, at, x) "vpxor " at "(%%rax), " x ", " Y(t) "\n vpshufb " Y(t) ", %%ymm10, " Y(t) "\n vpaddb " Y(t) ", " ACC(a) "\n"
#define BNN_AVX2(a, t, u) BNN_HALF(MOD4(a), t, "0", "%%ymm12") BNN_HALF(MOD4(a), u, "32", "%%ymm13")
// TBN / BTN: per nibble half, the XOR gated (an AND), look up, add
#define GATED_HALF(a, t, at, x, gate) "vpxor " at "(%%rax), " x ", " Y(t) "\n vpand " gate ", " Y(t) ", " Y(t) "\n vpshufb " Y(t) ", %%ymm10, " Y(t) "\n vpaddb " Y(t) ", " ACC(a) "\n"
#define GATED_AVX2(a, t, u) GATED_HALF(MOD4(a), t, "0", "%%ymm12", "%%ymm14") GATED_HALF(MOD4(a), u, "32", "%%ymm13", "%%ymm15")
// TNN: per nibble half, g = z_x & z_w and g & (a_x ^ b_w); add the lookup of one, subtract the doubled lookup of
// the other
#define TNN_HALF(a, t, u, at_z, at_b, x, z) "vpand " at_z "(%%rax), " z ", " Y(t) "\n vpxor " at_b "(%%rax), " x ", " Y(u) "\n vpand " Y(t) ", " Y(u) ", " Y(u) "\n vpshufb " Y(t) ", %%ymm10, " Y(t) "\n vpshufb " Y(u) ", %%ymm11, " Y(u) "\n vpaddb " Y(t) ", " ACC(a) "\n vpsubb " Y(u) ", " ACC(a) "\n"
#define TNN_AVX2(a, t, u) TNN_HALF(MOD4(a), t, u, "0", "64", "%%ymm12", "%%ymm14") TNN_HALF(MOD4(a), t, u, "32", "96", "%%ymm13", "%%ymm15")

JAXBNN_LOOP_AVX2(fma_avx2, FMA_AVX2)
JAXBNN_LOOP_AVX2(bnn_avx2, BNN_AVX2)
JAXBNN_LOOP_AVX2(gated_avx2, GATED_AVX2)
JAXBNN_LOOP_AVX2(tnn_avx2, TNN_AVX2)

template <class F>
double Seconds(F f, long n) {
  const auto start = std::chrono::steady_clock::now();
  f(n);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct Word {
  const char* name;
  void (*loop)(long);
};

// Per word its cost in FMAs, the median of 41 rounds, each against an FMA loop run right before it (the clock may
// move), and its ceiling: `products` (the word's products over the FMA's) over that cost.
void Table(const char* tier, void (*fma_loop)(long), const Word* words, int count, double products) {
  const long n = 2000000;  // ~5 ms a loop: short rounds, so that a busy machine hits both sides of a ratio alike
  std::printf("%-48s %8s %8s\n", tier, "FMAs", "ceiling");
  for (const Word* word = words; word < words + count; ++word) {
    double ratios[41];
    for (double& ratio : ratios) {
      const double fma_s = Seconds(fma_loop, n);
      ratio = Seconds(word->loop, n) / fma_s;
    }
    std::nth_element(ratios, ratios + 20, ratios + 41);
    std::printf("%-48s %8.2f %7.1fx\n", word->name, ratios[20], products / ratios[20]);
  }
}

int main() {
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vpopcntdq")) {
    const Word words[] = {{"BNN (xor, popcnt, add)", bnn},
                          {"TBN / BTN (ternlog, popcnt, add)", gated},
                          {"TNN, TAB's form (and, ternlog, 2 popcnt, 2 add)", tnn},
                          {"TNN, two gated words", tnn_two}};
    Table("AVX-512: word (8 columns x 64 products)", fma, words, 4, 32.0);
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    const Word words[] = {{"BNN (2 x: xor, pshufb, add)", bnn_avx2},
                          {"TBN / BTN (2 x: xor, and, pshufb, add)", gated_avx2},
                          {"TNN (2 x: 2 and, xor, 2 pshufb, add, sub)", tnn_avx2}};
    Table("AVX2: word (8 columns x 32 products)", fma_avx2, words, 3, 32.0);
  }
}
