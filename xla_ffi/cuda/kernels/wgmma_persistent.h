// The persistent wgmma kernel (WgmmaKernel): its instances, for the planner.
#pragma once

#include "cuda/device/loaders.cuh"

namespace jaxbnn::cuda {

// WgmmaKernel<layout, 4>, or for one short K block by cp.async (layout kCoreMatrices) <kCoreMatrices, steps>;
// residual: the instance with the int16 stream's residual epilogue (4 steps, any K), which the others do not run;
// doubled: the one that doubles its accumulators after BinaryGemmProblem::doubled_k_blocks K blocks (4 steps).
const void* PersistentWgmmaKernelInstance(ALayout layout, int steps, bool residual, bool doubled);

}  // namespace jaxbnn::cuda
