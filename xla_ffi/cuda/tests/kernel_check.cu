// Host-side correctness harness of the CUDA kernels (no JAX): random problems of every op, epilogue,
// padding mode, stride, pool and odd shape, run on each engine into poisoned outputs and compared word
// for word with a direct CPU convolution (XOR-popc, independent of the kernels' AND-popc algebra).
// Also the workload of the compute-sanitizer runs (`--small`); `--residual` checks only the residual epilogue
// (Epilogue::kResidual); `--image` checks only the first-layer kernels (LaunchImageConv: int8 levels, and the same
// as uint8 pixels, aligned and not, against a CPU convolution; `--image-direct`: the direct kernel's cases, a
// sanitizer workload); `--dense` checks only the convolutions of fewer
// than 32 channels (the dense-tap kernel's and two of the word layout); `--whole-words` checks only the dense-tap
// kernel's convolutions of 32 channels (a sanitizer workload); `--band` checks only the image-band kernel's
// convolutions (BandCases, every epilogue, on its engine: wgmma); `--global-pool` checks only the global pooling kernel
// (LaunchGlobalSumBits, against a CPU sum); `--stream-bits` checks only the stream's threshold planes
// (LaunchStreamBits, against CPU comparisons); `--repeats` checks only the inputs whose taps read each pixel twice
// (BinaryGemmProblem::x_cw); `--doubled` checks only the products with doubled K blocks (the three-block
// ternary product; `--small-doubled`: a dense one and two convolutions, one by TMA boxes and one by copies, a
// sanitizer workload); `--planes` checks only the bit
// epilogue's two threshold planes (the full set of those cases; `--small-planes`: the small set's, a sanitizer
// workload of a few seconds); `--boxes` checks only the wgmma kernels' TMA boxes over strided taps and whole
// images (StridedAndWholeImageBoxCases and ResidualBoxCases, every epilogue, every engine; a sanitizer workload);
// `--chain` checks only the dense-chain kernel (LaunchDenseChain, against CPU layers one by one; `--small-chain`: its
// first cases, a sanitizer workload); `--time-image` times the first-layer launcher (and the direct kernel against the windowed one) on three shapes.
// Exit status 0 only if every case matches.
//
//   cmake -S . -B build/kernels -DJAXBNN_CUDA=ON -DJAXBNN_KERNEL_TESTS=ON && cmake --build build/kernels --target kernel_check
//   ctest --test-dir build/kernels -L check          (or -L sanitizer: memcheck, racecheck, initcheck, synccheck)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/binary_gemm.h"
#include "cuda/dense_chain.h"
#include "cuda/global_pool.h"
#include "cuda/image_conv.h"
#include "cuda/kernels/image_direct.h"
#include "cuda/kernels/image_wgmma.h"
#include "cuda/kernels/image_window.h"
#include "cuda/stream_bits.h"

using jaxbnn::cuda::BinaryGemmProblem;
using jaxbnn::cuda::Epilogue;
using jaxbnn::cuda::KernelPath;

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::printf("CUDA error %s at %s:%d: %s\n", #x, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

namespace {

// x_repeats 2: every tap reads its pixel's words twice (BinaryGemmProblem::x_cw = cw / 2), c a multiple of 64.
struct ConvCase {
  int batch, h, w, c, o, kh, kw, sh, sw, pt, pb, pl, pr, ph, pw;
  bool pad_one;
  int x_repeats = 1;
};

std::mt19937_64 rng(12345);

uint32_t RandomWord() { return static_cast<uint32_t>(rng()); }

// Random packed words with zero padding bits past `bits` in each group of `words` words.
std::vector<uint32_t> RandomPacked(size_t groups, int words, int bits) {
  std::vector<uint32_t> v(groups * words);
  for (size_t g = 0; g < groups; ++g) {
    for (int i = 0; i < words; ++i) {
      uint32_t x = RandomWord();
      const int valid = bits - 32 * i;
      if (valid < 32) x = valid <= 0 ? 0 : x & ((1u << valid) - 1);
      v[g * words + i] = x;
    }
  }
  return v;
}

template <class T>
T* ToDevice(const std::vector<T>& v) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)));
  if (!v.empty()) CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

const char* PathName(KernelPath p) {
  switch (p) {
    case KernelPath::kWgmma: return "wgmma";
    case KernelPath::kMmaSync: return "mma_sync";
    case KernelPath::kSimt: return "simt";
    default: return "auto";
  }
}

// The geometry of a case as a problem (operands and epilogue left to the caller).
BinaryGemmProblem ProblemShape(const ConvCase& cc) {
  const int cw = (cc.c + 31) / 32, taps = cc.kh * cc.kw;
  BinaryGemmProblem p;
  p.batch = cc.batch;
  p.in_h = cc.h;
  p.in_w = cc.w;
  p.cw = cw;
  p.x_cw = cw / cc.x_repeats;
  p.c = cc.c;
  p.kh = cc.kh;
  p.kw = cc.kw;
  p.stride_h = cc.sh;
  p.stride_w = cc.sw;
  p.pad_top = cc.pt;
  p.pad_left = cc.pl;
  p.pad_one = cc.pad_one;
  p.pool_h = cc.ph;
  p.pool_w = cc.pw;
  p.out_h = ((cc.h + cc.pt + cc.pb - cc.kh) / cc.sh + 1) / cc.ph;
  p.out_w = ((cc.w + cc.pl + cc.pr - cc.kw) / cc.sw + 1) / cc.pw;
  p.n = cc.o;
  p.k_words = taps * cw;
  p.w_row_tiles = (cc.o + 7) / 8;
  p.w_k_tiles = (p.k_words + 3) / 4;
  p.k_real = taps * cc.c;
  p.pooled_rows = cc.batch * p.out_h * p.out_w;
  return p;
}

// The expected output words of a case (int32, float32 bits or packed threshold bits): a direct convolution on
// the CPU, XOR-popc per in-frame tap, independent of the kernels' AND-popc algebra. Epilogue::kBits: `planes`
// planes of bits, threshold / flip (planes, o), the words (pooled_rows, planes, ceil(o/32)).
std::vector<uint32_t> ReferenceOutput(const ConvCase& cc, Epilogue ep, const std::vector<uint32_t>& x,
                                      const std::vector<uint32_t>& wrows, const std::vector<int32_t>& tap_popc,
                                      const std::vector<float>& scale, const std::vector<float>& bias,
                                      const std::vector<int32_t>& threshold, const std::vector<uint8_t>& flip,
                                      int planes = 1) {
  const int cw = (cc.c + 31) / 32, taps = cc.kh * cc.kw;
  const int conv_h = (cc.h + cc.pt + cc.pb - cc.kh) / cc.sh + 1, conv_w = (cc.w + cc.pl + cc.pr - cc.kw) / cc.sw + 1;
  const int out_h = conv_h / cc.ph, out_w = conv_w / cc.pw;
  const size_t pooled = static_cast<size_t>(cc.batch) * out_h * out_w;
  const int words = (cc.o + 31) / 32, out_cols = ep == Epilogue::kBits ? planes * words : cc.o;
  const bool halves = ep == Epilogue::kInt16;  // two values a word
  std::vector<uint32_t> want(halves ? (pooled * out_cols + 1) / 2 : pooled * out_cols, 0);
  if (halves && pooled * out_cols % 2 == 1) want.back() = 0xA5A50000u;  // the poison past the last value
  for (int b = 0; b < cc.batch; ++b) {
    for (int ohp = 0; ohp < out_h; ++ohp) {
      for (int owp = 0; owp < out_w; ++owp) {
        const size_t pix = (static_cast<size_t>(b) * out_h + ohp) * out_w + owp;
        for (int o = 0; o < cc.o; ++o) {
          int best = INT32_MIN;
          for (int e = 0; e < cc.ph * cc.pw; ++e) {
            const int oh = ohp * cc.ph + e / cc.pw, ow = owp * cc.pw + e % cc.pw;
            int dot = 0;
            for (int i = 0; i < cc.kh; ++i) {
              for (int j = 0; j < cc.kw; ++j) {
                const int ih = oh * cc.sh - cc.pt + i, iw = ow * cc.sw - cc.pl + j, t = i * cc.kw + j;
                if (ih >= 0 && ih < cc.h && iw >= 0 && iw < cc.w) {
                  int mismatches = 0;
                  for (int q = 0; q < cw; ++q) {
                    mismatches += __builtin_popcount(x[((static_cast<size_t>(b) * cc.h + ih) * cc.w + iw) * cw + q] ^
                                                     wrows[(static_cast<size_t>(o) * taps + t) * cw + q]);
                  }
                  dot += cc.c - 2 * mismatches;
                } else if (cc.pad_one) {
                  dot += cc.c - 2 * tap_popc[t * cc.o + o];  // every input -1: minus the sum of the weights
                }
              }
            }
            best = std::max(best, dot);
          }
          if (ep == Epilogue::kInt32) {
            want[pix * out_cols + o] = static_cast<uint32_t>(best);
          } else if (ep == Epilogue::kInt16) {
            const size_t i = pix * out_cols + o;
            want[i / 2] |= static_cast<uint32_t>(static_cast<uint16_t>(best)) << (16 * (i % 2));
          } else if (ep == Epilogue::kAffine) {
            volatile float prod = static_cast<float>(best) * scale[o];
            const float v = prod + bias[o];
            std::memcpy(&want[pix * out_cols + o], &v, 4);
          } else {
            for (int q = 0; q < planes; ++q) {
              const int32_t t = threshold[q * cc.o + o];
              const bool bit = flip[q * cc.o + o] ? best <= t : best >= t;
              want[pix * out_cols + q * words + o / 32] |= static_cast<uint32_t>(bit) << (o % 32);
            }
          }
        }
      }
    }
  }

  return want;
}

// Random operands of a case: the packed input, the weight rows (o rows of taps x cw words, each tap padded to
// whole words), their FSB tiles and their tap popcounts.
struct ConvOperands {
  std::vector<uint32_t> x, wrows, fsb;
  std::vector<int32_t> tap_popc;
};
ConvOperands RandomOperands(const ConvCase& cc) {
  const int cw = (cc.c + 31) / 32, taps = cc.kh * cc.kw, k_words = taps * cw;
  ConvOperands ops;
  ops.x = RandomPacked(static_cast<size_t>(cc.batch) * cc.h * cc.w, cw, cc.c);
  if (cc.x_repeats == 2) {  // each pixel's second half a copy of its first: the input as the taps read it
    for (size_t px = 0; px < ops.x.size() / cw; ++px) std::copy_n(&ops.x[px * cw], cw / 2, &ops.x[px * cw + cw / 2]);
  }
  ops.wrows = RandomPacked(static_cast<size_t>(cc.o) * taps, cw, cc.c);
  const int row_tiles = (cc.o + 7) / 8, k_tiles = (k_words + 3) / 4;
  ops.fsb.assign(static_cast<size_t>(row_tiles) * k_tiles * 32, 0);
  for (int r = 0; r < cc.o; ++r) {
    for (int k = 0; k < k_words; ++k) {
      ops.fsb[((static_cast<size_t>(r / 8) * k_tiles + k / 4) * 8 + r % 8) * 4 + k % 4] =
          ops.wrows[static_cast<size_t>(r) * k_words + k];
    }
  }
  ops.tap_popc.assign(static_cast<size_t>(taps) * cc.o, 0);
  for (int r = 0; r < cc.o; ++r) {
    for (int t = 0; t < taps; ++t) {
      for (int i = 0; i < cw; ++i) {
        ops.tap_popc[t * cc.o + r] += __builtin_popcount(ops.wrows[(static_cast<size_t>(r) * taps + t) * cw + i]);
      }
    }
  }
  return ops;
}

// The words of a case's input as they lie in memory: each pixel's first x_cw of the cw its taps read.
std::vector<uint32_t> StoredInput(const ConvCase& cc, const std::vector<uint32_t>& x) {
  const int cw = (cc.c + 31) / 32, x_cw = cw / cc.x_repeats;
  std::vector<uint32_t> stored(x.size() / cw * x_cw);
  for (size_t px = 0; px < x.size() / cw; ++px) std::copy_n(&x[px * cw], x_cw, &stored[px * x_cw]);
  return stored;
}

// The host operands of one launch of LaunchBinaryGemm (the input words as they lie in memory, FSB weights,
// popcounts, epilogue terms).
struct HostOperands {
  std::vector<uint32_t> x, fsb;
  std::vector<int32_t> popcount;
  std::vector<float> scale, bias;
  std::vector<int32_t> threshold;
  std::vector<uint8_t> flip;
};

// Runs `p` (its shape and epilogue set; the operand pointers filled here) on engine `path` into a poisoned
// output of want.size() words; returns the number of words that differ from `want`, the engine in `ran`.
long RunProblem(BinaryGemmProblem p, const HostOperands& h, const std::vector<uint32_t>& want, KernelPath path,
                bool verbose, KernelPath& ran) {
  uint32_t* d_x = ToDevice(h.x);
  uint32_t* d_w = ToDevice(h.fsb);
  int32_t* d_popc = ToDevice(h.popcount);
  float* d_scale = ToDevice(h.scale);
  float* d_bias = ToDevice(h.bias);
  int32_t* d_thr = ToDevice(h.threshold);
  uint8_t* d_flip = ToDevice(h.flip);
  uint32_t* d_out = nullptr;
  CHECK_CUDA(cudaMalloc(&d_out, std::max<size_t>(want.size(), 1) * 4));
  CHECK_CUDA(cudaMemset(d_out, 0xA5, std::max<size_t>(want.size(), 1) * 4));  // poison: unwritten words show
  p.x = d_x;
  p.w = d_w;
  p.tap_popc = d_popc;
  p.scale = d_scale;
  p.bias = d_bias;
  p.threshold = d_thr;
  p.flip = d_flip;
  p.out = d_out;
  CHECK_CUDA(jaxbnn::cuda::LaunchBinaryGemm(p, path, nullptr, &ran));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint32_t> got(want.size());
  if (!got.empty()) CHECK_CUDA(cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost));
  long bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      if (bad < 3 && verbose) std::printf("    word %zu: got %08x want %08x\n", i, got[i], want[i]);
      ++bad;
    }
  }
  for (void* ptr : {static_cast<void*>(d_x), static_cast<void*>(d_w), static_cast<void*>(d_popc),
                    static_cast<void*>(d_scale), static_cast<void*>(d_bias), static_cast<void*>(d_thr),
                    static_cast<void*>(d_flip), static_cast<void*>(d_out)}) {
    CHECK_CUDA(cudaFree(ptr));
  }
  return bad;
}

// The name of an epilogue in the harness's lines.
std::string EpilogueName(Epilogue ep, int planes) {
  return ep == Epilogue::kInt32    ? "i32"
         : ep == Epilogue::kInt16  ? "i16"
         : ep == Epilogue::kAffine ? "f32"
         : planes > 1              ? "bits" + std::to_string(planes)
                                   : "bits";
}

// Runs one case on one engine; returns the number of wrong output words. `planes`: Epilogue::kBits' threshold
// planes (BinaryGemmProblem::planes).
long RunCase(const ConvCase& cc, Epilogue ep, KernelPath path, bool verbose, int planes = 1) {
  const ConvOperands operands = RandomOperands(cc);
  const std::vector<uint32_t>&x = operands.x, &wrows = operands.wrows, &fsb = operands.fsb;
  const std::vector<int32_t>& tap_popc = operands.tap_popc;
  std::vector<float> scale(cc.o), bias(cc.o);
  std::vector<int32_t> threshold(static_cast<size_t>(planes) * cc.o);
  std::vector<uint8_t> flip(threshold.size());
  std::uniform_real_distribution<float> uni(-2.f, 2.f);
  // thresholds where the dot products lie (a spread of a few standard deviations, sqrt(k_real), at most C / 4)
  const int spread = std::min(cc.c / 4, 4 * static_cast<int>(std::sqrt(cc.kh * cc.kw * cc.c))) + 2;
  std::uniform_int_distribution<int> thr(-spread, spread), offset(0, cc.c / 8 + 2);
  for (int i = 0; i < cc.o; ++i) {
    scale[i] = uni(rng);
    bias[i] = uni(rng);
    threshold[i] = thr(rng);
    flip[i] = rng() & 1;
  }
  // Later planes mostly as a ternary output's (plane 0's threshold and flip, the threshold a little higher: the
  // planes overlap), else drawn on their own: flips and bounds that differ in every way.
  for (size_t i = cc.o; i < threshold.size(); ++i) {
    const bool overlap = rng() % 4 != 0;
    threshold[i] = overlap ? threshold[i - cc.o] + offset(rng) : thr(rng);
    flip[i] = overlap ? flip[i - cc.o] : rng() & 1;
  }
  // A few columns of every plane at the dot products' limits and past them (the kernels clamp thresholds to
  // [-k_real - 1, k_real + 1]): bits all set or all clear, and the widest gaps between two planes' bounds.
  const int k_real = cc.kh * cc.kw * cc.c;
  const int32_t extremes[] = {INT32_MIN, INT32_MAX, -k_real - 1, k_real + 1, -k_real, k_real};
  for (int32_t& t : threshold) {
    const uint64_t r = rng();
    if (r % 10 == 0) t = extremes[(r >> 8) % 6];
  }

  const std::vector<uint32_t> want =
      ReferenceOutput(cc, ep, x, wrows, tap_popc, scale, bias, threshold, flip, planes);

  BinaryGemmProblem p = ProblemShape(cc);
  p.epilogue = ep;
  p.planes = planes;
  KernelPath ran;
  const long bad = RunProblem(p, {StoredInput(cc, x), fsb, tap_popc, scale, bias, threshold, flip}, want, path,
                              verbose, ran);
  std::printf("%-8s %-5s B%d %dx%d c%d%s o%d k%dx%d s%d,%d pad(%d,%d,%d,%d)%s pool%dx%d: %ld / %zu wrong%s\n",
              PathName(ran), EpilogueName(ep, planes).c_str(), cc.batch, cc.h, cc.w, cc.c,
              cc.x_repeats > 1 ? " (read twice)" : "", cc.o, cc.kh, cc.kw, cc.sh, cc.sw, cc.pt, cc.pb, cc.pl, cc.pr,
              cc.pad_one ? " one" : " zero", cc.ph, cc.pw, bad, want.size(),
              ran != path ? " (requested engine cannot run it)" : "");
  return bad;
}

