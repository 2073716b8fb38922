// The CPU FFI handlers of docs/ops.md ("Native contract").
#ifndef JAXBNN_XLA_FFI_CPU_HANDLERS_H_
#define JAXBNN_XLA_FFI_CPU_HANDLERS_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBmmI32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBmmF32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBmmBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBmmChainF32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBmmChainBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBconv2dI32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBconv2dF32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBconv2dBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBconv2dResidualI32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBconv2dResidualBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBconv2dResidualI16);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuBconv2dResidualI16Bits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuImageConv2dI32);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuImageConv2dBits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuImageConv2dI16);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuImageConv2dI32Bits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuImageConv2dI16Bits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpuGlobalSumBits);

// The ternary and mixed targets jaxbnn_{mode}_{bmm,conv2d}_{epilogue}, as X(mode, Mode, epilogue, Epilogue):
// their handlers are JaxbnnCpu{Mode}Bmm{Epilogue} and JaxbnnCpu{Mode}Conv2d{Epilogue}.
#define JAXBNN_MIXED_TARGETS(X)                                                                  \
  X(tnn, Tnn, i32, I32) X(tnn, Tnn, f32, F32) X(tnn, Tnn, bits, Bits) X(tbn, Tbn, i32, I32)     \
  X(tbn, Tbn, f32, F32) X(tbn, Tbn, bits, Bits) X(btn, Btn, i32, I32) X(btn, Btn, f32, F32)     \
  X(btn, Btn, bits, Bits)

#define JAXBNN_DECLARE_MIXED(mode, Mode, epi, Epi)                \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpu##Mode##Bmm##Epi);      \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpu##Mode##Conv2d##Epi);
JAXBNN_MIXED_TARGETS(JAXBNN_DECLARE_MIXED)
#undef JAXBNN_DECLARE_MIXED

// The residual epilogue of the ternary and mixed convolutions over an int16 stream,
// jaxbnn_{mode}_conv2d_residual_i16 and _i16_bits: JaxbnnCpu{Mode}Conv2dResidualI16 and _I16Bits.
#define JAXBNN_MIXED_RESIDUAL_TARGETS(X) X(tnn, Tnn) X(tbn, Tbn) X(btn, Btn)
#define JAXBNN_DECLARE_MIXED_RESIDUAL(mode, Mode)                \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpu##Mode##Conv2dResidualI16); \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxbnnCpu##Mode##Conv2dResidualI16Bits);
JAXBNN_MIXED_RESIDUAL_TARGETS(JAXBNN_DECLARE_MIXED_RESIDUAL)
#undef JAXBNN_DECLARE_MIXED_RESIDUAL

#endif  // JAXBNN_XLA_FFI_CPU_HANDLERS_H_
