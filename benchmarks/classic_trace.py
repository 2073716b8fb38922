"""A clock64 / %globaltimer trace of the mma.sync / SIMT ClassicKernel's phases, for diagnosis only.

Patches a copy of a kernel version (DIR holding binary_gemm.cu, binary_gemm.h, wgmma_b1.cuh) with stamps by
thread 0 of every CTA (built only with -DJAXBNN_TILE_TRACE) and writes DIR/kernel_check.cu, the tree's harness
plus a printer: after each timed mma.sync case it launches the kernel twice more with the trace on and prints
the mean per CTA of: to the first __syncthreads, the prologue's copies, the wait for the first stage, the k loop,
to the epilogue's __syncthreads, the epilogue; and from %globaltimer the CTA's span, the gap between CTAs on
one SM and the SMs' busy share. --drain adds a stamp once warp 0's accumulators are readable (the tensor
pipe's drain), splitting the epilogue. The stamps are tied to the kernel's text: a version whose text moved
fails an assertion here rather than tracing the wrong place.

    mkdir -p .ab/t && cp xla_ffi/cuda/{binary_gemm.cu,binary_gemm.h,wgmma_b1.cuh} .ab/t
    python3 benchmarks/classic_trace.py .ab/t [--drain]
    nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DJAXBNN_TILE_TRACE -Ixla_ffi -I.ab/t \\
        .ab/t/kernel_check.cu .ab/t/binary_gemm.cu -o kc_trace && ./kc_trace --time-mma "bmm 16384^3"

Used in sessions 29 and 30 (benchmarks/NOTES.md).
"""
import argparse
import pathlib
import re

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("dir", type=pathlib.Path, help="the version's directory (patched in place)")
parser.add_argument("--harness", type=pathlib.Path, default=pathlib.Path("xla_ffi/cuda/kernel_check.cu"))
parser.add_argument("--drain", action="store_true", help="also stamp when warp 0's accumulators are ready")
args = parser.parse_args()
d = args.dir
t = (d / 'binary_gemm.cu').read_text()
t = t.replace('__device__ unsigned long long* g_tile_trace = nullptr;  // SetTileTrace', '')
hdr = '''#ifdef JAXBNN_TILE_TRACE
__device__ unsigned long long* g_tile_trace = nullptr;  // SetTileTrace
#define CT_STAMP(w) do { if (ct_stamping) { unsigned long long ct_now = clock64(); g_tile_trace[blockIdx.x * 16ull + (w)] = ct_now; } } while (0)
#define CT_GT(w) do { if (ct_stamping) { unsigned long long ct_gt; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ct_gt)); g_tile_trace[blockIdx.x * 16ull + (w)] = ct_gt; } } while (0)
#else
#define CT_STAMP(w) static_cast<void>(0)
#define CT_GT(w) static_cast<void>(0)
#endif
'''
anchor = 'template <class Engine, int kVec>\n__global__ void __launch_bounds__(Engine::kThreads, 1) ClassicKernel('
assert anchor in t; t = t.replace(anchor, hdr + anchor)
i = t.index(anchor); j = t.index('// wgmma engine (sm_90a)', i)
k = t[i:j]
def sub(old, new, count=1):
    global k
    assert k.count(old) == count, (old, k.count(old)); k = k.replace(old, new)
sub('  const int tid = threadIdx.x;\n', '''  const int tid = threadIdx.x;
#ifdef JAXBNN_TILE_TRACE
  const bool ct_stamping = tid == 0 && g_tile_trace != nullptr;
  if (ct_stamping) { unsigned ct_sm; asm volatile("mov.u32 %0, %%smid;" : "=r"(ct_sm)); g_tile_trace[blockIdx.x * 16ull + 10] = ct_sm + 1; }
#endif
  CT_GT(8);
  CT_STAMP(0);
''')
# the first __syncthreads: after the column table (sessions 28-29) or, in a version that fills the table
# later, after the row origins
first_sync = '  __syncthreads();\n\n  const uint32_t base'
if first_sync not in k:
    first_sync = "  __syncthreads();  // the row origins and the barriers, for the first stages' copies\n"
sub(first_sync, first_sync.replace('__syncthreads();', '__syncthreads();\n  CT_STAMP(1);', 1))
sub('  typename Engine::Accumulators acc = {};\n', '  CT_STAMP(2);\n  typename Engine::Accumulators acc = {};\n')
sub('    BarrierWait(full0 + 8 * s, (kb / kStages) & 1);  // every thread\'s copies of stage kb landed\n',
    '    BarrierWait(full0 + 8 * s, (kb / kStages) & 1);  // every thread\'s copies of stage kb landed\n    if (kb == 0) CT_STAMP(3);\n')
