// The persistent wgmma kernel (WgmmaKernel): its instances, for the planner.
#pragma once

#include "cuda/device/loaders.cuh"

namespace jaxbnn::cuda {

// WgmmaKernel<layout, 4>, or for one short K block by cp.async (layout kCoreMatrices) <kCoreMatrices, steps>.
const void* PersistentWgmmaKernelInstance(ALayout layout, int steps);

}  // namespace jaxbnn::cuda
