// TMA tensor maps of the operands: recipes (everything but the address) and their encoding.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include "cuda/binary_gemm.h"
#include "cuda/device/loaders.cuh"
#include "cuda/device/wgmma_tile.cuh"

namespace jaxbnn::cuda {

// cuTensorMapEncodeTiled from the driver, or null where the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder();

// A tensor map without its address: what cuTensorMapEncodeTiled takes besides the operand's pointer.
struct TensorMapRecipe {
  CUtensorMapDataType data_type = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  cuuint32_t rank = 0;  // 0: no map
  cuuint64_t dims[4] = {};
  cuuint64_t strides[3] = {};  // rank - 1 of them
  cuuint32_t box[4] = {};
  cuuint32_t element_strides[4] = {1, 1, 1, 1};  // every element_strides[i]-th element along dimension i
  CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE;
};

// Encodes the map of `r` at `address` (a zeroed map where r.rank is 0); false where the driver cannot.
bool Encode(const TensorMapRecipe& r, const void* address, CUtensorMap& map);
TensorMapRecipe NhwcBytes(const BinaryGemmProblem& p, int box_bytes, int box_w, int box_h, CUtensorMapSwizzle swizzle,
                          int box_images = 1);
ALayout ActivationLayout(const BinaryGemmProblem& p, TensorMapRecipe& r, int rows = kWgRows);
TensorMapRecipe WeightRecipe(const BinaryGemmProblem& p);
TensorMapRecipe ResidentWeightRecipe(const BinaryGemmProblem& p, int cols);

}  // namespace jaxbnn::cuda
