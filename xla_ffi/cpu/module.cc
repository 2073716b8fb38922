// jaxbnn._cpu: the CPU FFI handlers as capsules for jax.ffi.register_ffi_target (see jaxbnn/_ffi.py), the
// native format constants (checked against jaxbnn.formats by the tests) and the kernel ISA tier.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "common/formats.h"
#include "cpu/handlers.h"
#include "cpu/image_kernels.h"
#include "cpu/popcount_kernels.h"

namespace nb = nanobind;

namespace {

template <class Handler>
nb::capsule HandlerCapsule(Handler* handler) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

nb::dict Registrations() {
  nb::dict targets;
  targets["jaxbnn_bmm_i32"] = HandlerCapsule(JaxbnnCpuBmmI32);
  targets["jaxbnn_bmm_f32"] = HandlerCapsule(JaxbnnCpuBmmF32);
  targets["jaxbnn_bmm_bits"] = HandlerCapsule(JaxbnnCpuBmmBits);
  targets["jaxbnn_bmm_chain_f32"] = HandlerCapsule(JaxbnnCpuBmmChainF32);
  targets["jaxbnn_bmm_chain_bits"] = HandlerCapsule(JaxbnnCpuBmmChainBits);
  targets["jaxbnn_bconv2d_i32"] = HandlerCapsule(JaxbnnCpuBconv2dI32);
  targets["jaxbnn_bconv2d_f32"] = HandlerCapsule(JaxbnnCpuBconv2dF32);
  targets["jaxbnn_bconv2d_bits"] = HandlerCapsule(JaxbnnCpuBconv2dBits);
  targets["jaxbnn_bconv2d_residual_i32"] = HandlerCapsule(JaxbnnCpuBconv2dResidualI32);
  targets["jaxbnn_bconv2d_residual_bits"] = HandlerCapsule(JaxbnnCpuBconv2dResidualBits);
  targets["jaxbnn_bconv2d_residual_i16"] = HandlerCapsule(JaxbnnCpuBconv2dResidualI16);
  targets["jaxbnn_bconv2d_residual_i16_bits"] = HandlerCapsule(JaxbnnCpuBconv2dResidualI16Bits);
  targets["jaxbnn_image_conv2d_i32"] = HandlerCapsule(JaxbnnCpuImageConv2dI32);
  targets["jaxbnn_image_conv2d_bits"] = HandlerCapsule(JaxbnnCpuImageConv2dBits);
  targets["jaxbnn_image_conv2d_i16"] = HandlerCapsule(JaxbnnCpuImageConv2dI16);
  targets["jaxbnn_image_conv2d_i32_bits"] = HandlerCapsule(JaxbnnCpuImageConv2dI32Bits);
  targets["jaxbnn_image_conv2d_i16_bits"] = HandlerCapsule(JaxbnnCpuImageConv2dI16Bits);
  targets["jaxbnn_global_sum_bits"] = HandlerCapsule(JaxbnnCpuGlobalSumBits);
#define JAXBNN_REGISTER_MIXED(mode, Mode, epi, Epi)                                      \
  targets["jaxbnn_" #mode "_bmm_" #epi] = HandlerCapsule(JaxbnnCpu##Mode##Bmm##Epi);     \
  targets["jaxbnn_" #mode "_conv2d_" #epi] = HandlerCapsule(JaxbnnCpu##Mode##Conv2d##Epi);
  JAXBNN_MIXED_TARGETS(JAXBNN_REGISTER_MIXED)
#undef JAXBNN_REGISTER_MIXED
#define JAXBNN_REGISTER_MIXED_RESIDUAL(mode, Mode)                                                          \
  targets["jaxbnn_" #mode "_conv2d_residual_i16"] = HandlerCapsule(JaxbnnCpu##Mode##Conv2dResidualI16);     \
  targets["jaxbnn_" #mode "_conv2d_residual_i16_bits"] = HandlerCapsule(JaxbnnCpu##Mode##Conv2dResidualI16Bits);
  JAXBNN_MIXED_RESIDUAL_TARGETS(JAXBNN_REGISTER_MIXED_RESIDUAL)
#undef JAXBNN_REGISTER_MIXED_RESIDUAL
  return targets;
}

nb::dict FormatConstants() {
  namespace f = jaxbnn::formats;
  nb::dict constants;
  constants["word_bits"] = f::kWordBits;
  constants["lsb_first"] = f::kLsbFirst;
  constants["bit_plus_one"] = f::kBitPlusOne;
  constants["bit_minus_one"] = f::kBitMinusOne;
  constants["fsb_tile"] = nb::make_tuple(f::kFsbTileRows, f::kFsbTileBits);
  nb::dict sign, nonzero, nonneg, pos;
  const int values[3] = {1, 0, -1};
  for (int i = 0; i < 3; ++i) {
    sign[nb::int_(values[i])] = f::kTernarySignBit[i];
    nonzero[nb::int_(values[i])] = f::kTernaryNonzeroBit[i];
    nonneg[nb::int_(values[i])] = f::kTernaryNonnegBit[i];
    pos[nb::int_(values[i])] = f::kTernaryPosBit[i];
  }
  constants["ternary_sign_bit"] = sign;
  constants["ternary_nonzero_bit"] = nonzero;
  constants["ternary_nonneg_bit"] = nonneg;
  constants["ternary_pos_bit"] = pos;
  return constants;
}

std::vector<std::string> SupportedIsaNames() {
  std::vector<std::string> names;
  for (auto isa : jaxbnn::cpu::SupportedIsas()) names.emplace_back(jaxbnn::cpu::IsaName(isa));
  return names;
}

}  // namespace

NB_MODULE(_cpu, m) {
  m.doc() = "jaxbnn CPU kernels: XLA FFI handlers for bit-packed bmm and bconv2d (binary, ternary, mixed) and the int8 first layer";
  m.def("registrations", &Registrations,
        "Dict of FFI target name -> PyCapsule of its XLA FFI handler (platform 'cpu').");
  m.def("format_constants", &FormatConstants, "The native mirror of the jaxbnn.formats constants.");
  m.def("supported_isas", &SupportedIsaNames, "Kernel instruction-set tiers this CPU runs, best first.");
  m.def("active_isa", [] { return std::string(jaxbnn::cpu::IsaName(jaxbnn::cpu::ActiveIsa())); },
        "The tier the kernels use now.");
  m.def(
      "set_isa",
      [](const std::string& name) {
        if (!jaxbnn::cpu::ForceIsa(name)) {
          throw nb::value_error(("unsupported kernel ISA tier '" + name + "'; this CPU supports: " +
                                 nb::str(nb::cast(SupportedIsaNames())).c_str())
                                    .c_str());
        }
      },
      nb::arg("name"), "Forces a kernel tier (for tests that compare tiers); see supported_isas().");
  m.def("amx_usable", &jaxbnn::cpu::AmxUsable,
        "Whether this CPU has AMX-INT8 and the OS grants the process its tile state.");
  m.def("first_layer_amx", &jaxbnn::cpu::FirstLayerUsesAmx,
        "Whether the avx512_vpopcntdq tier runs the first layer (image_conv2d / image_matmul) on AMX-INT8 tiles "
        "where a call has enough rows.");
  m.def(
      "set_first_layer_amx",
      [](bool enabled) {
        if (!jaxbnn::cpu::SetFirstLayerAmx(enabled)) {
          throw nb::value_error("this CPU has no AMX-INT8, or the OS does not grant the process its tile state");
        }
      },
      nb::arg("enabled"), "Turns the first layer's AMX-INT8 tiles on or off (for tests that compare tiers).");
}
