// The per-output-column data of an epilogue (docs/formats.md "Epilogues"), as the CPU kernels take it.
#ifndef JAXBNN_XLA_FFI_CPU_EPILOGUE_H_
#define JAXBNN_XLA_FFI_CPU_EPILOGUE_H_

#include <cstdint>

#include "common/checks.h"

namespace jaxbnn::cpu {

// Unused pointers are null. The threshold epilogue writes `planes` planes of bits per output row, plane p
// from threshold / flip row p (each of the output columns).
struct EpilogueData {
  Epilogue kind;
  const float* scale;
  const float* bias;
  const int32_t* threshold;
  const uint8_t* flip;
  int64_t planes = 1;
};

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_EPILOGUE_H_