sub('  row_popc = CombineRowPopcount', '  CT_STAMP(4);\n  row_popc = CombineRowPopcount')
store = re.search(r'Engine::StoreDirect\([^;]*\);', k).group(0)  # its arguments vary between versions
sub('      __syncthreads();\n      ' + store + '\n      return;',
    '      __syncthreads();\n      CT_STAMP(5);\n      DRAIN' + store + '\n      CT_STAMP(6);\n      CT_GT(9);\n      return;')
drain = ('{ int ct_x = 0;\n#pragma unroll\n for (int ct_m = 0; ct_m < 4; ++ct_m)\n#pragma unroll\n for (int ct_n = 0; ct_n < Engine::kFrags; ++ct_n)\n#pragma unroll\n for (int ct_i = 0; ct_i < 4; ++ct_i) ct_x ^= acc.v[ct_m][ct_n][ct_i];\n'
         '        if (ct_x == 0x7fffffff) CT_STAMP(11);\n        CT_STAMP(7); }\n      ') if args.drain else ''
k = k.replace('DRAIN', drain)
t = t[:i] + k + t[j:]
(d / 'binary_gemm.cu').write_text(t)

kc = args.harness.read_text()
printer = r'''
#ifdef JAXBNN_TILE_TRACE
// ClassicKernel's phases per CTA (thread 0's clock64 stamps; 16 words per CTA: 0 start, 1 after the first
// __syncthreads, 2 ready for the k loop, 3 first stage full, 4 k loop done, 5 epilogue's __syncthreads passed,
// 6 end; 8/9 %globaltimer at start/end, 10 SM + 1).
void PrintClassicTrace(const BinaryGemmProblem& p, KernelPath path) {
  const size_t ctas = static_cast<size_t>((p.pooled_rows + 63) / 64) * ((p.n + 63) / 64), words = ctas * 16;
  double us = 0;
  const std::vector<unsigned long long> t = RecordTileTrace(p, path, words, 2, us);
  double seg[6] = {}, dur = 0, drain = 0, after_drain = 0; int n = 0, drained = 0;
  std::vector<std::vector<std::pair<unsigned long long, unsigned long long>>> per_sm(256);
  unsigned long long lo = ~0ull, hi = 0;
  for (size_t c = 0; c < ctas; ++c) {
    const unsigned long long* e = &t[c * 16];
    if (e[10] == 0 || e[6] == 0) continue;
    ++n;
    for (int s = 0; s < 6; ++s) seg[s] += (e[s + 1] - e[s]) * us;
    if (e[7]) { drain += (e[7] - e[5]) * us; after_drain += (e[6] - e[7]) * us; ++drained; }
    dur += (e[9] - e[8]) * 1e-3;
    per_sm[e[10] - 1].push_back({e[8], e[9]});
    lo = std::min(lo, e[8]); hi = std::max(hi, e[9]);
  }
  if (n == 0) { std::printf("ctrace: no CTA recorded\n"); return; }
  if (drained) std::printf("ctrace: epilogue split (%d CTAs): accumulators ready %.2f us after the epilogue's sync, then %.2f us to the end\n", drained, drain / drained, after_drain / drained);
  double gap = 0; int gaps = 0, sms = 0; double busy = 0;
  for (auto& v : per_sm) {
    if (v.empty()) continue;
    ++sms;
    std::sort(v.begin(), v.end());
    for (size_t i = 0; i < v.size(); ++i) {
      busy += (v[i].second - v[i].first) * 1e-3;
      if (i) { gap += (static_cast<double>(v[i].first) - static_cast<double>(v[i - 1].second)) * 1e-3; ++gaps; }
    }
  }
  const double span = (hi - lo) * 1e-3;
  std::printf("ctrace: %d CTAs on %d SMs, %.1f per SM; us per CTA (clock64 at %d MHz): to sync %.2f, prologue %.2f, "
              "first stage %.2f, k loop %.2f, to epilogue sync %.2f, epilogue %.2f; globaltimer: CTA %.2f us, "
              "gap between CTAs on an SM %.2f us, span %.1f us, SMs busy %.1f%%\n",
              n, sms, double(n) / sms, static_cast<int>(1e3 / us + 0.5), seg[0] / n, seg[1] / n, seg[2] / n, seg[3] / n, seg[4] / n,
              seg[5] / n, dur / n, gaps ? gap / gaps : 0.0, span, 100.0 * busy / (span * sms));
}
#endif
'''
anchor2 = '// Times the packed-in -> packed-out'
assert anchor2 in kc
kc = kc.replace(anchor2, printer + '\n' + anchor2)
old = '  if (ran == KernelPath::kWgmma) PrintTileTrace(p, path);\n'
assert old in kc
kc = kc.replace(old, old + '  if (ran == KernelPath::kMmaSync) PrintClassicTrace(p, path);\n')
(d / 'kernel_check.cu').write_text(kc)
