// Planning a launch: which kernel runs a problem, its grid, shared memory, parameters and tensor maps.
#pragma once

#include <cuda.h>

#include "cuda/binary_gemm.h"
#include "cuda/device/common.cuh"
#include "cuda/host/tensor_maps.h"
#include "cuda/kernels/wgmma_band.h"

namespace jaxbnn::cuda {

struct DeviceInfo {
  int major = 0, minor = 0, sms = 0, smem_optin = 0;  // smem_optin: bytes of shared memory a block may take
  int smem_per_sm = 0, smem_reserved = 0;              // an SM's shared memory, and what each block costs it extra
};

// A launch of one problem: the kernel, its grid, and the values of its parameters. The kernels take some of
// these in the order `kind` names (Launch lists them).
struct LaunchPlan {
  enum class Kind { kClassic, kPersistent, kResident, kBand, kDenseTaps } kind = Kind::kClassic;
  const void* kernel = nullptr;
  KernelPath path = KernelPath::kSimt;  // the engine that runs
  unsigned ctas = 0, threads = 0;
  int smem = 0;
  int cluster = 1;
  bool programmatic = false;  // a programmatic dependent launch (the wgmma kernels)
  BinaryGemmProblem p;
  ResidualOperands residual;  // the last parameter of the kernels with a residual instance (all but kPersistent)
  LaunchDivisors div;
  TensorMapRecipe a_recipe, w_recipe;  // a: the activations (p.x), w: the weights (p.w)
  CUtensorMap a_map, w_map;
  BandLayout band;
  int m_tiles = 0, n_tiles = 0, m_pairs = 0, ctas_per_column = 0;
  bool weights_by_tma = false, runs = false;
};

// The fields the launcher derives from the shape (max_excess, pad_one where no field leaves the frame, the
// tables).
void DeriveFromShape(BinaryGemmProblem& p);
// Points the plan at the operands of `p` (same shape); false where a map cannot be made for a new address.
bool Repoint(LaunchPlan& plan, const BinaryGemmProblem& p);
// The plan for `p` on `path` (kAuto: the default choice; a forced engine that cannot run `p` falls back).
LaunchPlan Plan(BinaryGemmProblem p, KernelPath path, const DeviceInfo& info);

}  // namespace jaxbnn::cuda