ConvCase Bmm(int m, int n, int k) { return ConvCase{m, 1, 1, k, n, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, true}; }

// ---- doubled K blocks (BinaryGemmProblem::doubled_k_blocks): the three-block ternary product ----

// A ternary convolution (a dense product: its 1 x 1 case over a 1 x 1 image) as the binary kernels run it in three
// blocks: each pixel's values [P | N | Z] (t = +1, t = -1, t != 0) against each tap's weights [P | N | E] (t' = +1,
// t' = -1, t' = 0), each block zero-padded to whole 512-bit halves of a K block, the first two blocks of every tap
// doubled (the reduction runs every tap's doubled blocks, then every tap's third: DoubledReductionWord), every tap's
// popcount half its real count 2 (D + 3 block bits), "zero" padding: then every value is 4 t . t' over the taps in
// frame. The reference is that ternary convolution, counted value by value (independent of the AND-popc algebra),
// max-pooled, then the epilogue.
struct DoubledCase {
  int batch, h, w, c, o, kh = 1, kw = 1, stride = 1, pad = 0, pool = 1;
};

DoubledCase DenseDoubled(int m, int n, int k) { return DoubledCase{m, 1, 1, k, n}; }

long RunDoubledCase(const DoubledCase& dc, Epilogue ep, KernelPath path, bool verbose, int planes = 1) {
  const int block_words = (dc.c + 511) / 512 * 16, cw = 3 * block_words, taps = dc.kh * dc.kw;
  const int k_words = taps * cw, doubled_k_blocks = taps * 2 * block_words / 32;
  const int tap_real = 2 * (2 * block_words * 32 + cw * 32);
  std::uniform_int_distribution<int> trit(-1, 1);
  auto random_trits = [&](size_t values) {
    std::vector<int8_t> t(values);
    for (int8_t& v : t) v = static_cast<int8_t>(trit(rng));
    return t;
  };
  const size_t pixels = static_cast<size_t>(dc.batch) * dc.h * dc.w;
  const std::vector<int8_t> xt = random_trits(pixels * dc.c);
  const std::vector<int8_t> wt = random_trits(static_cast<size_t>(dc.o) * taps * dc.c);
  // The three blocks of `c` values at `t`: bit i of block b set where value i is in that block's class.
  auto blocks = [&](const int8_t* t, bool weights, uint32_t* words) {
    for (int i = 0; i < dc.c; ++i) {
      const bool bits[3] = {t[i] == 1, t[i] == -1, weights ? t[i] == 0 : t[i] != 0};
      for (int b = 0; b < 3; ++b) {
        if (bits[b]) words[b * block_words + i / 32] |= 1u << (i % 32);
      }
    }
  };
  std::vector<uint32_t> x(pixels * cw, 0);
  for (size_t px = 0; px < pixels; ++px) blocks(&xt[px * dc.c], false, &x[px * cw]);
  std::vector<uint32_t> wrows(static_cast<size_t>(dc.o) * k_words, 0);
  for (int r = 0; r < dc.o; ++r) {
    for (int t = 0; t < taps; ++t) {
      std::vector<uint32_t> tap(cw, 0);
      blocks(&wt[(static_cast<size_t>(r) * taps + t) * dc.c], true, tap.data());
      // the reduction's order: every tap's doubled blocks, then every tap's third
      std::copy_n(tap.data(), 2 * block_words, &wrows[static_cast<size_t>(r) * k_words + t * 2 * block_words]);
      std::copy_n(tap.data() + 2 * block_words, block_words,
                  &wrows[static_cast<size_t>(r) * k_words + taps * 2 * block_words + t * block_words]);
    }
  }
  const int row_tiles = (dc.o + 7) / 8, k_tiles = (k_words + 3) / 4;
  std::vector<uint32_t> fsb(static_cast<size_t>(row_tiles) * k_tiles * 32, 0);
  for (int r = 0; r < dc.o; ++r) {
    for (int k = 0; k < k_words; ++k) {
      fsb[((static_cast<size_t>(r / 8) * k_tiles + k / 4) * 8 + r % 8) * 4 + k % 4] =
          wrows[static_cast<size_t>(r) * k_words + k];
    }
  }
  const std::vector<int32_t> tap_popc(static_cast<size_t>(taps) * dc.o, tap_real / 2);

  const int conv_h = (dc.h + 2 * dc.pad - dc.kh) / dc.stride + 1, conv_w = (dc.w + 2 * dc.pad - dc.kw) / dc.stride + 1;
  const int out_h = conv_h / dc.pool, out_w = conv_w / dc.pool;
  const size_t pooled = static_cast<size_t>(dc.batch) * out_h * out_w;
  std::vector<int32_t> dots(pooled * dc.o);
  for (int b = 0; b < dc.batch; ++b) {
    for (int ohp = 0; ohp < out_h; ++ohp) {
      for (int owp = 0; owp < out_w; ++owp) {
        for (int o = 0; o < dc.o; ++o) {
          int best = INT32_MIN;
          for (int e = 0; e < dc.pool * dc.pool; ++e) {
            const int oh = ohp * dc.pool + e / dc.pool, ow = owp * dc.pool + e % dc.pool;
            int dot = 0;
            for (int t = 0; t < taps; ++t) {
              const int ih = oh * dc.stride - dc.pad + t / dc.kw, iw = ow * dc.stride - dc.pad + t % dc.kw;
              if (ih < 0 || ih >= dc.h || iw < 0 || iw >= dc.w) continue;
              const int8_t* xv = &xt[((static_cast<size_t>(b) * dc.h + ih) * dc.w + iw) * dc.c];
              const int8_t* wv = &wt[(static_cast<size_t>(o) * taps + t) * dc.c];
              for (int i = 0; i < dc.c; ++i) dot += xv[i] * wv[i];
            }
            best = std::max(best, 4 * dot);
          }
          dots[((static_cast<size_t>(b) * out_h + ohp) * out_w + owp) * dc.o + o] = best;
        }
      }
    }
  }
  std::vector<float> scale(dc.o), bias(dc.o);
  std::vector<int32_t> threshold(static_cast<size_t>(planes) * dc.o);
  std::vector<uint8_t> flip(threshold.size());
  std::uniform_real_distribution<float> uni(-2.f, 2.f);
  const int k_real = taps * tap_real;
  const int spread = 4 * static_cast<int>(std::sqrt(static_cast<double>(taps * dc.c))) + 4;
  std::uniform_int_distribution<int> thr(-spread, spread);
  // thresholds among the values, and a few at and past the range's ends (the kernels clamp to +-(k_real + 1))
  const int32_t extremes[] = {INT32_MIN, INT32_MAX, -k_real - 1, k_real + 1, -k_real, k_real, -4 * taps * dc.c,
                              4 * taps * dc.c};
  for (int o = 0; o < dc.o; ++o) {
    scale[o] = uni(rng);
    bias[o] = uni(rng);
  }
  for (size_t i = 0; i < threshold.size(); ++i) {
    const uint64_t r = rng();
    threshold[i] = r % 10 == 0 ? extremes[(r >> 8) % 8] : thr(rng);
    flip[i] = (r >> 16) & 1;
  }
  const int words = (dc.o + 31) / 32, out_cols = ep == Epilogue::kBits ? planes * words : dc.o;
  std::vector<uint32_t> want(pooled * out_cols, 0);
  for (size_t px = 0; px < pooled; ++px) {
    for (int o = 0; o < dc.o; ++o) {
      const int32_t d = dots[px * dc.o + o];
      if (ep == Epilogue::kInt32) {
        want[px * out_cols + o] = static_cast<uint32_t>(d);
      } else if (ep == Epilogue::kAffine) {
        volatile float prod = static_cast<float>(d) * scale[o];
        const float v = prod + bias[o];
        std::memcpy(&want[px * out_cols + o], &v, 4);
      } else {
        for (int q = 0; q < planes; ++q) {
          const int32_t t = threshold[q * dc.o + o];
          const bool bit = flip[q * dc.o + o] ? d <= t : d >= t;
          want[px * out_cols + q * words + o / 32] |= static_cast<uint32_t>(bit) << (o % 32);
        }
      }
    }
  }

  const ConvCase shape{dc.batch, dc.h, dc.w, 32 * cw, dc.o, dc.kh, dc.kw, dc.stride, dc.stride,
                       dc.pad, dc.pad, dc.pad, dc.pad, dc.pool, dc.pool, false};
  BinaryGemmProblem p = ProblemShape(shape);
  p.c = tap_real;
  p.k_real = k_real;
  p.doubled_k_blocks = doubled_k_blocks;
  p.epilogue = ep;
  p.planes = planes;
  KernelPath ran;
  const long bad = RunProblem(p, {x, fsb, tap_popc, scale, bias, threshold, flip}, want, path, verbose, ran);
  std::printf("%-8s %-5s doubled: ternary B%d %dx%d c%d o%d k%dx%d s%d pad%d pool%d, %d K blocks of %d doubled: "
              "%ld / %zu wrong%s\n",
              PathName(ran), EpilogueName(ep, planes).c_str(), dc.batch, dc.h, dc.w, dc.c, dc.o, dc.kh, dc.kw,
              dc.stride, dc.pad, dc.pool, (k_words + 31) / 32, doubled_k_blocks, bad, want.size(),
              ran != path ? " (requested engine cannot run it)" : "");
  return bad;
}

// Every epilogue of the doubled product (int32, affine, one and two threshold planes) on every engine.
long RunDoubledForms(const DoubledCase& dc, KernelPath path) {
  long failures = 0;
  for (Epilogue ep : {Epilogue::kInt32, Epilogue::kAffine, Epilogue::kBits}) {
    failures += RunDoubledCase(dc, ep, path, true) != 0;
  }
  failures += RunDoubledCase(dc, Epilogue::kBits, path, true, 2) != 0;
  return failures;
}

// Dense: one doubled K block and half a block after it (k = 385: the shortest that takes the form), several blocks
// with a partial last one, M = 1, N across column tiles and past multiples of 32, and enough tiles for the
// persistent CTAs to take several each. Convolutions: 3 x 3 "zero" padded at C = 512 (half a K block a tap's third
// block: runs of 64 bytes) and 1024 over images whose tiles are whole output rows (the TMA boxes) and whose are
// not (cp.async), strided, pooled, 1 x 3 and 1 x 1 kernels, channels past a block, N past a column tile.
std::vector<DoubledCase> DoubledCases() {
  return {DenseDoubled(5, 33, 385),     DenseDoubled(129, 257, 1000), DenseDoubled(1, 300, 4096),
          DenseDoubled(300, 70, 1500),  DenseDoubled(1000, 600, 700), DenseDoubled(64, 520, 2049),
          {2, 8, 16, 512, 40, 3, 3, 1, 1},      {1, 7, 9, 1000, 300, 3, 3, 1, 1},
          {3, 16, 8, 512, 64, 3, 3, 2, 1},      {2, 12, 12, 600, 33, 3, 3, 1, 1, 2},
          {1, 5, 32, 1024, 130, 1, 3, 1, 1},    {2, 4, 4, 2048, 260, 3, 3, 1, 1},
          {4, 6, 6, 513, 16, 1, 1, 1, 0}};
}

// A few of them: a dense product, a convolution by TMA boxes (tiles of whole output rows) and one by copies.
std::vector<DoubledCase> SmallDoubledCases() {
  const std::vector<DoubledCase> all = DoubledCases();
  return {all[0], all[6], all[7]};
}

// ---- the residual epilogue (Epilogue::kResidual): stream = (dot >> shift) + shortcut, and its bits ----

struct ResidualCase {
  ConvCase conv;        // unpooled
  int stride, channels;  // the shortcut's stride and channels (<= o)
  int shift;
  bool bits;            // with the stream's threshold bits
};

