// The CUDA FFI handler symbols (docs/ops.md) and the kernel-path switch used by tests and benchmarks.
#ifndef JAXBNN_XLA_FFI_CUDA_HANDLERS_H_
#define JAXBNN_XLA_FFI_CUDA_HANDLERS_H_

#include <cstdint>

#include "binary_gemm.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBmmI32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBmmI16);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBmmF32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBmmBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBmmChainF32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBmmChainBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBmmDoubledI32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBmmDoubledF32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBmmDoubledBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBConvDoubledI32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBConvDoubledF32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBConvDoubledBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBConvI32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBConvI16);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBConvF32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBConvBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBConvResidualI32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBConvResidualBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBConvResidualI16);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaBConvResidualI16Bits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaImageConvI32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaImageConvBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaImageConvI16);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaImageConvI32Bits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaImageConvI16Bits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaGlobalSumBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCudaStreamBits);

namespace jaxbnn::cuda {

// Makes later calls run `path` where it can run the problem (kAuto restores the default choice).
void SetForcedKernelPath(KernelPath path);
// The kernel the latest launch ran.
KernelPath LastKernelPath();
// How often the handlers ran and the host time they took, since the module was loaded: where XLA replays a
// captured command buffer (CUDA graph), a call runs the recorded kernel without its handler.
struct HandlerStats {
  uint64_t calls = 0, host_nanoseconds = 0;
};
HandlerStats GetHandlerStats();

}  // namespace jaxbnn::cuda

#endif  // JAXBNN_XLA_FFI_CUDA_HANDLERS_H_
