// jaxbnn._cuda: the CUDA FFI targets as PyCapsules for jax.ffi.register_ffi_target(platform="CUDA"), and the
// kernel-path switch that lets tests and benchmarks run each engine (wgmma, mma.sync, CUDA cores).
#include <stdexcept>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "handlers.h"

namespace nb = nanobind;

namespace {

template <class Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

constexpr const char* kPathNames[] = {"auto", "wgmma", "mma_sync", "simt"};

}  // namespace

NB_MODULE(_cuda, m) {
  m.doc() = "jaxbnn CUDA kernels (XLA FFI targets)";
  m.def("registrations", [] {
    nb::dict d;
    d["jaxbnn_bmm_i32"] = Capsule(JaxbnnCudaBmmI32);
    d["jaxbnn_bmm_i16"] = Capsule(JaxbnnCudaBmmI16);
    d["jaxbnn_bmm_f32"] = Capsule(JaxbnnCudaBmmF32);
    d["jaxbnn_bmm_bits"] = Capsule(JaxbnnCudaBmmBits);
    d["jaxbnn_bmm_chain_f32"] = Capsule(JaxbnnCudaBmmChainF32);
    d["jaxbnn_bmm_chain_bits"] = Capsule(JaxbnnCudaBmmChainBits);
    d["jaxbnn_bmm_doubled_i32"] = Capsule(JaxbnnCudaBmmDoubledI32);
    d["jaxbnn_bmm_doubled_f32"] = Capsule(JaxbnnCudaBmmDoubledF32);
    d["jaxbnn_bmm_doubled_bits"] = Capsule(JaxbnnCudaBmmDoubledBits);
    d["jaxbnn_bconv2d_doubled_i32"] = Capsule(JaxbnnCudaBConvDoubledI32);
    d["jaxbnn_bconv2d_doubled_f32"] = Capsule(JaxbnnCudaBConvDoubledF32);
    d["jaxbnn_bconv2d_doubled_bits"] = Capsule(JaxbnnCudaBConvDoubledBits);
    d["jaxbnn_bconv2d_i32"] = Capsule(JaxbnnCudaBConvI32);
    d["jaxbnn_bconv2d_i16"] = Capsule(JaxbnnCudaBConvI16);
    d["jaxbnn_bconv2d_f32"] = Capsule(JaxbnnCudaBConvF32);
    d["jaxbnn_bconv2d_bits"] = Capsule(JaxbnnCudaBConvBits);
    d["jaxbnn_bconv2d_residual_i32"] = Capsule(JaxbnnCudaBConvResidualI32);
    d["jaxbnn_bconv2d_residual_bits"] = Capsule(JaxbnnCudaBConvResidualBits);
    d["jaxbnn_bconv2d_residual_i16"] = Capsule(JaxbnnCudaBConvResidualI16);
    d["jaxbnn_bconv2d_residual_i16_bits"] = Capsule(JaxbnnCudaBConvResidualI16Bits);
    d["jaxbnn_image_conv2d_i32"] = Capsule(JaxbnnCudaImageConvI32);
    d["jaxbnn_image_conv2d_bits"] = Capsule(JaxbnnCudaImageConvBits);
    d["jaxbnn_image_conv2d_i16"] = Capsule(JaxbnnCudaImageConvI16);
    d["jaxbnn_image_conv2d_i32_bits"] = Capsule(JaxbnnCudaImageConvI32Bits);
    d["jaxbnn_image_conv2d_i16_bits"] = Capsule(JaxbnnCudaImageConvI16Bits);
    d["jaxbnn_global_sum_bits"] = Capsule(JaxbnnCudaGlobalSumBits);
    d["jaxbnn_stream_bits"] = Capsule(JaxbnnCudaStreamBits);
    return d;
  });
  m.def(
      "set_kernel_path",
      [](const std::string& name) {
        for (int i = 0; i < 4; ++i) {
          if (name == kPathNames[i]) {
            jaxbnn::cuda::SetForcedKernelPath(static_cast<jaxbnn::cuda::KernelPath>(i));
            return;
          }
        }
        throw std::invalid_argument("kernel path must be one of auto, wgmma, mma_sync, simt; got " + name);
      },
      nb::arg("name"),
      "Run later calls on one engine ('wgmma', 'mma_sync', 'simt') where it can run the problem; 'auto' "
      "restores the default choice.");
  m.def(
      "last_kernel_path", [] { return std::string(kPathNames[static_cast<int>(jaxbnn::cuda::LastKernelPath())]); },
      "The engine of the latest launch.");
  m.def(
      "handler_stats",
      [] {
        const jaxbnn::cuda::HandlerStats stats = jaxbnn::cuda::GetHandlerStats();
        nb::dict d;
        d["calls"] = stats.calls;
        d["host_seconds"] = static_cast<double>(stats.host_nanoseconds) * 1e-9;
        return d;
      },
      "How often the CUDA handlers ran since the module was loaded, and their host time in seconds (a call "
      "that XLA replays from a captured command buffer runs no handler).");
}
