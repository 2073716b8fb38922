// CPU ceilings of the popcount products (AVX-512 VPOPCNTDQ): the cost of one 512-bit word of each product's
// inner loop (8 output columns x 64 products), in units of one 512-bit float32 FMA (16 products), from
// register-only loops of 8 independent accumulators, as the kernels of xla_ffi/cpu run them. The last
// column is the most a product can gain over a float32 layer running at the FMA peak: 32 FMAs per 512
// products over the word's cost.
// Build: g++ -O2 -mavx512f -mavx512vpopcntdq benchmarks/ceiling/cpu_words.cc -o cpu_words
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>

alignas(64) static uint64_t panel[16];  // the broadcast activation words

// Eight words a loop: accumulators zmm0-7 (TNN: zmm0-7 and zmm24-28, 16-18), temporaries zmm8-15 and
// zmm16-23, weight registers zmm29-31; rax: the panel.
#define JAXBNN_LOOP(name, word)                                                                             \
  __attribute__((noinline)) void name(long n) {                                                             \
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

template <class F>
double Seconds(F f, long n) {
  const auto start = std::chrono::steady_clock::now();
  f(n);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int main() {
  const long n = 2000000;  // ~5 ms a loop: short rounds, so that a busy machine hits both sides of a ratio alike
  struct Word {
    const char* name;
    void (*loop)(long);
  } words[] = {{"BNN (xor, popcnt, add)", bnn},
               {"TBN / BTN (ternlog, popcnt, add)", gated},
               {"TNN, TAB's form (and, ternlog, 2 popcnt, 2 add)", tnn},
               {"TNN, two gated words", tnn_two}};
  std::printf("%-48s %8s %8s\n", "word (8 columns x 64 products)", "FMAs", "ceiling");
  for (const Word& word : words) {
    // the median of 41 rounds, each against an FMA loop run right before it (the clock may move)
    double ratios[41];
    for (double& ratio : ratios) {
      const double fma_s = Seconds(fma, n);
      ratio = Seconds(word.loop, n) / fma_s;
    }
    std::nth_element(ratios, ratios + 20, ratios + 41);
    std::printf("%-48s %8.2f %7.1fx\n", word.name, ratios[20], 32.0 / ratios[20]);
  }
}
