// The launcher: a cached plan per problem shape, launched with its cluster and programmatic-launch attributes.
#include "cuda/binary_gemm.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <vector>

#include "cuda/host/plan.h"
#include "cuda/stream_bits.h"

namespace jaxbnn::cuda {

cudaError_t QueryDevice(int device, DeviceInfo& info) {
  cudaError_t err;
  if ((err = cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) {
    return err;
  }
  if ((err = cudaDeviceGetAttribute(&info.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&info.smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, device)) != cudaSuccess) {
    return err;
  }
  return cudaDeviceGetAttribute(&info.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
}

// Raises a kernel's dynamic shared-memory limit to `smem` once per device and kernel (cudaFuncSetAttribute
// on every launch was part of the launcher's host time); the limit only grows, so every cached plan of the
// kernel stays within it.
cudaError_t AllowSharedMemory(int device, const void* kernel, int smem) {
  struct Allowed {
    int device;
    const void* kernel;
    int smem;
  };
  static std::mutex mutex;
  static std::vector<Allowed> allowed;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = std::find_if(allowed.begin(), allowed.end(),
                         [&](const Allowed& a) { return a.device == device && a.kernel == kernel; });
  if (it != allowed.end() && it->smem >= smem) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  if (it != allowed.end()) {
    it->smem = smem;
  } else {
    allowed.push_back({device, kernel, smem});
  }
  return cudaSuccess;
}

cudaError_t Launch(LaunchPlan& plan, cudaStream_t stream) {
  if (plan.ctas == 0) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(plan.ctas);
  config.blockDim = dim3(plan.threads);
  config.dynamicSmemBytes = plan.smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  config.attrs = attrs;
  if (plan.cluster > 1) {
    attrs[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attrs[config.numAttrs].val.clusterDim.x = plan.cluster;
    attrs[config.numAttrs].val.clusterDim.y = 1;
    attrs[config.numAttrs].val.clusterDim.z = 1;
    ++config.numAttrs;
  }
  // a programmatic dependent launch: it may start while the stream's previous kernel finishes (its
  // `griddepcontrol.wait` keeps its global accesses after that kernel's), and the next kernel may start at
  // its `griddepcontrol.launch_dependents`
  if (plan.programmatic) {
    attrs[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[config.numAttrs].val.programmaticStreamSerializationAllowed = 1;
    ++config.numAttrs;
  }
  // the kernels' parameters, in their order
  void* classic[] = {&plan.p, &plan.div, &plan.m_tiles, &plan.n_tiles, &plan.residual};
  void* persistent[] = {&plan.p, &plan.a_map, &plan.w_map, &plan.weights_by_tma, &plan.div,
                        &plan.m_pairs, &plan.n_tiles, &plan.runs, &plan.residual};
  void* resident[] = {&plan.p, &plan.a_map, &plan.w_map, &plan.div, &plan.m_tiles, &plan.ctas_per_column,
                      &plan.residual};
  void* band[] = {&plan.p, &plan.a_map, &plan.band, &plan.residual};
  void* dense_taps[] = {&plan.p, &plan.div, &plan.m_tiles, &plan.ctas_per_column, &plan.residual};
  void** args = plan.kind == LaunchPlan::Kind::kClassic      ? classic
                : plan.kind == LaunchPlan::Kind::kPersistent ? persistent
                : plan.kind == LaunchPlan::Kind::kResident   ? resident
                : plan.kind == LaunchPlan::Kind::kDenseTaps  ? dense_taps
                                                             : band;
  const cudaError_t err = cudaLaunchKernelExC(&config, plan.kernel, args);
  return err == cudaSuccess ? cudaGetLastError() : err;
}

// The plans of the latest problem shapes, most recent first. The key is everything a plan depends on: the
// device, the engine asked for, the problem without its addresses, and the operands' alignment (it picks
// kernels).
class PlanCache {
 public:
  // The plan for `p`, pointed at its operands: from the cache, else planned (and cached).
  LaunchPlan Get(const BinaryGemmProblem& p, KernelPath path, int device, const DeviceInfo& info) {
    const Key key = KeyOf(p, path, device);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 0; i < entries_.size(); ++i) {
        if (entries_[i].key != key) continue;
        LaunchPlan plan = entries_[i].plan;
        if (!Repoint(plan, p)) {  // a map the new address does not take: plan afresh
          entries_.erase(entries_.begin() + i);
          break;
        }
        entries_[i].plan = plan;       // keeps the maps of the latest addresses (replays with the same buffers)
        std::rotate(entries_.begin(), entries_.begin() + i, entries_.begin() + i + 1);
        return plan;
      }
    }
    LaunchPlan plan = Plan(p, path, info);
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.insert(entries_.begin(), Entry{key, plan});
    if (entries_.size() > kEntries) entries_.pop_back();
    return plan;
  }

 private:
  static constexpr size_t kEntries = 64;
  using Key = std::array<int64_t, 29>;
  struct Entry {
    Key key;
    LaunchPlan plan;
  };
  // (max_excess, compact_classes, class_numbering and the tables' flags are Plan's, derived from the key's fields;
  // no plan depends on the threshold planes, which only the epilogue reads)
  static_assert(sizeof(BinaryGemmProblem) == 224, "a field was added to BinaryGemmProblem: add it to KeyOf");
  static Key KeyOf(const BinaryGemmProblem& p, KernelPath path, int device) {
    const auto x = reinterpret_cast<uintptr_t>(p.x), w = reinterpret_cast<uintptr_t>(p.w);
    return {device, static_cast<int>(path), static_cast<int64_t>(x % 16), static_cast<int64_t>(w % 16),
            p.batch, p.in_h, p.in_w, p.cw, p.x_cw, p.c, p.kh, p.kw, p.stride_h, p.stride_w, p.pad_top, p.pad_left,
            p.pad_one, p.pool_h, p.pool_w, p.out_h, p.out_w, p.n, p.w_row_tiles, p.w_k_tiles, p.k_words,
            p.k_real, p.pooled_rows, static_cast<int>(p.epilogue), p.doubled_k_blocks};
  }
  std::mutex mutex_;
  std::vector<Entry> entries_;
};

// Whether the plan's kernel writes a residual stream's bits of more than one threshold plane: the wgmma kernels'
// staged epilogue of the int16 stream (StoreStagedResidualRows).
bool WritesStreamPlanes(const LaunchPlan& plan) {
  return plan.p.epilogue == Epilogue::kResidualInt16 &&
         (plan.kind == LaunchPlan::Kind::kBand || plan.kind == LaunchPlan::Kind::kResident ||
          plan.kind == LaunchPlan::Kind::kPersistent);
}

cudaError_t LaunchBinaryGemm(const BinaryGemmProblem& problem, KernelPath path, cudaStream_t stream,
                             KernelPath* chosen, const ResidualOperands& residual) {
  // every kernel needs a K block: the wgmma consumers fill the column parameters inside their k loop
  if (problem.k_words < 1 || problem.k_words > kMaxReductionWords) return cudaErrorInvalidValue;
  // a pixel's stored words, read once or twice per tap (then whole words: no padding bits between the readings)
  if (problem.x_cw != problem.cw &&
      (problem.x_cw < 1 || problem.x_cw * 2 != problem.cw || problem.c != 32 * problem.cw)) {
    return cudaErrorInvalidValue;
  }
  if (problem.planes < 1 || problem.planes > kMaxBitsPlanes ||
      (problem.planes > 1 && problem.epilogue != Epilogue::kBits)) {
    return cudaErrorInvalidValue;
  }
  // stream planes: a residual epilogue's bits against a threshold of each
  if (residual.planes < 1 || residual.planes > kMaxBitsPlanes ||
      (residual.planes > 1 && (!IsResidual(problem.epilogue) || residual.bits == nullptr ||
                               problem.threshold == nullptr || problem.flip == nullptr))) {
    return cudaErrorInvalidValue;
  }
  // doubled K blocks: not residual, pixels read once, at least one K block after them; a BMM's unpooled, a
  // convolution's "zero" padded, every tap's doubled words a multiple of 32, the rest of 16 (DoubledTapWords)
  if (problem.doubled_k_blocks != 0) {
    const int taps = problem.kh * problem.kw;
    const bool bmm = taps == 1 && problem.in_h == 1 && problem.in_w == 1 && problem.pool_h * problem.pool_w == 1;
    const int doubled = problem.doubled_k_blocks * kKBlockWords / taps, rest = problem.cw - doubled;
    const bool conv = problem.doubled_k_blocks * kKBlockWords % taps == 0 && doubled % 32 == 0 && rest > 0 &&
                      rest % 16 == 0 && !problem.pad_one;
    if (problem.doubled_k_blocks < 0 ||
        problem.doubled_k_blocks >= (problem.k_words + kKBlockWords - 1) / kKBlockWords || !(bmm || conv) ||
        problem.x_cw != problem.cw || IsResidual(problem.epilogue)) {
      return cudaErrorInvalidValue;
    }
  }
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static DeviceInfo infos[64];
  static cudaError_t query_errors[64];
  static std::once_flag queried[64];
  if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
  std::call_once(queried[device], [&] { query_errors[device] = QueryDevice(device, infos[device]); });
  if ((err = query_errors[device]) != cudaSuccess) return err;
  static PlanCache cache;
  LaunchPlan plan = cache.Get(problem, path, device, infos[device]);
  plan.residual = residual;  // operands only: no plan depends on them
  if (chosen != nullptr) *chosen = plan.path;
  if ((err = AllowSharedMemory(device, plan.kernel, plan.smem)) != cudaSuccess) return err;
  if (residual.planes == 1 || WritesStreamPlanes(plan)) return Launch(plan, stream);
  // the stream first, then its planes by a pass of their own
  plan.residual.bits = nullptr;
  if ((err = Launch(plan, stream)) != cudaSuccess) return err;
  StreamBitsProblem bits;
  bits.stream = problem.out;
  bits.threshold = problem.threshold;
  bits.flip = problem.flip;
  bits.out_bits = residual.bits;
  bits.rows = problem.pooled_rows;
  bits.channels = problem.n;
  bits.planes = residual.planes;
  bits.narrow = problem.epilogue == Epilogue::kResidualInt16;
  return LaunchStreamBits(bits, stream);
}

}  // namespace jaxbnn::cuda