// Runs one residual case on one engine against the CPU convolution plus the epilogue, over an int32 stream
// (Epilogue::kResidual) or an int16 one (`narrow`: kResidualInt16), its bits of `planes` threshold planes (two: a
// ternary conv1's input, some thresholds at the int16 range's ends and past them); returns the number of wrong values
// of both outputs (each poisoned first).
long RunResidualCase(const ResidualCase& rc, KernelPath path, bool narrow, int planes = 1) {
  const ConvCase& cc = rc.conv;
  const int taps = cc.kh * cc.kw;
  const ConvOperands operands = RandomOperands(cc);
  const std::vector<uint32_t>&x = operands.x, &wrows = operands.wrows, &fsb = operands.fsb;
  const std::vector<int32_t>& tap_popc = operands.tap_popc;
  const std::vector<uint32_t> dots = ReferenceOutput(cc, Epilogue::kInt32, x, wrows, tap_popc, {}, {}, {}, {});
  const int out_h = (cc.h + cc.pt + cc.pb - cc.kh) / cc.sh + 1, out_w = (cc.w + cc.pl + cc.pr - cc.kw) / cc.sw + 1;
  // the shortcut: (batch, SH, SW, channels) with ceil(SH / stride) = out_h (the longest such SH)
  const int sh = out_h * rc.stride, sw = out_w * rc.stride;
  std::vector<int32_t> shortcut(static_cast<size_t>(cc.batch) * sh * sw * rc.channels);
  std::uniform_int_distribution<int> value(-3 * cc.c * taps, 3 * cc.c * taps);
  for (int32_t& v : shortcut) v = value(rng);
  // wraps where it meets a positive dot product, as the stream's integer type does in XLA
  shortcut[0] = narrow ? INT16_MAX : INT32_MAX;
  std::vector<int32_t> threshold(static_cast<size_t>(planes) * cc.o);
  std::vector<uint8_t> flip(threshold.size());
  std::uniform_int_distribution<int> thr(-cc.c * taps, cc.c * taps);
  constexpr int32_t kEnds[] = {INT32_MIN, -32770, -32769, -32768, -32767, 32766, 32767, 32768, 32769, INT32_MAX};
  for (size_t i = 0; i < threshold.size(); ++i) {
    threshold[i] = planes > 1 && rng() % 8 == 0 ? kEnds[rng() % 10] : thr(rng);
    flip[i] = rng() & 1;
  }
  const size_t pixels = static_cast<size_t>(cc.batch) * out_h * out_w;
  const int out_words = (cc.o + 31) / 32;
  std::vector<uint32_t> want_stream(pixels * cc.o), want_bits(pixels * planes * out_words, 0);
  for (size_t pix = 0; pix < pixels; ++pix) {
    const size_t b = pix / (out_h * out_w), oh = pix / out_w % out_h, ow = pix % out_w;
    const size_t at = ((b * sh + oh * rc.stride) * sw + ow * rc.stride) * rc.channels;
    for (int o = 0; o < cc.o; ++o) {
      const uint32_t added = o < rc.channels ? static_cast<uint32_t>(shortcut[at + o]) : 0u;
      const uint32_t sum = static_cast<uint32_t>(static_cast<int32_t>(dots[pix * cc.o + o]) >> rc.shift) + added;
      const int32_t sv = narrow ? static_cast<int16_t>(sum) : static_cast<int32_t>(sum);
      want_stream[pix * cc.o + o] = static_cast<uint32_t>(sv);
      for (int q = 0; q < planes; ++q) {
        const size_t at_q = static_cast<size_t>(q) * cc.o + o;
        const bool bit = flip[at_q] ? sv <= threshold[at_q] : sv >= threshold[at_q];
        want_bits[(pix * planes + q) * out_words + o / 32] |= static_cast<uint32_t>(bit) << (o % 32);
      }
    }
  }
  uint32_t* d_x = ToDevice(StoredInput(cc, x));
  uint32_t* d_w = ToDevice(fsb);
  int32_t* d_tp = ToDevice(tap_popc);
  const size_t element_bytes = narrow ? 2 : 4;
  std::vector<int16_t> narrow_shortcut(shortcut.begin(), shortcut.end());  // the int16 stream's (values fit)
  void* d_short = narrow ? static_cast<void*>(ToDevice(narrow_shortcut)) : static_cast<void*>(ToDevice(shortcut));
  int32_t* d_thr = ToDevice(threshold);
  uint8_t* d_flip = ToDevice(flip);
  uint32_t *d_stream = nullptr, *d_bits = nullptr;
  CHECK_CUDA(cudaMalloc(&d_stream, want_stream.size() * element_bytes));
  CHECK_CUDA(cudaMalloc(&d_bits, want_bits.size() * 4));
  CHECK_CUDA(cudaMemset(d_stream, 0xA5, want_stream.size() * element_bytes));  // poison: unwritten values show
  CHECK_CUDA(cudaMemset(d_bits, 0xA5, want_bits.size() * 4));
  BinaryGemmProblem p = ProblemShape(cc);
  p.x = d_x;
  p.w = d_w;
  p.tap_popc = d_tp;
  p.epilogue = narrow ? Epilogue::kResidualInt16 : Epilogue::kResidual;
  p.out = d_stream;
  jaxbnn::cuda::ResidualOperands r;
  r.shortcut = d_short;
  r.height = sh;
  r.width = sw;
  r.channels = rc.channels;
  r.stride = rc.stride;
  r.shift = rc.shift;
  if (rc.bits) {
    p.threshold = d_thr;
    p.flip = d_flip;
    r.bits = d_bits;
    r.planes = planes;
  }
  KernelPath ran;
  CHECK_CUDA(jaxbnn::cuda::LaunchBinaryGemm(p, path, nullptr, &ran, r));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint32_t> got_stream(want_stream.size()), got_bits(want_bits.size());
  if (narrow) {
    std::vector<int16_t> got(want_stream.size());
    CHECK_CUDA(cudaMemcpy(got.data(), d_stream, got.size() * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < got.size(); ++i) got_stream[i] = static_cast<uint32_t>(static_cast<int32_t>(got[i]));
  } else {
    CHECK_CUDA(cudaMemcpy(got_stream.data(), d_stream, got_stream.size() * 4, cudaMemcpyDeviceToHost));
  }
  CHECK_CUDA(cudaMemcpy(got_bits.data(), d_bits, got_bits.size() * 4, cudaMemcpyDeviceToHost));
  long bad = 0;
  for (size_t i = 0; i < got_stream.size(); ++i) {
    if (got_stream[i] != want_stream[i] && bad++ < 3) {
      std::printf("    stream word %zu: got %08x want %08x\n", i, got_stream[i], want_stream[i]);
    }
  }
  for (size_t i = 0; i < got_bits.size(); ++i) {
    const uint32_t want = rc.bits ? want_bits[i] : 0xA5A5A5A5u;  // without a threshold: untouched
    if (got_bits[i] != want && bad++ < 3) std::printf("    bits word %zu: got %08x want %08x\n", i, got_bits[i], want);
  }
  std::printf("%-8s residual%s%s%s B%d %dx%d c%d%s o%d k%dx%d s%d,%d pad(%d,%d,%d,%d)%s shortcut %dx%dx%d /%d >>%d: %ld wrong%s\n",
              PathName(ran), narrow ? " i16" : "", rc.bits ? "+bits" : "", planes > 1 ? " 2 planes" : "", cc.batch, cc.h, cc.w, cc.c,
              cc.x_repeats > 1 ? " (read twice)" : "", cc.o, cc.kh, cc.kw, cc.sh, cc.sw,
              cc.pt, cc.pb, cc.pl, cc.pr, cc.pad_one ? " one" : " zero", sh, sw, rc.channels, rc.stride, rc.shift, bad,
              ran != path ? " (requested engine cannot run it)" : "");
  for (void* ptr : {static_cast<void*>(d_x), static_cast<void*>(d_w), static_cast<void*>(d_tp),
                    static_cast<void*>(d_short), static_cast<void*>(d_thr), static_cast<void*>(d_flip),
                    static_cast<void*>(d_stream), static_cast<void*>(d_bits)}) {
    CHECK_CUDA(cudaFree(ptr));
  }
  return bad;
}

// The failing runs of a residual case's forms on one engine: int32 and int16 streams, and with bits also their two
// threshold planes (the int16 stream's wgmma kernels write both; elsewhere the launcher's stream-bits pass).
long RunResidualForms(const ResidualCase& rc, KernelPath path) {
  long failures = 0;
  for (bool narrow : {false, true}) {
    failures += RunResidualCase(rc, path, narrow) != 0;
    if (rc.bits) failures += RunResidualCase(rc, path, narrow, 2) != 0;
  }
  return failures;
}

// The resident kernel's residual instances on TMA boxes over whole 4 x 4 images (ResNet-14's last conv2, with its
// stride-2 shortcut) and over strided taps (16 x 16 -> 8 x 8, "one" padding).
std::vector<ResidualCase> ResidualBoxCases() {
  return {
      {{3, 4, 4, 512, 512, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 2, 256, 0, true},
      {{2, 16, 16, 128, 256, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, true}, 1, 200, 1, true},
  };
}

// Residual blocks' second convolutions on every kernel that takes them: the band kernel (C = 64 pixel pairs,
// C = 128; the int16 stream's shortcut staged in 16-byte chunks, or element by element for 77 channels; 64 x 64
// pixels, whose 4,224 band positions pass its tile rows' table), the
// resident kernel's int16 stream (its shortcut staged: 128-column tiles by cp.async at 7 x 7 and 14 x 14, by TMA
// at 8 x 8; 256-column tiles at batch 72, N = 300 and 260 over two column tiles, a shortcut of 100 channels
// element by element; C = 512 on 128-column tiles, the 256-column ones too large with their stages), the
// dense-tap kernel (C = 16), a stride-2 shortcut with fewer channels (type A), odd N, "one" padding, shifts, no
// bits; the narrow epilogue's general form: the band kernel's rows of 70 values (no 8-byte stores), a 7x7 filter
// on the resident kernel (no class table: border rows sum their own corrections). Reductions past the resident
// kernel's weights (a ternary layer's side-by-side channels, 1024 and 2048) on the persistent kernel's int16
// instances: one row tile (its pair's second empty), seven pairs with a stride-2 shortcut and "one" padding, two
// column tiles (N = 300) with a shortcut of 296 channels, a shortcut of 77 channels element by element without bits,
// a stride-2 convolution (cp.async activations); short reductions by cp.async, which the resident kernel leaves to it
// (a 1x1 and a 3x3 stride-2 convolution at C = 64: 2 and 18 words); and ResidualBoxCases.
std::vector<ResidualCase> ResidualCases() {
  std::vector<ResidualCase> cases = {
      {{3, 17, 24, 64, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 1, 64, 0, true},
      {{2, 15, 14, 64, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 2, 64, 0, true},
      {{2, 9, 11, 128, 100, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true}, 1, 77, 1, true},
      {{2, 16, 16, 128, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 1, 128, 0, true},
      {{1, 64, 64, 128, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 1, 128, 0, true},
      {{2, 7, 7, 512, 300, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 1, 256, 0, true},
      {{3, 14, 14, 256, 256, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 2, 128, 3, false},
      {{72, 8, 8, 256, 300, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 1, 256, 2, true},
      {{72, 8, 8, 256, 260, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 2, 100, 1, true},
      {{72, 8, 8, 512, 300, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true}, 1, 296, 0, true},
      {{4, 16, 16, 16, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 1, 16, 0, true},
      {{2, 8, 8, 16, 35, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 2, 16, 2, true},
      {{5, 1, 1, 200, 33, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, true}, 1, 33, 31, true},
      {{2, 9, 9, 32, 40, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true}, 1, 32, 1, true},
      {{2, 9, 11, 128, 70, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 1, 70, 0, true},
      {{2, 10, 9, 128, 64, 7, 7, 1, 1, 3, 3, 3, 3, 1, 1, false}, 1, 64, 1, true},
      {{2, 7, 7, 1024, 512, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 1, 512, 1, true},
      {{9, 14, 14, 1024, 256, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true}, 2, 128, 2, true},
      {{3, 7, 7, 2048, 300, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 1, 296, 0, true},
      {{2, 7, 7, 1024, 100, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}, 1, 77, 3, false},
      {{2, 14, 14, 1024, 128, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false}, 1, 128, 0, true},
      {{2, 14, 14, 64, 64, 1, 1, 2, 2, 0, 0, 0, 0, 1, 1, false}, 1, 64, 0, true},
      {{2, 14, 14, 64, 128, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false}, 1, 128, 1, true},
  };
  const std::vector<ResidualCase> boxes = ResidualBoxCases();
  cases.insert(cases.end(), boxes.begin(), boxes.end());
  return cases;
}

// Inputs whose taps read each pixel's words twice (a side-by-side ternary product's repeated activation blocks,
// BinaryGemmProblem::x_cw = cw / 2) on every kernel form that takes them: the band kernel with one stored plane
// (C = 256 read as 4 + 4 words: a TNN layer of 64 channels) and two (C = 512), "one" and "zero" padding; the
// resident kernel's tap rows of the stored 32 bytes (8 x 8 images, N = 256) and its chunk slabs (16 x 16, N =
// 200); stride 2 and pools by cp.async; stored pixels of 2 words (8-byte copies) and 1 word (the classic kernels'
// word copies); a 1x1 convolution and a 1 x 1 image (not the plain-matrix TMA layout); C = 2048 on 7 x 7.
std::vector<ConvCase> RepeatedInputCases() {
  return {
      {3, 14, 14, 256, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, 2},
      {2, 15, 13, 256, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true, 2},
      {2, 9, 11, 512, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, 2},
      {4, 8, 8, 512, 256, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, 2},
      {2, 16, 16, 256, 200, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true, 2},
      {3, 14, 14, 256, 128, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false, 2},
      {2, 12, 12, 512, 96, 3, 3, 1, 1, 1, 1, 1, 1, 2, 2, false, 2},
      {2, 10, 9, 128, 70, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, 2},
      {2, 9, 9, 64, 40, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true, 2},
      {2, 8, 8, 512, 64, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, false, 2},
      {33, 1, 1, 1024, 100, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, false, 2},
      {2, 7, 7, 2048, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, 2},
  };
}

// Residual blocks' second convolutions over inputs read twice: the int16 stream's resident kernel (C = 256 and 512:
// a TNN block's conv2 of 64 and 128 channels), a stride-2 shortcut with "one" padding, 7 x 7 at C = 1024, a stored
// pixel of 2 words, a stride-2 convolution (cp.async).
std::vector<ResidualCase> RepeatedInputResidualCases() {
  return {
      {{3, 17, 24, 256, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, 2}, 1, 64, 2, true},
      {{2, 16, 16, 512, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, 2}, 1, 128, 2, true},
      {{2, 14, 14, 256, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true, 2}, 2, 64, 1, true},
      {{3, 7, 7, 1024, 256, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, 2}, 1, 256, 2, true},
      {{2, 9, 11, 128, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, 2}, 1, 64, 0, true},
      {{2, 14, 14, 512, 128, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false, 2}, 1, 128, 1, true},
  };
}

// A launch timed with CUDA events: the median of 9 single launches after 2 warm-ups, and 30 launches queued back to
// back (as XLA runs them): their mean device time and the launcher's host time per call (what a caller such as an
// XLA handler pays before the kernel is queued).
struct LaunchTimes {
  double alone_ms, queued_ms, host_us;
};
template <class Launch>
LaunchTimes TimeLaunches(Launch launch) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 11; ++i) {
    CHECK_CUDA(cudaEventRecord(e0));
    launch();
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float t;
    CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  constexpr int kQueued = 30;
  CHECK_CUDA(cudaEventRecord(e0));
  const auto host0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kQueued; ++i) launch();
  const double host_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - host0).count() / kQueued;
  CHECK_CUDA(cudaEventRecord(e1));
  CHECK_CUDA(cudaEventSynchronize(e1));
  float queued_ms;
  CHECK_CUDA(cudaEventElapsedTime(&queued_ms, e0, e1));
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  return {ms[ms.size() / 2], queued_ms / kQueued, host_us};
}

// The outputs a timed case writes: the threshold bits, the int32 or int16 dot products, or a residual block's
// second convolution (stream = dot + a stride-1 shortcut of O channels, and the stream's bits; or a downsampling
// block's: a stride-2 shortcut of O / 2 channels from an image of twice the height and width).
// kTwoPlanes: threshold bits of two planes (a ternary output)
enum class TimedOutput {
  kBits, kTwoPlanes, kInt32, kInt16, kResidual, kResidualInt16, kResidualInt16Stream, kResidualInt16Stride2
};

// Times the op of a case (packed in; `output` out) on one engine (TimeLaunches). Operands
// are random bits (any bits make valid FSB weights). "GB/s": the bytes of integers written and read (the stream
// and its shortcut) over the median time.
void TimeCase(const char* name, const ConvCase& cc, KernelPath path, TimedOutput output = TimedOutput::kBits) {
  const int cw = (cc.c + 31) / 32, taps = cc.kh * cc.kw, k_words = taps * cw;
  const int row_tiles = (cc.o + 7) / 8, k_tiles = (k_words + 3) / 4;
  const std::vector<uint32_t> x = RandomPacked(static_cast<size_t>(cc.batch) * cc.h * cc.w, cw, cc.c);
  const std::vector<uint32_t> w = RandomPacked(static_cast<size_t>(row_tiles) * k_tiles * 8, 4, 128);
  const int planes = output == TimedOutput::kTwoPlanes ? 2 : 1;
  const bool bits_out = output == TimedOutput::kBits || output == TimedOutput::kTwoPlanes;
  const std::vector<int32_t> tap_popc(static_cast<size_t>(taps) * cc.o, cc.c / 2), thr(planes * cc.o, 0);
  const std::vector<uint8_t> flip(planes * cc.o, 0);
  BinaryGemmProblem p = ProblemShape(cc);
  p.planes = planes;
  p.x = ToDevice(x);
  p.w = ToDevice(w);
  p.tap_popc = ToDevice(tap_popc);
  p.epilogue = bits_out                       ? Epilogue::kBits
              : output == TimedOutput::kInt32 ? Epilogue::kInt32
              : output == TimedOutput::kInt16 ? Epilogue::kInt16
              : output == TimedOutput::kResidual ? Epilogue::kResidual
                                                 : Epilogue::kResidualInt16;  // with its bits, or the stream alone
  p.threshold = ToDevice(thr);
  p.flip = ToDevice(flip);
  const size_t bits_bytes = static_cast<size_t>(p.pooled_rows) * planes * ((cc.o + 31) / 32) * 4;
  const size_t values_bytes = static_cast<size_t>(p.pooled_rows) * cc.o * 4;
  uint32_t *out = nullptr, *bits = nullptr;
  void* shortcut = nullptr;
  CHECK_CUDA(cudaMalloc(&out, bits_out ? bits_bytes : values_bytes));
  p.out = out;
  jaxbnn::cuda::ResidualOperands r;
  if (jaxbnn::cuda::IsResidual(p.epilogue)) {
    CHECK_CUDA(cudaMalloc(&bits, bits_bytes));
    const int stride = output == TimedOutput::kResidualInt16Stride2 ? 2 : 1;
    const size_t shortcut_bytes = stride * values_bytes;  // a stride-2 one holds twice the output's values
    CHECK_CUDA(cudaMalloc(&shortcut, shortcut_bytes));
    CHECK_CUDA(cudaMemset(shortcut, 0, shortcut_bytes));
    r.shortcut = shortcut;
    r.height = stride * p.out_h;
    r.width = stride * p.out_w;
    r.channels = cc.o / stride;
    r.stride = stride;
    r.bits = output == TimedOutput::kResidualInt16Stream ? nullptr : bits;
  }
  const double int32_bytes = bits_out                                 ? 0.0
                             : output == TimedOutput::kInt16          ? 0.5 * values_bytes
                             : output == TimedOutput::kInt32          ? 1.0 * values_bytes
                             : output == TimedOutput::kResidualInt16 ||
                                       output == TimedOutput::kResidualInt16Stream
                                 ? 1.0 * values_bytes
                             : output == TimedOutput::kResidualInt16Stride2
                                 ? 0.75 * values_bytes
                                                                      : 2.0 * values_bytes;
  KernelPath ran;
  const LaunchTimes times = TimeLaunches([&] { CHECK_CUDA(jaxbnn::cuda::LaunchBinaryGemm(p, path, nullptr, &ran, r)); });
  const double t = times.alone_ms, tq = times.queued_ms, host_us = times.host_us;
  const double ops = 2.0 * p.pooled_rows * cc.o * taps * cc.c;
  std::printf("time %-22s %-8s %9.4f ms %9.1f TOPS   queued %9.4f ms %9.1f TOPS   host %6.2f us a launch", name,
              PathName(ran), t, ops / (t * 1e-3) / 1e12, tq, ops / (tq * 1e-3) / 1e12, host_us);
  if (int32_bytes > 0) std::printf("   %7.0f GB/s", int32_bytes / (t * 1e-3) / 1e9);
  std::printf("\n");
  for (const void* ptr : {static_cast<const void*>(p.x), static_cast<const void*>(p.w), static_cast<const void*>(p.tap_popc),
                          static_cast<const void*>(p.threshold), static_cast<const void*>(p.flip), static_cast<const void*>(out),
                          static_cast<const void*>(bits), static_cast<const void*>(shortcut)}) {
    CHECK_CUDA(cudaFree(const_cast<void*>(ptr)));
  }
}

// --time: the BMM sweep and the TCBNN BConv sweep (batch 16, 64x64, 3x3, stride 1, "zero" padding);
// --time-wgmma / --time-mma: one engine only. An optional second argument times only the cases of that
// name (e.g. "bconv C=O=512", for ncu).
void TimeAll(const std::vector<KernelPath>& paths, const std::string& only) {
  auto time = [&](const std::string& name, const ConvCase& cc, TimedOutput output = TimedOutput::kBits) {
    if (!only.empty() && name != only) return;
    for (KernelPath path : paths) TimeCase(name.c_str(), cc, path, output);
  };
  for (int s : {1024, 2048, 4096, 8192, 16384}) time("bmm " + std::to_string(s) + "^3", Bmm(s, s, s));
  time("bmm long K", Bmm(128 * 33, 1024, 262144));  // a 128 x 256 mma.sync tile per H100/H200 SM, 256 K blocks
  // the TBN product of 4096^3 as the ops run it: the two planes side by side (K = 8192), one and two threshold
  // planes (a binary and a ternary output)
  time("bmm tbn 4096^3", Bmm(4096, 4096, 8192));
  time("bmm tbn 4096^3 ternary", Bmm(4096, 4096, 8192), TimedOutput::kTwoPlanes);
  for (int c : {64, 128, 256, 512, 1024, 2048}) {
    time("bconv C=O=" + std::to_string(c), ConvCase{16, 64, 64, c, c, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  }
  for (int c : {128, 512, 1024}) {  // the same with "one" padding: no border-row corrections
    time("bconv one C=O=" + std::to_string(c), ConvCase{16, 64, 64, c, c, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true});
  }
  // VGG-16 / ResNet-18 layers: rows of 56 or 28 pixels and stride 2, whose tiles no TMA box takes (the wgmma
  // kernel copies their activations with cp.async; taps of 8, 16, 32 and 64 bytes), and C = 64 at stride 1
  // (the band kernel's pixel pairs)
  time("conv vgg.3_2 b16", ConvCase{16, 56, 56, 256, 256, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  time("conv vgg.4_2 b64", ConvCase{64, 28, 28, 512, 512, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  time("conv r18.l1 b256", ConvCase{256, 56, 56, 64, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  time("conv vgg.1_2 b32", ConvCase{32, 224, 224, 64, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  time("conv r18.l2.s2 b256", ConvCase{256, 56, 56, 64, 128, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false});
  time("conv r18.l3.s2 b256", ConvCase{256, 28, 28, 128, 256, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false});
  time("conv r18.l4.s2 b256", ConvCase{256, 14, 14, 256, 512, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false});
  // ResNet-18's 1x1 stride-2 shortcuts: one K block of 64, 128, 256 bits
  time("conv r18.l2.down b256", ConvCase{256, 56, 56, 64, 128, 1, 1, 2, 2, 0, 0, 0, 0, 1, 1, false});
  time("conv r18.l3.down b256", ConvCase{256, 28, 28, 128, 256, 1, 1, 2, 2, 0, 0, 0, 0, 1, 1, false});
  time("conv r18.l4.down b256", ConvCase{256, 14, 14, 256, 512, 1, 1, 2, 2, 0, 0, 0, 0, 1, 1, false});
  // the first layers, binarized input (C = 3: dense taps)
  time("conv r18.conv1 b256", ConvCase{256, 224, 224, 3, 64, 7, 7, 2, 2, 3, 3, 3, 3, 1, 1, false});
  time("conv vgg.1_1 b32", ConvCase{32, 224, 224, 3, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  time("conv r18.conv1 one b256", ConvCase{256, 224, 224, 3, 64, 7, 7, 2, 2, 3, 3, 3, 3, 1, 1, true});
  time("conv vgg.1_1 one b32", ConvCase{32, 224, 224, 3, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true});
  // the zoo's AlexNet (224 x 224 input): conv2, 5x5 over 28 x 28 (no border-class table: a quarter of its rows
  // are border rows), and conv1 with binarized input, 11x11 stride 4 at C = 3 (dense taps, no prefix sums)
  time("conv alex.2 b64", ConvCase{64, 28, 28, 128, 256, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, false});
  time("conv alex.2 one b64", ConvCase{64, 28, 28, 128, 256, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, true});
  time("conv alex.1 b64", ConvCase{64, 224, 224, 3, 128, 11, 11, 4, 4, 3, 4, 3, 4, 1, 1, false});
  time("conv alex.1 one b64", ConvCase{64, 224, 224, 3, 128, 11, 11, 4, 4, 3, 4, 3, 4, 1, 1, true});
  // the zoo's MNIST conv net: its 64C3 over 28 x 28 x 32 (dense taps of a whole word a tap), unpooled as the
  // network runs it (ops.bconv2d pools a threshold convolution's bits after it)
  time("conv mnist.2 b8", ConvCase{8, 28, 28, 32, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  time("conv mnist.2 b1024", ConvCase{1024, 28, 28, 32, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  // batch 8, grids of 256-column tiles that would leave most SMs idle: the zoo's CIFAR-10 VGG-small (16 x 16
  // at C = O = 256: 16 row tiles; 8 x 8 at 512: 4 x 2 tiles; its first fully connected layer, K = 8192, whose
  // 256-column tile's weights do not fit the resident kernel) and VGG-16's first fully connected layers (one
  // row tile); ResNet-18's layers 3 and 4 and VGG-16's block 5 (14 x 14 and 7 x 7: no TMA box)
  time("conv cifar-vgg.2_2 b8", ConvCase{8, 16, 16, 256, 256, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  time("conv cifar-vgg.3_2 b8", ConvCase{8, 8, 8, 512, 512, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  time("bmm cifar-vgg.fc1 b8", Bmm(8, 1024, 8192));
  time("bmm vgg.fc2 b8", Bmm(8, 4096, 4096));
  time("conv r18.l3 b8", ConvCase{8, 14, 14, 256, 256, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  time("conv r18.l4 b8", ConvCase{8, 7, 7, 512, 512, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  time("conv r18.l4.s2 b8", ConvCase{8, 14, 14, 256, 512, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false});
  time("conv vgg.5 b8", ConvCase{8, 14, 14, 512, 512, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  // the zoo's CIFAR-10 ResNet-14 blocks at batch 1024 (16 x 16 x 128, 8 x 8 x 256, 4 x 4 x 512): the first
  // convolution's bits, the second's int32 and int16 dot products, and the second with the residual epilogue
  const ConvCase resnet14[] = {{1024, 16, 16, 128, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false},
                               {1024, 8, 8, 256, 256, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false},
                               {1024, 4, 4, 512, 512, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}};
  // and ResNet-18's blocks at batch 512: 56 x 56 x 64 and 28 x 28 x 128 on the band kernel (pixel pairs at
  // C = 64), 14 x 14 x 256 and 7 x 7 x 512, whose conv2 the resident kernel runs by cp.async
  const ConvCase resnet18[] = {{512, 56, 56, 64, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false},
                               {512, 28, 28, 128, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false},
                               {512, 14, 14, 256, 256, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false},
                               {512, 7, 7, 512, 512, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false}};
  for (int i = 0; i < 4; ++i) {
    const std::string name = "conv r18.l" + std::to_string(i + 1) + " b512";
    time(name, resnet18[i]);
    time(name + " i16", resnet18[i], TimedOutput::kInt16);
    time(name + " residual i16", resnet18[i], TimedOutput::kResidualInt16);
    time(name + " residual i16 stream", resnet18[i], TimedOutput::kResidualInt16Stream);
    if (i > 0) time(name + " residual i16 s2", resnet18[i], TimedOutput::kResidualInt16Stride2);
  }
  // and its downsampling blocks' first convolutions (stride 2: 16 x 16 -> 8 x 8, 8 x 8 -> 4 x 4)
  time("conv r14.l2.s2 b1024", ConvCase{1024, 16, 16, 128, 256, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false});
  time("conv r14.l3.s2 b1024", ConvCase{1024, 8, 8, 256, 512, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false});
  for (int i = 0; i < 3; ++i) {
    const std::string name = "conv r14.l" + std::to_string(i + 1) + " b1024";
    time(name, resnet14[i]);
    time(name + " i32", resnet14[i], TimedOutput::kInt32);
    time(name + " i16", resnet14[i], TimedOutput::kInt16);
    time(name + " residual", resnet14[i], TimedOutput::kResidual);
    time(name + " residual i16", resnet14[i], TimedOutput::kResidualInt16);
    time(name + " residual i16 stream", resnet14[i], TimedOutput::kResidualInt16Stream);
    if (i > 0) time(name + " residual i16 s2", resnet14[i], TimedOutput::kResidualInt16Stride2);
  }
}

}  // namespace

// BMMs and convolutions of every kernel size, stride, padding, pool and the wgmma TMA layouts.
std::vector<ConvCase> GemmAndConvCases() {
  std::vector<ConvCase> cases;
  // bmm: M, N, K including non-multiples of every tile, M = 1, K = 1.
  const int bmm_shapes[][3] = {{1, 3, 100},      {5, 33, 31},    {1, 1, 1},      {129, 257, 1000}, {64, 64, 128},
                               {300, 520, 2144}, {130, 40, 4096}, {257, 300, 3000}, {16, 8, 256},
                               {9000, 1100, 384}};  // more tile pairs than clusters: persistent CTAs
  for (const auto& s : bmm_shapes) cases.push_back(Bmm(s[0], s[1], s[2]));
  // bconv: kernel sizes 1, 3, 5, 7, 11; stride 1 and 2; both paddings; channels aligned and not; pools.
  cases.push_back({2, 9, 7, 128, 40, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({2, 9, 7, 128, 40, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true});
  cases.push_back({3, 8, 8, 64, 70, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({1, 11, 10, 100, 33, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, false});
  cases.push_back({2, 13, 12, 256, 64, 7, 7, 2, 2, 3, 3, 3, 3, 1, 1, false});
  cases.push_back({1, 20, 19, 3, 16, 11, 11, 4, 4, 2, 2, 2, 2, 1, 1, false});
  cases.push_back({2, 6, 6, 512, 130, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, false});
  cases.push_back({2, 8, 8, 128, 96, 3, 3, 1, 1, 1, 1, 1, 1, 2, 2, false});
  cases.push_back({2, 9, 9, 128, 64, 3, 3, 1, 1, 1, 1, 1, 1, 3, 3, true});
  cases.push_back({2, 7, 9, 32, 50, 2, 3, 1, 2, 0, 1, 2, 0, 2, 1, false});
  cases.push_back({8, 40, 40, 128, 520, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});  // more tile pairs than clusters
  // stride 1 with 128-row tiles of whole output rows or 128-pixel runs: the wgmma engine's TMA tap boxes
  cases.push_back({2, 8, 16, 128, 70, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({2, 8, 16, 128, 70, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true});
  cases.push_back({2, 4, 32, 256, 33, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, false});
  cases.push_back({1, 4, 32, 384, 20, 3, 5, 1, 1, 0, 2, 1, 3, 1, 1, false});  // asymmetric padding, 4 x 32 out
  cases.push_back({1, 4, 32, 256, 20, 3, 4, 1, 1, 1, 0, 2, 1, 1, 1, false});  // 3 x 4 filter, asymmetric padding
  cases.push_back({1, 3, 256, 128, 40, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({16, 32, 32, 128, 300, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});  // more tile pairs than clusters
  // the same with W-byte tap rows: C = 512 (64-byte rows), 1024 (128), 2048 (two boxes per tap), 256 in
  // 128-pixel runs (32-byte rows; the cases with C = 256 above take them too), a 5x5 filter
  cases.push_back({2, 8, 16, 512, 40, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({2, 8, 16, 512, 40, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true});
  cases.push_back({1, 4, 32, 1024, 24, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({1, 4, 32, 2048, 20, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({1, 2, 128, 256, 36, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({1, 4, 32, 512, 33, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, false});
  // a pool over more than 128 columns: the wide mma.sync tiles' staged epilogue
  cases.push_back({2, 8, 8, 64, 200, 3, 3, 1, 1, 1, 1, 1, 1, 2, 2, false});
  // an even number of words per tap that is not a multiple of 4 (C = 64: 2, C = 192: 6): the wgmma
  // engine's 8-byte cp.async copies
  cases.push_back({2, 9, 11, 64, 72, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({1, 7, 9, 192, 40, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true});
  return cases;
}

// The image-band kernel: channel planes, paddings, filter sizes, items across images, pixel pairs.
std::vector<ConvCase> BandCases() {
  std::vector<ConvCase> cases;
  // The image-band kernel (stride 1, N <= 128, C = 128 or a multiple of 256): rows that are not whole
  // tiles, both paddings, one and two channel planes, filters with and without the border-class table,
  // asymmetric padding, a 256-position padded row, more images than CTAs (items through both band
  // buffers), bands cut by shared memory, and the TCBNN sweep's geometry; N > 128 (the resident kernel).
  cases.push_back({3, 17, 23, 128, 100, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({3, 17, 23, 128, 100, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true});
  cases.push_back({2, 30, 50, 256, 120, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({1, 9, 200, 128, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({2, 30, 50, 256, 256, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({2, 12, 15, 128, 40, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, false});
  cases.push_back({1, 7, 8, 512, 24, 3, 2, 1, 1, 1, 0, 0, 1, 1, 1, false});
  cases.push_back({1, 5, 254, 128, 20, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({200, 6, 6, 128, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({140, 40, 40, 512, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true});
  cases.push_back({16, 64, 64, 128, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  // 16 k256 steps (C = 256, 4x4 taps): the most the band kernel's unrolled k loop takes; C = 512 3x3
  // above (18 steps) takes the loop of runtime length
  cases.push_back({2, 9, 13, 256, 72, 4, 4, 1, 1, 2, 1, 2, 1, 1, 1, false});
  // band items that run from one image into the next (tiles per image not a multiple of the per-CTA share):
  // no border-class table (5x5), two channel planes with "one" padding, asymmetric padding with the table
  cases.push_back({40, 20, 20, 128, 72, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, false});
  cases.push_back({30, 17, 23, 256, 100, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true});
  cases.push_back({60, 15, 21, 128, 128, 3, 3, 1, 1, 1, 0, 0, 1, 1, 1, false});
  // The band kernel's pixel pairs (C = 64, even input widths; the C = 64 case above has an odd one): both
  // paddings, 3x3 / 5x5 / 7x7 (unrolled steps) and 11x11 (the runtime-length loop), a 256-position padded
  // row, more images than CTAs, items crossing images (with asymmetric padding, no left column), bands cut by
  // shared memory.
  cases.push_back({3, 17, 24, 64, 100, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({3, 17, 24, 64, 100, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true});
  cases.push_back({2, 12, 16, 64, 40, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, false});
  cases.push_back({2, 10, 14, 64, 64, 7, 7, 1, 1, 3, 3, 3, 3, 1, 1, false});
  cases.push_back({1, 9, 12, 64, 30, 11, 11, 1, 1, 5, 5, 5, 5, 1, 1, true});
  cases.push_back({1, 5, 254, 64, 20, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({200, 6, 6, 64, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({40, 20, 28, 64, 72, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({60, 15, 22, 64, 128, 3, 3, 1, 1, 1, 0, 0, 1, 1, 1, false});
  cases.push_back({133, 60, 120, 64, 24, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  return cases;
}

// One short K block by cp.async, and the dense-tap kernel (C < 32).
std::vector<ConvCase> ShortKAndDenseTapCases() {
  std::vector<ConvCase> cases;
  // One short K block by cp.async (the wgmma kernel's 1- and 3-step instances, stages zeroed past K once):
  // 1x1 stride-2 shortcuts of 2, 4 and 8 words (the last with "zero" padding), a 2x2 filter, a 3x3 stride-2
  // C = 64 convolution (18 words), and more tile pairs than clusters (stages refilled).
  cases.push_back({3, 13, 11, 64, 70, 1, 1, 2, 2, 0, 0, 0, 0, 1, 1, false});
  cases.push_back({2, 14, 14, 128, 136, 1, 1, 2, 2, 0, 0, 0, 0, 1, 1, false});
  cases.push_back({2, 9, 9, 256, 40, 1, 1, 2, 2, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({2, 10, 12, 64, 33, 2, 2, 2, 2, 0, 1, 0, 1, 1, 1, false});
  cases.push_back({5, 15, 17, 64, 100, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({64, 40, 40, 64, 64, 1, 1, 2, 2, 0, 0, 0, 0, 1, 1, false});
  // Dense taps (one channel word, C < 32, at most 1024 real bits): the first layers of ResNet-18 (7x7 stride
  // 2, no border-class table) and VGG-16 (3x3, the table) in both paddings, more tiles than the CTAs one
  // wave holds; C = 5 pooled, C = 31 (a word of 31 real bits), C = 17 with asymmetric padding and stride,
  // N = 3 and 70 (a partial second column tile), a single output pixel, C = 7 11x11 (847 bits); 11x11 at
  // C = 9 (1089 bits) takes the word layout.
  cases.push_back({2, 20, 19, 3, 64, 7, 7, 2, 2, 3, 3, 3, 3, 1, 1, false});
  cases.push_back({2, 20, 19, 3, 64, 7, 7, 2, 2, 3, 3, 3, 3, 1, 1, true});
  cases.push_back({3, 17, 15, 3, 70, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({3, 17, 15, 3, 70, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true});
  cases.push_back({24, 64, 64, 3, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  cases.push_back({2, 9, 11, 5, 33, 5, 5, 1, 1, 2, 2, 2, 2, 2, 2, false});
  cases.push_back({1, 13, 12, 31, 40, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, false});
  cases.push_back({1, 9, 9, 17, 3, 3, 3, 2, 1, 0, 1, 1, 0, 1, 1, false});
  cases.push_back({1, 3, 3, 3, 5, 3, 3, 1, 1, 0, 0, 0, 0, 1, 1, false});
  cases.push_back({1, 20, 19, 7, 16, 11, 11, 4, 4, 2, 2, 2, 2, 1, 1, true});
  cases.push_back({1, 20, 19, 9, 16, 11, 11, 4, 4, 2, 2, 2, 2, 1, 1, false});
  // the dense kernel's border rows from prefix sums (no table): N = 70 (columns past N in the second tile)
  cases.push_back({3, 21, 18, 3, 70, 7, 7, 2, 2, 3, 3, 3, 3, 1, 1, false});
  // more tiles than the dense kernel's CTAs (three an SM): each CTA keeps its column tile over 2-3 row tiles,
  // without the table (N = 70: two column tiles), "one" padding, and pooled
  cases.push_back({64, 64, 64, 3, 70, 7, 7, 2, 2, 3, 3, 3, 3, 1, 1, false});
  cases.push_back({64, 64, 64, 3, 70, 7, 7, 2, 2, 3, 3, 3, 3, 1, 1, true});
  cases.push_back({48, 40, 40, 5, 33, 5, 5, 1, 1, 2, 2, 2, 2, 2, 2, false});
  // a filter row of exactly 32 bits (4x4 at C = 8, asymmetric padding) and of one bit a tap (C = 1)
  cases.push_back({2, 13, 11, 8, 40, 4, 4, 1, 1, 2, 1, 2, 1, 1, 1, false});
  cases.push_back({3, 9, 10, 1, 20, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false});
  return cases;
}

// Large "zero" paddings and filters (class and edge tables), and the resident kernel's small grids.
std::vector<ConvCase> BorderTableCases() {
  std::vector<ConvCase> cases;
  // Larger "zero" paddings and filters: 5x5 at stride 2 with asymmetric padding over two column tiles, pooled
  // 5x5 and AlexNet's conv2 in small (5x5, C = 128, N = 256) take the class table's compact classes; 3x3 with
  // padding 3 (fields wholly outside the frame) and AlexNet's binarized conv1 in small (11x11 stride 4, C = 3:
  // the dense kernel) the edge table; 15x15 with padding 7 (28 edge rows) sums every out-of-frame tap
  cases.push_back({2, 13, 12, 128, 300, 5, 5, 2, 2, 2, 1, 1, 2, 1, 1, false});
  cases.push_back({2, 6, 7, 128, 40, 3, 3, 1, 1, 3, 3, 3, 3, 1, 1, false});
  cases.push_back({2, 12, 12, 64, 40, 5, 5, 1, 1, 2, 2, 2, 2, 2, 2, false});
  cases.push_back({1, 16, 17, 32, 20, 15, 15, 1, 1, 7, 7, 7, 7, 1, 1, false});
  cases.push_back({2, 40, 37, 3, 70, 11, 11, 4, 4, 3, 4, 3, 4, 1, 1, false});
  cases.push_back({3, 14, 14, 128, 256, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, false});
  // The class table's compact classes ((vertical, horizontal) excess pairs where the four-way product passes 25)
  // and its fill class by class: 3x3 and 4x4 with padding 2 (25 compact classes), 5x5 with padding 1 (16 classes)
  cases.push_back({2, 9, 11, 128, 40, 3, 3, 1, 1, 2, 2, 2, 2, 1, 1, false});
  cases.push_back({2, 10, 12, 128, 300, 4, 4, 1, 1, 2, 2, 2, 2, 1, 1, false});
  cases.push_back({2, 10, 9, 64, 72, 5, 5, 1, 1, 1, 1, 1, 1, 1, 1, false});
  // The dense kernel's border rows beyond 7x7 (no prefix sums) spread over its threads: 9x9 over 6 x 7 (taller
  // than the frame: no edge table, every out-of-frame tap summed) and 8x8 at stride 2 with asymmetric padding
  // (the edge table with its corner blocks); AlexNet's conv1 in small above takes the strips less the block
  cases.push_back({2, 6, 7, 3, 40, 9, 9, 1, 1, 4, 4, 4, 4, 1, 1, false});
  cases.push_back({3, 20, 22, 3, 70, 8, 8, 2, 2, 1, 2, 1, 2, 1, 1, false});
  // A fully connected layer at batch 8 whose 256-column tiles' weights would not fit the resident kernel: its
  // 128-column tiles (K = 8192, 128 KB of weights), the last of 104 columns
  cases.push_back(Bmm(8, 1000, 8192));
  return cases;
}

// The dense-tap kernel at C = 32: a whole word a tap, the gather the word layout itself.
std::vector<ConvCase> WholeWordDenseTapCases() {
  std::vector<ConvCase> cases;
  // MNIST conv's pooled 64C3 at 28 x 28 in small and with more row tiles than the CTAs (N = 70: two column
  // tiles), 5x5 at stride 2 in "one" padding (800 bits), a 3x1 filter (one word a filter row); 6x6 (1152 bits)
  // takes the word layout
  cases.push_back({3, 28, 28, 32, 64, 3, 3, 1, 1, 1, 1, 1, 1, 2, 2, false});
  cases.push_back({160, 28, 28, 32, 70, 3, 3, 1, 1, 1, 1, 1, 1, 2, 2, false});
  cases.push_back({2, 15, 13, 32, 40, 5, 5, 2, 2, 2, 2, 2, 2, 1, 1, true});
  cases.push_back({2, 9, 10, 32, 24, 3, 1, 1, 1, 1, 1, 0, 0, 1, 1, false});
  cases.push_back({2, 11, 10, 32, 24, 6, 6, 1, 1, 2, 3, 3, 2, 1, 1, false});
  // 3 x 2 pool windows (42 pooled pixels a 128-row tile: its last two rows hold none) at C = 32 and C = 5, and
  // an unpooled C = 32 layer at stride 2 with asymmetric padding (border rows' bounds from the prefix sums)
  cases.push_back({2, 12, 12, 32, 33, 3, 3, 1, 1, 1, 1, 1, 1, 3, 2, false});
  cases.push_back({2, 12, 12, 5, 20, 3, 3, 1, 1, 1, 1, 1, 1, 3, 2, false});
  cases.push_back({2, 13, 11, 32, 40, 3, 3, 2, 2, 1, 0, 0, 1, 1, 1, false});
  return cases;
}

// The wgmma kernels' TMA boxes over strided taps (every stride-th pixel: the map's element strides) and over
// whole images (tiles of several small images). Strided: 16 x 16 -> 8 x 8 at C = 128 (16-byte chunk boxes) in
// both paddings, 8 x 8 -> 4 x 4 at C = 256 (whole images, the last box past the batch), an odd height with 64-byte
// tap rows, asymmetric ("SAME" stride-2) padding with 128-byte rows, 5x5, stride 3, strides (2, 1), a 1x1 stride-2
// convolution of more than one short K block, an input read twice, and C = 2048, whose weights leave it to the
// persistent kernel (128-row tiles: two 8 x 8 or eight 4 x 4 images). Whole images at stride 1: 4 x 4 (batch 5),
// 2 x 2 in "one" padding, 1 x 1 images under a 3x3 filter (64 a box, batch 70), and C = 2048 on the persistent
// kernel.
std::vector<ConvCase> StridedAndWholeImageBoxCases() {
  return {
      {2, 16, 16, 128, 256, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false},
      {2, 16, 16, 128, 256, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, true},
      {3, 8, 8, 256, 512, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false},
      {2, 15, 16, 512, 70, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, true},
      {2, 32, 32, 1024, 40, 3, 3, 2, 2, 0, 1, 0, 1, 1, 1, false},
      {1, 31, 32, 256, 33, 5, 5, 2, 2, 2, 2, 2, 2, 1, 1, false},
      {2, 24, 24, 128, 64, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, false},
      {2, 16, 8, 128, 64, 3, 3, 2, 1, 1, 1, 1, 1, 1, 1, false},
      {2, 16, 16, 1024, 64, 1, 1, 2, 2, 0, 0, 0, 0, 1, 1, false},
      {3, 16, 16, 256, 128, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false, 2},
      {2, 16, 16, 2048, 300, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false},
      {3, 8, 8, 2048, 300, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, true},
      {5, 4, 4, 512, 130, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false},
      {3, 2, 2, 256, 40, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true},
      {70, 1, 1, 256, 40, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false},
      {3, 4, 4, 2048, 300, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false},
  };
}

// ---- the first-layer kernel (LaunchImageConv): int8 levels x int8 weights, pool, stream or threshold planes ----

struct ImageCase {
  int batch, h, w, c, n, kh, kw, sh, sw, pt, pb, pl, pr, ph, pw, planes, shift;
  int stream;     // the stream's width beside the planes (or alone): 32, 16 (int16) or 0 (none)
  bool extremes;  // levels and weights only -128 / 127: the largest products
};

// Runs one case into poisoned outputs; returns the number of wrong values. pixels: the kernel reads the levels as
// the uint8 pixels they come from (level + 128, ImageConvProblem::pixels), for the same results. misaligned: the
// levels start 4 bytes past a 16-byte boundary (the windowed kernel's 4-byte copies) and end where their
// allocation does.
long RunImageCase(const ImageCase& ic, bool pixels, bool misaligned) {
  const int conv_h = (ic.h + ic.pt + ic.pb - ic.kh) / ic.sh + 1, conv_w = (ic.w + ic.pl + ic.pr - ic.kw) / ic.sw + 1;
  const int out_h = conv_h / ic.ph, out_w = conv_w / ic.pw, words = (ic.n + 31) / 32, k = ic.kh * ic.kw * ic.c;
  std::vector<int8_t> levels(static_cast<size_t>(ic.batch) * ic.h * ic.w * ic.c), kernel(static_cast<size_t>(k) * ic.n);
  for (int8_t& v : levels) v = ic.extremes ? (rng() & 1 ? 127 : -128) : static_cast<int8_t>(rng());
  for (int8_t& v : kernel) v = ic.extremes ? (rng() & 1 ? 127 : -128) : static_cast<int8_t>(static_cast<int>(rng() % 3) - 1);
  const int planes = std::max(ic.planes, 1);
  std::vector<int32_t> threshold(static_cast<size_t>(planes) * ic.n);
  std::vector<uint8_t> flip(threshold.size());
  const int spread = (128 * static_cast<int>(std::sqrt(static_cast<double>(k))) >> ic.shift) + 1;
  for (size_t i = 0; i < threshold.size(); ++i) {
    const uint64_t r = rng();
    threshold[i] = r % 17 == 0 ? INT32_MIN : r % 17 == 1 ? INT32_MAX : static_cast<int>(r % (2 * spread)) - spread;
    flip[i] = (r >> 32) & 1;
  }
  const size_t pooled = static_cast<size_t>(ic.batch) * out_h * out_w;
  const size_t bit_words = ic.planes ? pooled * ic.planes * words : 0, stream_values = ic.stream ? pooled * ic.n : 0;
  std::vector<uint32_t> want_bits(bit_words, 0), want_stream(stream_values);
  for (size_t q = 0; q < pooled; ++q) {
    const int b = static_cast<int>(q / (out_h * out_w)), py = static_cast<int>(q / out_w % out_h), px = static_cast<int>(q % out_w);
    for (int n = 0; n < ic.n; ++n) {
      int64_t best = INT64_MIN;
      for (int e = 0; e < ic.ph * ic.pw; ++e) {
        const int oy = py * ic.ph + e / ic.pw, ox = px * ic.pw + e % ic.pw;
        int64_t pre = 0;
        for (int i = 0; i < ic.kh; ++i) {
          for (int j = 0; j < ic.kw; ++j) {
            const int iy = oy * ic.sh - ic.pt + i, ix = ox * ic.sw - ic.pl + j;
            if (iy < 0 || iy >= ic.h || ix < 0 || ix >= ic.w) continue;
            for (int c = 0; c < ic.c; ++c) {
              pre += int64_t{levels[((static_cast<size_t>(b) * ic.h + iy) * ic.w + ix) * ic.c + c]} *
                     kernel[(static_cast<size_t>(i * ic.kw + j) * ic.c + c) * ic.n + n];
            }
          }
        }
        best = std::max(best, pre);
      }
      int64_t value = best >> ic.shift;
      if (ic.stream == 16) value = static_cast<int16_t>(static_cast<uint16_t>(value & 0xffff));
      if (ic.stream) {
        want_stream[q * ic.n + n] = ic.stream == 16 ? static_cast<uint16_t>(value) : static_cast<uint32_t>(value);
      }
      for (int pl = 0; pl < ic.planes; ++pl) {
        const int64_t t = threshold[pl * ic.n + n];
        const bool bit = flip[pl * ic.n + n] ? value <= t : value >= t;
        want_bits[(q * ic.planes + pl) * words + n / 32] |= static_cast<uint32_t>(bit) << (n % 32);
      }
    }
  }
  const size_t stream_bytes = stream_values * (ic.stream / 8);
  std::vector<int8_t> bytes = levels;
  if (pixels) {
    for (int8_t& v : bytes) v = static_cast<int8_t>(static_cast<uint8_t>(v) ^ 0x80u);
  }
  int8_t* d_levels_allocation = nullptr;
  CHECK_CUDA(cudaMalloc(&d_levels_allocation, std::max<size_t>(bytes.size() + (misaligned ? 4 : 0), 1)));
  int8_t* d_levels = d_levels_allocation + (misaligned ? 4 : 0);
  CHECK_CUDA(cudaMemcpy(d_levels, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
  int8_t* d_kernel = ToDevice(kernel);
  int32_t* d_threshold = ToDevice(threshold);
  uint8_t* d_flip = ToDevice(flip);
  uint32_t* d_bits = nullptr;
  void* d_stream = nullptr;
  CHECK_CUDA(cudaMalloc(&d_bits, std::max<size_t>(bit_words, 1) * 4));
  CHECK_CUDA(cudaMalloc(&d_stream, std::max<size_t>(stream_bytes, 4)));
  jaxbnn::cuda::ImageConvProblem p;
  p.levels = d_levels;
  p.pixels = pixels;
  p.kernel = d_kernel;
  p.threshold = ic.planes ? d_threshold : nullptr;
  p.flip = ic.planes ? d_flip : nullptr;
  p.out_bits = ic.planes ? d_bits : nullptr;
  p.out_stream = ic.stream ? d_stream : nullptr;
  p.narrow_stream = ic.stream == 16;
  p.batch = ic.batch;
  p.in_h = ic.h;
  p.in_w = ic.w;
  p.c = ic.c;
  p.n = ic.n;
  p.kh = ic.kh;
  p.kw = ic.kw;
  p.stride_h = ic.sh;
  p.stride_w = ic.sw;
  p.pad_top = ic.pt;
  p.pad_left = ic.pl;
  p.pool_h = ic.ph;
  p.pool_w = ic.pw;
  p.out_h = out_h;
  p.out_w = out_w;
  p.planes = ic.planes;
  p.shift = ic.shift;
  // The launcher's choice; and where the direct kernel is that choice, the windowed kernel too where it takes the
  // problem, and where the wgmma GEMM form is, the mma.sync one, so that each stays checked on the problems it no
  // longer runs on this device.
  std::vector<std::pair<const char*, cudaError_t (*)(const jaxbnn::cuda::ImageConvProblem&, cudaStream_t)>> launchers = {
      {"", &jaxbnn::cuda::LaunchImageConv}};
  if (jaxbnn::cuda::ImageDirectTakes(p) && jaxbnn::cuda::ImageWindowTakes(p)) {
    launchers.push_back({" (windowed kernel)", &jaxbnn::cuda::LaunchImageWindow});
  }
  if (jaxbnn::cuda::ImageWgmmaTakes(p)) launchers.push_back({" (mma.sync GEMM form)", &jaxbnn::cuda::LaunchImageGemm});
  long wrong = 0;
  for (const auto& [label, launch] : launchers) {
    CHECK_CUDA(cudaMemset(d_bits, 0xA5, std::max<size_t>(bit_words, 1) * 4));  // poison: unwritten values show
    CHECK_CUDA(cudaMemset(d_stream, 0xA5, std::max<size_t>(stream_bytes, 4)));
    CHECK_CUDA(launch(p, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint32_t> got_bits(bit_words);
    if (bit_words) CHECK_CUDA(cudaMemcpy(got_bits.data(), d_bits, bit_words * 4, cudaMemcpyDeviceToHost));
    long launch_wrong = 0;
    for (size_t i = 0; i < bit_words; ++i) launch_wrong += got_bits[i] != want_bits[i];
    if (ic.stream == 16) {
      std::vector<uint16_t> got(stream_values);
      if (stream_values) CHECK_CUDA(cudaMemcpy(got.data(), d_stream, stream_bytes, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < stream_values; ++i) launch_wrong += got[i] != want_stream[i];
    } else if (ic.stream == 32) {
      std::vector<uint32_t> got(stream_values);
      if (stream_values) CHECK_CUDA(cudaMemcpy(got.data(), d_stream, stream_bytes, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < stream_values; ++i) launch_wrong += got[i] != want_stream[i];
    }
    std::printf("image %dx%dx%dx%d -> %d, %dx%d /%dx%d pad (%d,%d,%d,%d) pool %dx%d planes %d stream %d shift %d%s%s%s%s: "
                "%ld / %zu wrong\n",
                ic.batch, ic.h, ic.w, ic.c, ic.n, ic.kh, ic.kw, ic.sh, ic.sw, ic.pt, ic.pb, ic.pl, ic.pr, ic.ph, ic.pw,
                ic.planes, ic.stream, ic.shift, ic.extremes ? " extremes" : "", pixels ? " pixels" : "",
                misaligned ? " misaligned" : "", label, launch_wrong, bit_words + stream_values);
    wrong += launch_wrong;
  }
  for (void* d : {static_cast<void*>(d_levels_allocation), static_cast<void*>(d_kernel),
                  static_cast<void*>(d_threshold), static_cast<void*>(d_flip), static_cast<void*>(d_bits), d_stream}) {
    CHECK_CUDA(cudaFree(d));
  }
  return wrong;
}

// Thresholds of `planes` planes over the columns of `values` ((rows, channels)): a random row's value, one below or
// above it (ties), 1 in 13 at each int32 limit; random flips.
void RandomThresholdsAt(const std::vector<int32_t>& values, size_t rows, int channels, int planes,
                        std::vector<int32_t>& threshold, std::vector<uint8_t>& flip) {
  threshold.assign(static_cast<size_t>(planes) * channels, 0);
  flip.assign(threshold.size(), 0);
  for (size_t i = 0; i < threshold.size(); ++i) {
    const uint64_t r = rng();
    const int32_t at = values[(r >> 8) % rows * channels + i % channels];
    threshold[i] = r % 13 == 0 ? INT32_MIN : r % 13 == 1 ? INT32_MAX : at + static_cast<int32_t>(r % 3) - 1;
    flip[i] = (r >> 32) & 1;
  }
}

struct GlobalPoolCase {
  int batch, h, w, c, planes;
};

// Runs one global pooling case into poisoned bits (an int16 stream where narrow, else int32, over its whole
// range: int32 sums wrap); returns the number of wrong words. Thresholds at the sums (ties) and the int32 limits.
long RunGlobalPoolCase(const GlobalPoolCase& gc, bool narrow) {
  const size_t pixels = static_cast<size_t>(gc.h) * gc.w, words = (gc.c + 31) / 32;
  std::vector<int32_t> values(gc.batch * pixels * gc.c);
  for (int32_t& v : values) v = narrow ? static_cast<int16_t>(rng()) : static_cast<int32_t>(rng());
  std::vector<int32_t> sums(static_cast<size_t>(gc.batch) * gc.c);
  for (size_t i = 0; i < values.size(); ++i) {
    const size_t b = i / (pixels * gc.c), c = i % gc.c;
    sums[b * gc.c + c] = static_cast<int32_t>(static_cast<uint32_t>(sums[b * gc.c + c]) + static_cast<uint32_t>(values[i]));
  }
  std::vector<int32_t> threshold;
  std::vector<uint8_t> flip;
  RandomThresholdsAt(sums, gc.batch, gc.c, gc.planes, threshold, flip);
  std::vector<uint32_t> want(gc.batch * gc.planes * words, 0);
  for (int b = 0; b < gc.batch; ++b) {
    for (int pl = 0; pl < gc.planes; ++pl) {
      for (int c = 0; c < gc.c; ++c) {
        const int32_t sum = sums[static_cast<size_t>(b) * gc.c + c], t = threshold[pl * gc.c + c];
        const bool bit = flip[pl * gc.c + c] ? sum <= t : sum >= t;
        want[(static_cast<size_t>(b) * gc.planes + pl) * words + c / 32] |= static_cast<uint32_t>(bit) << (c % 32);
      }
    }
  }
  std::vector<int16_t> narrow_values(narrow ? values.size() : 0);
  for (size_t i = 0; i < narrow_values.size(); ++i) narrow_values[i] = static_cast<int16_t>(values[i]);
  void* d_stream = narrow ? static_cast<void*>(ToDevice(narrow_values)) : static_cast<void*>(ToDevice(values));
  int32_t* d_threshold = ToDevice(threshold);
  uint8_t* d_flip = ToDevice(flip);
  uint32_t* d_bits = nullptr;
  CHECK_CUDA(cudaMalloc(&d_bits, std::max<size_t>(want.size(), 1) * 4));
  CHECK_CUDA(cudaMemset(d_bits, 0xA5, std::max<size_t>(want.size(), 1) * 4));  // poison: unwritten words show
  jaxbnn::cuda::GlobalSumProblem p;
  p.stream = d_stream;
  p.narrow = narrow;
  p.threshold = d_threshold;
  p.flip = d_flip;
  p.out_bits = d_bits;
  p.batch = gc.batch;
  p.pixels = static_cast<int>(pixels);
  p.channels = gc.c;
  p.planes = gc.planes;
  CHECK_CUDA(jaxbnn::cuda::LaunchGlobalSumBits(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint32_t> got(want.size());
  if (!got.empty()) CHECK_CUDA(cudaMemcpy(got.data(), d_bits, got.size() * 4, cudaMemcpyDeviceToHost));
  long wrong = 0;
  for (size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
  std::printf("global pool %dx%dx%dx%d planes %d %s: %ld / %zu wrong\n", gc.batch, gc.h, gc.w, gc.c, gc.planes,
              narrow ? "int16" : "int32", wrong, want.size());
  for (void* d : {d_stream, static_cast<void*>(d_threshold), static_cast<void*>(d_flip), static_cast<void*>(d_bits)}) {
    CHECK_CUDA(cudaFree(d));
  }
  return wrong;
}

// A dense chain: m rows through layers of widths k_0, n_0 = k_1, ..., the last affine (float32) or bits.
struct ChainCase {
  int m;
  std::vector<int> widths;
  bool affine;
};

// Runs one dense-chain case into a poisoned result; returns the number of wrong elements. The input's padding bits
// set (the kernel ignores them); each layer's thresholds at its dot products (ties) and the int32 limits; the CPU
// layers by XOR-popc. `fits`: false where the chain passes the kernel's shared memory, whose launch must refuse.
long RunChainCase(const ChainCase& cc) {
  namespace cu = jaxbnn::cuda;
  const int layers = static_cast<int>(cc.widths.size()) - 1;
  const int k0 = cc.widths[0], in_words = (k0 + 31) / 32;
  std::vector<uint32_t> x = RandomPacked(cc.m, in_words, k0), padded = x;
  if (k0 % 32) {
    for (int r = 0; r < cc.m; ++r) padded[static_cast<size_t>(r) * in_words + in_words - 1] |= ~((1u << (k0 % 32)) - 1) & RandomWord();
  }
  std::vector<void*> allocations{ToDevice(padded)};
  cu::DenseChainProblem p;
  p.x = static_cast<const uint32_t*>(allocations[0]);
  p.m = cc.m;
  p.layers = layers;
  p.affine = cc.affine;
  std::vector<uint32_t> act = x;  // the CPU's rows of the current layer's input, padding bits 0
  std::vector<float> want_f32;
  for (int l = 0; l < layers; ++l) {
    const int k = cc.widths[l], n = cc.widths[l + 1], kw = (k + 31) / 32, nw = (n + 31) / 32;
    const std::vector<uint32_t> rows = RandomPacked(n, kw, k);
    const int row_tiles = (n + 7) / 8, k_tiles = (kw + 3) / 4;
    std::vector<uint32_t> fsb(static_cast<size_t>(row_tiles) * k_tiles * 32, 0);
    std::vector<int32_t> popc(n, 0);
    for (int r = 0; r < n; ++r) {
      for (int i = 0; i < kw; ++i) {
        fsb[((static_cast<size_t>(r / 8) * k_tiles + i / 4) * 8 + r % 8) * 4 + i % 4] = rows[static_cast<size_t>(r) * kw + i];
        popc[r] += __builtin_popcount(rows[static_cast<size_t>(r) * kw + i]);
      }
    }
    std::vector<int32_t> dots(static_cast<size_t>(cc.m) * n);
    for (int r = 0; r < cc.m; ++r) {
      for (int c = 0; c < n; ++c) {
        int differ = 0;
        for (int i = 0; i < kw; ++i) differ += __builtin_popcount(act[static_cast<size_t>(r) * kw + i] ^ rows[static_cast<size_t>(c) * kw + i]);
        dots[static_cast<size_t>(r) * n + c] = k - 2 * differ;
      }
    }
    cu::DenseChainLayer& layer = p.layer[l];
    layer.w = ToDevice(fsb);
    layer.popc_b = ToDevice(popc);
    layer.k = k;
    layer.n = n;
    allocations.push_back(const_cast<uint32_t*>(layer.w));
    allocations.push_back(const_cast<int32_t*>(layer.popc_b));
    if (cc.affine && l == layers - 1) {
      std::vector<float> scale(n), bias(n);
      for (int c = 0; c < n; ++c) {
        scale[c] = static_cast<float>(static_cast<int>(RandomWord() % 2001) - 1000) / 257.0f;
        bias[c] = static_cast<float>(static_cast<int>(RandomWord() % 2001) - 1000) / 129.0f;
      }
      want_f32.resize(static_cast<size_t>(cc.m) * n);
      for (size_t i = 0; i < want_f32.size(); ++i) {
        const volatile float product = static_cast<float>(dots[i]) * scale[i % n];  // two roundings, as the kernel
        want_f32[i] = product + bias[i % n];
      }
      layer.scale = ToDevice(scale);
      layer.bias = ToDevice(bias);
      allocations.push_back(const_cast<float*>(layer.scale));
      allocations.push_back(const_cast<float*>(layer.bias));
      break;
    }
    std::vector<int32_t> threshold;
    std::vector<uint8_t> flip;
    RandomThresholdsAt(dots, cc.m, n, 1, threshold, flip);
    act.assign(static_cast<size_t>(cc.m) * nw, 0);
    for (int r = 0; r < cc.m; ++r) {
      for (int c = 0; c < n; ++c) {
        const int32_t d = dots[static_cast<size_t>(r) * n + c];
        const bool bit = flip[c] ? d <= threshold[c] : d >= threshold[c];
        act[static_cast<size_t>(r) * nw + c / 32] |= static_cast<uint32_t>(bit) << (c % 32);
      }
    }
    layer.threshold = ToDevice(threshold);
    layer.flip = ToDevice(flip);
    allocations.push_back(const_cast<int32_t*>(layer.threshold));
    allocations.push_back(const_cast<uint8_t*>(layer.flip));
  }
  std::vector<int64_t> ks(cc.widths.begin(), cc.widths.end() - 1), ns(cc.widths.begin() + 1, cc.widths.end());
  const bool fits = cu::DenseChainSmemBytes(ks.data(), ns.data(), layers) <= cu::kChainMaxSmemBytes;
  const size_t out_elements = cc.affine ? want_f32.size() : act.size();
  void* d_out = nullptr;
  CHECK_CUDA(cudaMalloc(&d_out, std::max<size_t>(out_elements, 1) * 4));
  CHECK_CUDA(cudaMemset(d_out, 0xA5, std::max<size_t>(out_elements, 1) * 4));  // poison: unwritten elements show
  p.out = d_out;
  allocations.push_back(d_out);
  const cudaError_t launched = cu::LaunchDenseChain(p, nullptr);
  long wrong = 0;
  if (!fits) {  // refused, nothing launched
    wrong = launched == cudaErrorInvalidValue ? 0 : 1;
  } else {
    CHECK_CUDA(launched);
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint32_t> got(out_elements);
    if (!got.empty()) CHECK_CUDA(cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < out_elements; ++i) {
      uint32_t want_word = 0;
      if (cc.affine) {
        std::memcpy(&want_word, &want_f32[i], 4);
      } else {
        want_word = act[i];
      }
      wrong += got[i] != want_word;
    }
  }
  std::string widths;
  for (int w : cc.widths) widths += (widths.empty() ? "" : "-") + std::to_string(w);
  std::printf("dense chain m %d %s %s%s: %ld / %zu wrong\n", cc.m, widths.c_str(), cc.affine ? "affine" : "bits",
              fits ? "" : " (refused: past shared memory)", wrong, out_elements);
  for (void* d : allocations) CHECK_CUDA(cudaFree(d));
  return wrong;
}

// ResNet-14's tail, widths off every word / tile / k256 step, one layer, eight, the widest reduction, rows off the
// CTA's 16 and past one block a CTA; last, a chain past the kernel's shared memory (refused).
std::vector<ChainCase> ChainCases() {
  return {{37, {77, 45, 300, 10}, true},
          {17, {33, 1}, false},
          {1, {1, 64, 1, 95}, false},
          {70, {512, 512, 512, 10}, true},
          {16, {257, 255, 129, 31, 64, 96, 8, 300, 2}, true},
          {1024, {512, 512, 512, 10}, true},
          {3000, {4096, 100, 33}, false},
          {5000, {2000, 33, 10}, true},
          {8, {1024, 1024, 1024, 10}, true}};
}

// Pixels from one to past a warp's round of loads at every split (one warp an item to eight), channels within and
// past whole words, the zoo ResNets' last streams, eight planes.
std::vector<GlobalPoolCase> GlobalPoolCases() {
  return {{3, 1, 1, 1, 2},   {5, 2, 4, 33, 1},   {2, 3, 3, 70, 2},   {4, 4, 4, 512, 1}, {3, 5, 5, 96, 8},
          {2, 7, 7, 512, 2}, {9, 8, 9, 64, 1},   {1, 13, 11, 40, 1}, {2, 1, 17, 31, 2}, {33, 7, 7, 128, 1}};
}

struct StreamBitsCase {
  long long rows;
  int channels, planes;
  bool offset;  // the stream one element past a 16-byte boundary: the word kernel
};

// Runs one stream-bits case into poisoned bits (an int16 stream where narrow, else int32, over its whole range);
// returns the number of wrong words. Thresholds at the values (ties) and the int32 limits, flipped channels.
long RunStreamBitsCase(const StreamBitsCase& sc, bool narrow) {
  const size_t count = static_cast<size_t>(sc.rows) * sc.channels, words = (sc.channels + 31) / 32;
  std::vector<int32_t> values(count);
  for (int32_t& v : values) v = narrow ? static_cast<int16_t>(rng()) : static_cast<int32_t>(rng());
  std::vector<int32_t> threshold;
  std::vector<uint8_t> flip;
  RandomThresholdsAt(values, sc.rows, sc.channels, sc.planes, threshold, flip);
  std::vector<uint32_t> want(static_cast<size_t>(sc.rows) * sc.planes * words, 0);
  for (size_t i = 0; i < count; ++i) {
    const size_t row = i / sc.channels, c = i % sc.channels;
    for (int pl = 0; pl < sc.planes; ++pl) {
      const int32_t t = threshold[pl * sc.channels + c];
      const bool bit = flip[pl * sc.channels + c] ? values[i] <= t : values[i] >= t;
      want[(row * sc.planes + pl) * words + c / 32] |= static_cast<uint32_t>(bit) << (c % 32);
    }
  }
  const size_t element = narrow ? 2 : 4, shift = sc.offset ? element : 0;
  char* d_base = nullptr;
  CHECK_CUDA(cudaMalloc(&d_base, count * element + shift));
  std::vector<int16_t> narrow_values(narrow ? count : 0);
  for (size_t i = 0; i < narrow_values.size(); ++i) narrow_values[i] = static_cast<int16_t>(values[i]);
  CHECK_CUDA(cudaMemcpy(d_base + shift, narrow ? static_cast<const void*>(narrow_values.data()) : values.data(),
                        count * element, cudaMemcpyHostToDevice));
  int32_t* d_threshold = ToDevice(threshold);
  uint8_t* d_flip = ToDevice(flip);
  uint32_t* d_bits = nullptr;
  CHECK_CUDA(cudaMalloc(&d_bits, want.size() * 4));
  CHECK_CUDA(cudaMemset(d_bits, 0xA5, want.size() * 4));  // poison: unwritten words show
  jaxbnn::cuda::StreamBitsProblem p;
  p.stream = d_base + shift;
  p.narrow = narrow;
  p.threshold = d_threshold;
  p.flip = d_flip;
  p.out_bits = d_bits;
  p.rows = sc.rows;
  p.channels = sc.channels;
  p.planes = sc.planes;
  CHECK_CUDA(jaxbnn::cuda::LaunchStreamBits(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint32_t> got(want.size());
  CHECK_CUDA(cudaMemcpy(got.data(), d_bits, got.size() * 4, cudaMemcpyDeviceToHost));
  long wrong = 0;
  for (size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
  std::printf("stream bits %lldx%d planes %d %s%s: %ld / %zu wrong\n", sc.rows, sc.channels, sc.planes,
              narrow ? "int16" : "int32", sc.offset ? " offset" : "", wrong, want.size());
  for (void* d : {static_cast<void*>(d_base), static_cast<void*>(d_threshold), static_cast<void*>(d_flip),
                  static_cast<void*>(d_bits)}) {
    CHECK_CUDA(cudaFree(d));
  }
  return wrong;
}

// The rows kernel (whole words, one or two planes): rows past a CTA's, a CTA's threads not a multiple of a row's
// vectors (96), one row a CTA (2048 int16 channels; int32's take the word kernel), more rows than one round of the
// grid; the word kernel: three and eight planes, channels past a word, one channel, a stream off 16-byte alignment.
std::vector<StreamBitsCase> StreamBitsCases() {
  return {{105, 64, 2, false}, {162, 96, 2, false}, {3, 2048, 1, false}, {5, 1024, 2, false},
          {300000, 32, 2, false}, {162, 96, 3, false}, {12, 32, 8, false}, {32, 70, 2, false},
          {5, 1, 1, false}, {77, 64, 2, true}};
}

// The launcher refuses a shift or an int16 narrowing without a stream to apply them to (the bits alone compare the
// pre-activations): an error, nothing launched. Returns the number of problems it did not refuse.
long ImageRefusals() {
  long accepted = 0;
  for (int shift : {0, 3}) {
    for (bool narrow : {false, true}) {
      if (shift == 0 && !narrow) continue;
      jaxbnn::cuda::ImageConvProblem p;
      p.batch = p.in_h = p.in_w = p.out_h = p.out_w = p.c = p.n = p.planes = 1;
      p.shift = shift;
      p.narrow_stream = narrow;
      uint32_t* bits = nullptr;
      CHECK_CUDA(cudaMalloc(&bits, 4));
      p.out_bits = bits;
      const cudaError_t err = jaxbnn::cuda::LaunchImageConv(p, nullptr);
      std::printf("image refusal: shift %d narrow %d without a stream: %s\n", shift, narrow ? 1 : 0,
                  err == cudaErrorInvalidValue ? "refused" : "NOT refused");
      accepted += err != cudaErrorInvalidValue;
      CHECK_CUDA(cudaFree(bits));
    }
  }
  return accepted;
}

// The zoo's first layers at small sizes, odd shapes, the largest pool window, the extremes.
std::vector<ImageCase> ImageCases() {
  return {
      {3, 28, 28, 1, 64, 3, 3, 1, 1, 1, 1, 1, 1, 2, 2, 1, 0, 0, false},      // MNIST conv
      {2, 32, 32, 3, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 2, 0, 0, false},     // VGG-small, ternary output
      {2, 32, 32, 3, 128, 3, 3, 2, 2, 0, 1, 0, 1, 1, 1, 0, 7, 32, false},     // ResNet-14 stem
      {1, 45, 47, 3, 64, 7, 7, 4, 4, 3, 2, 3, 3, 1, 1, 0, 7, 32, false},      // ResNet-18 stem
      {1, 67, 67, 3, 128, 11, 11, 4, 4, 5, 5, 5, 5, 2, 2, 1, 0, 0, false},   // AlexNet
      {37, 1, 1, 784, 100, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, false},    // MNIST MLP (a 1x1 conv)
      {2, 9, 13, 5, 33, 2, 3, 1, 2, 0, 3, 4, 0, 3, 2, 2, 0, 0, false},       // pool 3x2 dropping rows
      {2, 9, 13, 5, 1, 2, 3, 1, 2, 0, 3, 4, 0, 1, 1, 0, 31, 32, false},       // one channel, shift 31
      {1, 17, 33, 2, 31, 1, 1, 1, 1, 0, 0, 0, 0, 8, 16, 3, 0, 0, false},     // a 128-element window
      {2, 23, 19, 3, 65, 11, 11, 4, 4, 2, 2, 2, 2, 1, 1, 8, 0, 0, true},     // extremes, eight planes
      {3, 21, 21, 3, 64, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0, 32, true},       // extremes, int32
      {2, 3, 4, 2, 8, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, 1, 0, 0, false},         // a kernel larger than the image
      {2, 30, 30, 3, 64, 3, 3, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 32, false},      // VALID: every row interior
      {3, 5, 6, 4, 70, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, false},        // C = 4: aligned words, borders
      {1, 12, 13, 7, 70, 13, 13, 1, 1, 6, 6, 6, 6, 2, 1, 2, 0, 0, false},    // K = 1183: weights step by step
      {3, 1, 1, 1100, 40, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 3, 32, false},     // the same, in aligned words
      // 128-column tiles (N > 64, K of 4 to 16 steps):
      {2, 67, 68, 3, 192, 11, 11, 4, 4, 5, 5, 5, 5, 2, 2, 2, 0, 0, false},   // AlexNet-like, a partial second tile
      {2, 24, 19, 3, 130, 7, 7, 1, 1, 3, 3, 3, 3, 1, 1, 8, 0, 0, true},      // extremes, eight planes
      {3, 21, 20, 3, 96, 7, 7, 2, 2, 3, 2, 3, 2, 1, 1, 0, 7, 32, true},       // extremes, int32, stride 2
      {1, 16, 16, 128, 128, 1, 1, 1, 1, 0, 0, 0, 0, 8, 16, 3, 0, 0, false},  // a 128-element window, aligned words
      {3, 9, 10, 4, 70, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, 1, 0, 0, false},       // C = 4: aligned words, borders
      {2, 10, 10, 32, 100, 4, 4, 1, 1, 2, 1, 2, 1, 1, 1, 2, 0, 0, false},    // K = 512: the most resident steps
      {2, 12, 12, 8, 96, 9, 9, 1, 1, 4, 4, 4, 4, 1, 1, 1, 0, 0, false},      // K = 648: 64-column tiles, resident
      // the windowed kernel (C <= 4, no pool or 2 x 2): slot layouts, partial tiles, the stream's scalar stores
      {2, 19, 23, 2, 40, 3, 5, 1, 2, 1, 1, 2, 2, 2, 2, 1, 0, 0, false},      // C = 2: two pixels a slot, stride (1, 2)
      {2, 40, 37, 1, 33, 7, 7, 3, 3, 3, 3, 3, 3, 1, 1, 2, 0, 0, false},      // C = 1: 7 taps in two 4-pixel slots
      {3, 28, 28, 1, 30, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 0, 3, 32, false},      // int32, N % 4 != 0: scalar stores
      {2, 32, 30, 3, 64, 3, 3, 1, 1, 1, 1, 1, 1, 2, 2, 0, 5, 32, true},       // extremes, pooled int32
      {1, 40, 40, 3, 64, 16, 16, 1, 1, 8, 7, 8, 7, 1, 1, 1, 0, 0, false},    // 256 slots: the most resident steps
      {5, 13, 21, 3, 17, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, false},      // partial tiles in both directions
      {2, 15, 17, 1, 64, 3, 3, 1, 1, 1, 1, 1, 1, 2, 2, 0, 2, 32, false},      // pool dropping the odd row and column
      {2, 9, 40, 4, 200, 2, 3, 2, 1, 0, 1, 1, 1, 2, 2, 3, 0, 0, true},       // extremes, C = 4, four column tiles
      {1, 1, 1, 3, 16, 1, 1, 1, 1, 5, 5, 5, 5, 1, 1, 1, 0, 0, false},       // 3 bytes of levels: less than one copy
      // the direct kernel (threshold planes of at most 32 channels from at most 12 products): K4 of 1, 2 and 3,
      // pools, strides, planes, partial words; more pixels than its CTAs' threads (the stride loop); and just past
      // its limits (33 channels, 13 products: the windowed and im2col kernels)
      {300, 28, 28, 1, 32, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, false},   // MNIST conv's first layer
      {2, 15, 14, 3, 32, 2, 2, 2, 1, 2, 1, 0, 3, 1, 1, 2, 0, 0, true},      // K = 12, extremes, two planes
      {3, 19, 23, 1, 31, 3, 3, 2, 1, 1, 1, 1, 1, 3, 2, 3, 0, 0, false},     // N = 31, pool 3x2, three planes
      {2, 7, 9, 1, 5, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, false},        // K = 1
      {2, 9, 11, 4, 20, 1, 3, 2, 2, 1, 0, 0, 1, 2, 2, 8, 0, 0, true},       // C = 4, K = 12, eight planes, extremes
      {2, 6, 8, 10, 17, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, false},      // C = 10 (no windowed form), K = 10
      {1, 3, 2, 1, 30, 3, 3, 1, 1, 2, 2, 2, 2, 1, 1, 2, 0, 0, false},       // fields mostly outside a 3 x 2 image
      {2, 8, 8, 1, 32, 2, 2, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, true},        // K = 4, extremes
      {2, 11, 10, 2, 20, 2, 2, 1, 1, 1, 0, 1, 0, 2, 2, 1, 0, 0, false},     // K = 8: two level words
      {2, 12, 13, 1, 33, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, false},     // 33 channels: not direct
      {2, 12, 13, 13, 32, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, false},    // 13 products: not direct
      // slots a word of the rows' bytes apart (the stride a multiple of a slot's pixels; RGB read as grey)
      {2, 37, 45, 1, 48, 5, 6, 2, 4, 2, 1, 1, 3, 1, 1, 1, 0, 16, false},    // C = 1 at stride 4
      {2, 18, 26, 2, 36, 3, 4, 2, 2, 1, 0, 3, 2, 2, 2, 1, 3, 16, true},     // C = 2 at stride 2, pooled extremes
      {2, 17, 29, 3, 64, 4, 3, 1, 4, 1, 1, 1, 0, 1, 1, 1, 0, 16, false},    // RGB at stride 4, 3 taps: 9 grey ones
      {3, 30, 61, 3, 70, 5, 9, 3, 8, 0, 2, 7, 1, 2, 2, 2, 2, 32, true},     // RGB at stride 8, pooled extremes
      // the int16 stream, and the stream with its threshold planes (a ResNet stem writing the next block's bits)
      {2, 32, 32, 3, 128, 3, 3, 2, 2, 0, 1, 0, 1, 1, 1, 0, 0, 16, false},   // ResNet-14 stem, int16
      {3, 28, 28, 1, 30, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 0, 2, 16, false},    // int16, N % 8 != 0: scalar stores
      {1, 45, 47, 3, 64, 7, 7, 4, 4, 3, 2, 3, 3, 1, 1, 1, 0, 16, false},    // ResNet-18 stem, int16 and its bits
      {1, 45, 47, 3, 64, 7, 7, 4, 4, 3, 2, 3, 3, 1, 1, 1, 7, 16, true},     // its shift 7: sums >> 7 within int16
      {2, 19, 21, 1, 40, 2, 2, 1, 1, 1, 0, 1, 0, 1, 1, 2, 1, 16, true},     // K = 4 >> 1: one sum wraps (2^15)
      {2, 19, 21, 1, 40, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 2, 0, 16, true},     // K = 1: every sum within int16
      {2, 32, 30, 3, 64, 3, 3, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 32, false},    // pooled int32 and two planes, shift 3
      {2, 21, 21, 3, 96, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 16, true},     // extremes wrapping int16, its bits
      {2, 19, 23, 2, 70, 3, 5, 1, 2, 1, 1, 2, 2, 2, 2, 2, 1, 16, false},    // pooled int16, partial vectors
      {2, 9, 13, 5, 33, 2, 3, 1, 2, 0, 3, 4, 0, 3, 2, 0, 1, 16, false},     // the im2col kernel's int16
      {2, 24, 19, 5, 130, 7, 7, 1, 1, 3, 3, 3, 3, 1, 1, 2, 0, 16, true},    // its extremes wrapping, two planes
      {3, 1, 1, 1100, 40, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 4, 32, false},   // its int32 and bits, shift 4
      // the GEMM form (1 x 1, stride 1, no padding or pool, C and N multiples of 16): partial row and column
      // tiles, K within one chunk and past whole chunks, every output
      {37, 1, 1, 784, 1024, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, false},   // MNIST MLP
      {300, 1, 1, 784, 96, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 2, 0, 0, true},     // extremes, two planes
      {129, 1, 1, 1040, 64, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 8, 0, 0, true},    // eight planes, K = 8 chunks + 16
      {3, 5, 7, 48, 80, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 3, 32, false},      // a 1 x 1 conv: int32, shift 3
      {130, 1, 1, 16, 16, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 16, false},    // K = 16: int16 and its bits
      {2, 3, 3, 256, 48, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 2, 32, true},       // two whole chunks, both outputs
      // the wgmma form (sm_90: K <= 1248): more row tiles than a column tile's CTAs (132 SMs: 16 CTAs a column
      // tile at N = 1024, 66 at N = 144), the longest K it takes (39 resident steps, a ring of 4 stages wrapping
      // within a tile, and across tiles at 8518 rows), the shortest past it (the mma.sync form)
      {4173, 1, 1, 160, 1024, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, false},  // 33 row tiles x 8 column tiles
      {700, 1, 1, 160, 272, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 2, 1, 16, true},    // a 16-column last tile, int16 and bits
      {70, 1, 1, 1248, 144, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 32, true},    // K = 1248
      {8518, 1, 1, 1248, 144, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 2, 0, 0, false},  // 67 row tiles x 2 column tiles
      {70, 1, 1, 1264, 48, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, false},     // K = 1264: the mma.sync form
  };
}

// --time-image: the first-layer launcher on each shape below (uint8 pixels, weights of -1, 0, +1, one plane of
// threshold bits, "SAME" padding), one launch at a time (median of 9) and 30 queued; where the direct kernel takes
// the shape, it against the windowed kernel in the same process. The MNIST conv net's first layer (28 x 28 grey,
// 3 x 3, 32 channels), 32 x 32 RGB 2 x 2 into 32 (12 products, the direct kernel's most), the MNIST MLP's 784 ->
// 1024 (a 1 x 1 image of 784 channels: the GEMM form).
void TimeImage() {
  struct Shape {
    const char* name;
    int h, w, c, n, k;
    std::vector<int> batches;
  };
  for (const Shape& s : {Shape{"mnist conv 28x28x1->32", 28, 28, 1, 32, 3, {8, 1024, 32768}},
                         Shape{"32x32x3->32 2x2", 32, 32, 3, 32, 2, {8, 1024}},
                         Shape{"mlp 784->1024", 1, 1, 784, 1024, 1, {8, 1024, 32768}}}) {
    for (int batch : s.batches) {
      std::vector<int8_t> levels(static_cast<size_t>(batch) * s.h * s.w * s.c), kernel(static_cast<size_t>(s.k * s.k) * s.c * s.n);
      for (int8_t& v : levels) v = static_cast<int8_t>(rng());
      for (int8_t& v : kernel) v = static_cast<int8_t>(static_cast<int>(rng() % 3) - 1);
      std::vector<int32_t> threshold(s.n, 0);
      std::vector<uint8_t> flip(s.n, 0);
      jaxbnn::cuda::ImageConvProblem p;
      p.levels = ToDevice(levels);
      p.kernel = ToDevice(kernel);
      p.threshold = ToDevice(threshold);
      p.flip = ToDevice(flip);
      CHECK_CUDA(cudaMalloc(&p.out_bits, static_cast<size_t>(batch) * s.h * s.w * ((s.n + 31) / 32) * 4));
      p.pixels = true;
      p.batch = batch;
      p.in_h = p.out_h = s.h;
      p.in_w = p.out_w = s.w;
      p.c = s.c;
      p.n = s.n;
      p.kh = p.kw = s.k;
      p.pad_top = p.pad_left = s.k / 2;
      p.planes = 1;
      const LaunchTimes times = TimeLaunches([&] { CHECK_CUDA(jaxbnn::cuda::LaunchImageConv(p, nullptr)); });
      std::printf("time image %s b%-6d %9.4f ms queued %9.4f ms", s.name, batch, times.alone_ms, times.queued_ms);
      if (jaxbnn::cuda::ImageDirectTakes(p) && jaxbnn::cuda::ImageWindowTakes(p)) {
        const LaunchTimes window = TimeLaunches([&] { CHECK_CUDA(jaxbnn::cuda::LaunchImageWindow(p, nullptr)); });
        std::printf("   (direct)   windowed %9.4f ms queued %9.4f ms", window.alone_ms, window.queued_ms);
      }
      std::printf("\n");
      for (const void* ptr : {static_cast<const void*>(p.levels), static_cast<const void*>(p.kernel),
                              static_cast<const void*>(p.threshold), static_cast<const void*>(p.flip),
                              static_cast<const void*>(p.out_bits)}) {
        CHECK_CUDA(cudaFree(const_cast<void*>(ptr)));
      }
    }
  }
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  std::vector<KernelPath> timed;  // the engines a timing mode times
  if (mode == "--time") timed = {KernelPath::kWgmma, KernelPath::kMmaSync, KernelPath::kSimt};
  if (mode == "--time-wgmma") timed = {KernelPath::kWgmma};
  if (mode == "--time-mma") timed = {KernelPath::kMmaSync};
  if (!timed.empty()) {
    TimeAll(timed, argc > 2 ? argv[2] : "");
    return 0;
  }
  if (mode == "--time-image") {
    TimeImage();
    return 0;
  }
  if (mode == "--image" || mode == "--image-direct") {  // the first-layer kernels' cases only (or the direct one's)
    long failures = 0;
    for (const ImageCase& ic : ImageCases()) {
      // the direct kernel's rule (ImageDirectTakes) on a case's fields
      const bool direct = ic.planes >= 1 && ic.stream == 0 && ic.kh * ic.kw * ic.c <= 12 && ic.n <= 32;
      if (mode == "--image-direct" && !direct) continue;
      for (bool pixels : {false, true}) failures += RunImageCase(ic, pixels, false) != 0;
      failures += RunImageCase(ic, true, true) != 0;
    }
    failures += ImageRefusals();
    std::printf("%s: %ld failing runs\n", failures ? "FAILED" : "ALL OK", failures);
    return failures ? 1 : 0;
  }
  if (mode == "--global-pool") {  // the global pooling kernel's cases only
    long failures = 0;
    for (const GlobalPoolCase& gc : GlobalPoolCases()) {
      for (bool narrow : {false, true}) failures += RunGlobalPoolCase(gc, narrow) != 0;
    }
    std::printf("%s: %ld failing runs\n", failures ? "FAILED" : "ALL OK", failures);
    return failures ? 1 : 0;
  }
  if (mode == "--chain" || mode == "--small-chain") {  // the dense-chain kernel's cases only
    long failures = 0;
    std::vector<ChainCase> chain_cases = ChainCases();
    if (mode == "--small-chain") chain_cases.resize(5);
    for (const ChainCase& cc : chain_cases) failures += RunChainCase(cc) != 0;
    std::printf("%s: %ld failing runs\n", failures ? "FAILED" : "ALL OK", failures);
    return failures ? 1 : 0;
  }
  if (mode == "--stream-bits") {  // the stream's threshold planes only
    long failures = 0;
    for (const StreamBitsCase& sc : StreamBitsCases()) {
      for (bool narrow : {false, true}) failures += RunStreamBitsCase(sc, narrow) != 0;
    }
    std::printf("%s: %ld failing runs\n", failures ? "FAILED" : "ALL OK", failures);
    return failures ? 1 : 0;
  }
  if (mode == "--repeats") {  // the inputs read twice only: every epilogue (both planes' counts), every engine
    long failures = 0;
    for (const ResidualCase& rc : RepeatedInputResidualCases()) {
      for (KernelPath path : {KernelPath::kWgmma, KernelPath::kMmaSync, KernelPath::kSimt}) {
        failures += RunResidualForms(rc, path);
      }
    }
    for (const ConvCase& cc : RepeatedInputCases()) {
      for (KernelPath path : {KernelPath::kWgmma, KernelPath::kMmaSync, KernelPath::kSimt}) {
        for (Epilogue ep : {Epilogue::kInt32, Epilogue::kInt16, Epilogue::kAffine, Epilogue::kBits}) {
          failures += RunCase(cc, ep, path, true) != 0;
        }
        failures += RunCase(cc, Epilogue::kBits, path, true, 2) != 0;
      }
    }
    std::printf("%s: %ld failing runs\n", failures ? "FAILED" : "ALL OK", failures);
    return failures ? 1 : 0;
  }
  if (mode == "--doubled" || mode == "--small-doubled") {  // the doubled K blocks' cases only, on every engine
    long failures = 0;
    std::vector<DoubledCase> doubled_cases = DoubledCases();
    if (mode == "--small-doubled") doubled_cases = SmallDoubledCases();
    for (const DoubledCase& dc : doubled_cases) {
      for (KernelPath path : {KernelPath::kWgmma, KernelPath::kMmaSync, KernelPath::kSimt}) {
        failures += RunDoubledForms(dc, path);
      }
    }
    std::printf("%s: %ld failing runs\n", failures ? "FAILED" : "ALL OK", failures);
    return failures ? 1 : 0;
  }
  if (mode == "--boxes") {  // the TMA boxes over strided taps and whole images only, every epilogue, every engine
    long failures = 0;
    const std::vector<KernelPath> engines = {KernelPath::kWgmma, KernelPath::kMmaSync, KernelPath::kSimt};
    for (const ConvCase& cc : StridedAndWholeImageBoxCases()) {
      for (Epilogue ep : {Epilogue::kInt32, Epilogue::kInt16, Epilogue::kAffine, Epilogue::kBits}) {
        if (ep == Epilogue::kInt16 && cc.kh * cc.kw * cc.c > jaxbnn::cuda::kMaxInt16Reduction) continue;
        for (KernelPath path : engines) failures += RunCase(cc, ep, path, true) != 0;
      }
      for (KernelPath path : engines) failures += RunCase(cc, Epilogue::kBits, path, true, 2) != 0;
    }
    for (const ResidualCase& rc : ResidualBoxCases()) {
      for (KernelPath path : engines) failures += RunResidualForms(rc, path);
    }
    std::printf("%s: %ld failing runs\n", failures ? "FAILED" : "ALL OK", failures);
    return failures ? 1 : 0;
  }
  if (mode == "--residual") {  // the residual epilogue's cases only, on every engine
    long failures = 0;
    for (const ResidualCase& rc : ResidualCases()) {
      for (KernelPath path : {KernelPath::kWgmma, KernelPath::kMmaSync, KernelPath::kSimt}) {
        failures += RunResidualForms(rc, path);
      }
    }
    std::printf("%s: %ld failing runs\n", failures ? "FAILED" : "ALL OK", failures);
    return failures ? 1 : 0;
  }
  const bool planes_only = mode == "--planes" || mode == "--small-planes";
  const bool small = mode == "--small" || mode == "--small-planes", dense = mode == "--dense";
  const bool whole_words_only = mode == "--whole-words", band_only = mode == "--band";
  // The cases in a fixed order: `--small` picks some of them by index.
  std::vector<ConvCase> cases;
  for (auto group : {GemmAndConvCases, BandCases, ShortKAndDenseTapCases, BorderTableCases, WholeWordDenseTapCases,
                     RepeatedInputCases}) {
    const std::vector<ConvCase> more = group();
    cases.insert(cases.end(), more.begin(), more.end());
  }
  // Small grids whose tiles no TMA box takes (7 x 7 and 14 x 14 images, stride 2): the resident kernel's cp.async
  // instance, 128-column tiles (N = 300: the last of 44 columns), both paddings
  const ConvCase resident_copies[] = {{2, 7, 7, 512, 300, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false},
                                      {3, 14, 14, 256, 200, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, true}};
  for (const ConvCase& cc : resident_copies) cases.push_back(cc);
  // Reductions past the threshold epilogue's paired bounds (kPairedBoundsMaxK) where nothing is corrected for the
  // border: BMMs of 8192, 9000, 16383 and 16384 bits, N whole words or not, and convolutions that pad nothing
  // (9000, 9216 pooled) or pad with ones (13500).
  const std::vector<ConvCase> unbordered_long = {Bmm(77, 320, 8192), Bmm(33, 64, 16383), Bmm(20, 64, 16384),
                                                  Bmm(9, 300, 9000),
                                                  {2, 9, 9, 1000, 96, 3, 3, 1, 1, 0, 0, 0, 0, 1, 1, false},
                                                  {2, 8, 8, 1024, 64, 3, 3, 1, 1, 0, 0, 0, 0, 2, 2, false},
                                                  {2, 8, 8, 1500, 128, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true}};
  cases.insert(cases.end(), unbordered_long.begin(), unbordered_long.end());
  // The dense-tap kernel's fixed-size gather (3 x 3 at C = 32) unpooled in "one" padding (WholeWordDenseTapCases
  // take it pooled and in "zero" padding)
  const ConvCase whole_word_one = {2, 10, 9, 32, 40, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true};
  cases.push_back(whole_word_one);
  const std::vector<ConvCase> strided_boxes = StridedAndWholeImageBoxCases();
  cases.insert(cases.end(), strided_boxes.begin(), strided_boxes.end());
  // Two threshold planes on every engine, over a subset that adds about a quarter to the bits cases' run time:
  // every BMM (M = 1, N past multiples of 32 and over several column tiles, persistent CTAs), both paddings,
  // 1x1 to 15x15 filters, stride 2, pools (2x2, 3x3, 2x1, past 128 columns), N <= 64, <= 128 and > 256,
  // reductions either side of the paired bounds (k_real 6400, 7200, 12544, 18432; a BMM of 8192), and each
  // kernel's forms: TMA boxes, W-byte taps, band channel planes and pixel pairs, short K blocks, dense taps,
  // the border tables, whole-word taps, the resident copies.
  std::vector<ConvCase> two_planes;
  for (int i : {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 14, 16, 17, 18, 19, 20, 21,
                22, 23, 29, 31, 34, 35, 37, 38, 39, 41, 52, 53, 56, 60, 62, 63, 66, 68, 69, 70,
                73, 75, 79, 82, 85, 86, 87, 88, 89, 90, 92, 95, 96, 97, 99, 102, 104, 105, 106}) {
    two_planes.push_back(cases[i]);
  }
  two_planes.insert(two_planes.end(), unbordered_long.begin(), unbordered_long.end());
  if (small) {
    // pooled, unpooled 3x3 with "zero" padding, the unpaired bounds (k_real 12544), dense taps, a BMM
    two_planes = {Bmm(129, 257, 1000), cases[10], cases[14], cases[17], cases[70], unbordered_long[0]};
    cases = {Bmm(5, 33, 31), Bmm(129, 257, 1000), cases[10], cases[12], cases[14], cases[17], cases[21], cases[23],
             cases[28], cases[31], cases[32], cases[35], cases[38], cases[42], cases[43], cases[46], cases[49],
             cases[52], cases[56], cases[59], cases[60], cases[62], cases[66], cases[67], cases[68], cases[70],
             cases[73], cases[74], cases[75], cases[79], cases[80], cases[85], cases[89],
             cases[94], cases[95]};
    for (const ConvCase& cc : resident_copies) cases.push_back(cc);
    cases.push_back(unbordered_long[0]);
    cases.push_back(unbordered_long[4]);
    const std::vector<ConvCase> whole_words = WholeWordDenseTapCases();
    cases.push_back(whole_words[0]);
    cases.push_back(whole_words[2]);
    cases.push_back(whole_words[5]);
    cases.push_back(whole_words[7]);
    cases.push_back(whole_word_one);
    cases.push_back(strided_boxes[1]);
    cases.push_back(strided_boxes[2]);
  }
  if (dense) {  // convolutions only (a BMM is a 1 x 1 image)
    auto other = [](const ConvCase& cc) { return cc.c > 32 || cc.h * cc.w == 1; };
    cases.erase(std::remove_if(cases.begin(), cases.end(), other), cases.end());
    two_planes.erase(std::remove_if(two_planes.begin(), two_planes.end(), other), two_planes.end());
  }
  if (whole_words_only) {
    cases = WholeWordDenseTapCases();
    cases.push_back(whole_word_one);
    two_planes = cases;
  }
  std::vector<KernelPath> engines = {KernelPath::kWgmma, KernelPath::kMmaSync, KernelPath::kSimt};
  if (band_only) {  // the image-band kernel's cases on its engine, wgmma (their residual ones: --residual)
    cases = BandCases();
    two_planes = cases;
    engines = {KernelPath::kWgmma};
  }
  if (planes_only) cases.clear();
  const bool convolutions_only = planes_only || whole_words_only || band_only;
  long failures = 0;
  for (const ImageCase& ic : convolutions_only ? std::vector<ImageCase>{} : ImageCases()) {
    for (bool pixels : {false, true}) failures += RunImageCase(ic, pixels, false) != 0;
    failures += RunImageCase(ic, true, true) != 0;
  }
  if (!convolutions_only) failures += ImageRefusals();
  if (!dense && !convolutions_only) {
    for (const GlobalPoolCase& gc : GlobalPoolCases()) {
      for (bool narrow : {false, true}) failures += RunGlobalPoolCase(gc, narrow) != 0;
    }
    for (const StreamBitsCase& sc : StreamBitsCases()) {
      for (bool narrow : {false, true}) failures += RunStreamBitsCase(sc, narrow) != 0;
    }
    std::vector<ChainCase> chain_cases = ChainCases();
    if (small) chain_cases.resize(5);
    for (const ChainCase& cc : chain_cases) failures += RunChainCase(cc) != 0;
    std::vector<ResidualCase> residual_cases = ResidualCases();
    for (const ResidualCase& rc : RepeatedInputResidualCases()) residual_cases.push_back(rc);
    for (const ResidualCase& rc : residual_cases) {
      for (KernelPath path : {KernelPath::kWgmma, KernelPath::kMmaSync, KernelPath::kSimt}) {
        failures += RunResidualForms(rc, path);
      }
    }
    std::vector<DoubledCase> doubled_cases = small ? SmallDoubledCases() : DoubledCases();
    for (const DoubledCase& dc : doubled_cases) {
      for (KernelPath path : {KernelPath::kWgmma, KernelPath::kMmaSync, KernelPath::kSimt}) {
        failures += RunDoubledForms(dc, path);
      }
    }
  }
  for (const ConvCase& cc : cases) {
    for (Epilogue ep : {Epilogue::kInt32, Epilogue::kInt16, Epilogue::kAffine, Epilogue::kBits}) {
      if (ep == Epilogue::kInt16 && cc.kh * cc.kw * cc.c > jaxbnn::cuda::kMaxInt16Reduction) continue;
      for (KernelPath path : engines) {
        failures += RunCase(cc, ep, path, true) != 0;
      }
    }
  }
  for (const ConvCase& cc : two_planes) {
    for (KernelPath path : engines) {
      failures += RunCase(cc, Epilogue::kBits, path, true, 2) != 0;
    }
  }
  // Operands over 24 MiB: the wgmma engine's grouped raster (other problems take runs of tile pairs),
  // with a narrow last column tile. Large, so only the wgmma engine and the bits epilogue (one and two planes).
  if (!small && !dense && !band_only) {
    for (int planes : {1, 2}) {
      if (planes_only && planes == 1) continue;
      failures += RunCase(Bmm(100000, 264, 2048), Epilogue::kBits, KernelPath::kWgmma, true, planes) != 0;
    }
  }
  std::printf("%s: %ld failing runs\n", failures ? "FAILED" : "ALL OK", failures);
  return failures ? 1 : 0;
}
