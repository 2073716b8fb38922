// The per-output-column data of an epilogue (docs/formats.md "Epilogues"), as the CPU kernels take it.
#ifndef JAXBNN_XLA_FFI_CPU_EPILOGUE_H_
#define JAXBNN_XLA_FFI_CPU_EPILOGUE_H_

#include <cstdint>

#include "common/checks.h"

namespace jaxbnn::cpu {

// The residual epilogue's operands (Epilogue::kResidual, unpooled): the output is the stream
// (dot >> shift) + shortcut[b, s oh, s ow, col] (0 for col >= channels), in the shortcut's type (int32, or int16
// where `narrow`; wrapping as that type's arithmetic does), the shortcut (batch, height, width, channels) taken
// every s = stride pixels of output pixels (b, oh, ow) of an out_h x out_w image; with a threshold
// (EpilogueData, `planes` planes) also the stream's packed bits in `bits` (rows, planes, ceil(n/32)).
struct ResidualData {
  const void* shortcut = nullptr;
  bool narrow = false;
  int64_t height = 0, width = 0, channels = 0, stride = 1, shift = 0;
  int64_t out_h = 1, out_w = 1;
  uint32_t* bits = nullptr;
};

// Unused pointers are null. The threshold epilogue writes `planes` planes of bits per output row, plane p
// from threshold / flip row p (each of the output columns); the residual one its stream and, with threshold
// and flip, the stream's bits (`planes` planes likewise).
struct EpilogueData {
  Epilogue kind;
  const float* scale;
  const float* bias;
  const int32_t* threshold;
  const uint8_t* flip;
  int64_t planes = 1;
  ResidualData residual = {};
};

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_EPILOGUE_H_
