// TMA tensor maps of the operands.
#include "cuda/host/tensor_maps.h"

#include <cstring>

namespace jaxbnn::cuda {

// cuTensorMapEncodeTiled from the driver, through the runtime (no link-time dependency on libcuda);
// null if the driver lacks it, and then the activations go by cp.async.
PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  return encode;
}

bool Encode(const TensorMapRecipe& r, const void* address, CUtensorMap& map) {
  std::memset(&map, 0, sizeof(map));
  if (r.rank == 0) return true;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  return encode != nullptr &&
         encode(&map, r.data_type, r.rank, const_cast<void*>(address), r.dims, r.strides, r.box,
                r.element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, r.swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The activations as a 4-D tensor of NHWC bytes, (channel bytes, W, H, images), in boxes of box_bytes of the
// channels of box_w x box_h output pixels' taps in each of box_images images: every stride-th input pixel along
// W and H (the TMA unit's element strides), so that a box holds the tap's pixels of those output pixels in their
// order; coordinates outside the image (padding) or past the batch arrive as zeros.
TensorMapRecipe NhwcBytes(const BinaryGemmProblem& p, int box_bytes, int box_w, int box_h, CUtensorMapSwizzle swizzle,
                          int box_images) {
  const cuuint64_t pixel_bytes = static_cast<cuuint64_t>(p.x_cw) * 4;  // as stored
  TensorMapRecipe r;
  r.rank = 4;
  r.dims[0] = pixel_bytes;
  r.dims[1] = static_cast<cuuint64_t>(p.in_w);
  r.dims[2] = static_cast<cuuint64_t>(p.in_h);
  r.dims[3] = static_cast<cuuint64_t>(p.batch);
  r.strides[0] = pixel_bytes;
  r.strides[1] = pixel_bytes * p.in_w;
  r.strides[2] = pixel_bytes * p.in_w * p.in_h;
  // a strided box side spans stride x its elements (the TMA unit loads ceil(box / stride) of them)
  r.box[0] = static_cast<cuuint32_t>(box_bytes);
  r.box[1] = static_cast<cuuint32_t>(box_w * p.stride_w);
  r.box[2] = static_cast<cuuint32_t>(box_h * p.stride_h);
  r.box[3] = static_cast<cuuint32_t>(box_images);
  r.element_strides[1] = static_cast<cuuint32_t>(p.stride_w);
  r.element_strides[2] = static_cast<cuuint32_t>(p.stride_h);
  r.swizzle = swizzle;
  return r;
}

// How the wgmma kernel takes the activations of `p`, with the recipe of the TMA tensor map it needs:
//   rows of a plain matrix (bmm, 1x1 stride-1 unpadded convolutions, pixels read once): bytes x rows,
//   128 x 128 boxes, 128B swizzle (kSwizzledRows);
//   convolutions (any stride up to the TMA unit's 8) whose tiles of `rows` output pixels are whole output rows
//   of one image (rows % out_w == 0, tiles inside an image), runs of one row (out_w % rows == 0) or whole
//   images (rows % (out_h out_w) == 0: the 4 x 4 and 8 x 8 images of the small networks' last stages): NHWC
//   bytes, every stride-th pixel, out-of-frame taps zero-filled by the TMA unit; one (W bytes, pixels) box per
//   W bytes of K with the W-byte swizzle where a tap's channel bytes are 32, 64 or a multiple of 128
//   (kTapRows), else one (16 bytes, pixels) box per 16-byte chunk (kChunkSlabs);
//   anything else: cp.async (kCoreMatrices: no map; WgmmaKernel copies into kSwizzledRows).
// `rows`: the rows of a box (128: WgmmaKernel's tiles; 64: ResidentWgmmaKernel's halves).
ALayout ActivationLayout(const BinaryGemmProblem& p, TensorMapRecipe& r, int rows) {
  r = TensorMapRecipe{};
  // the boxes take 16 bytes (4 words) of a stored pixel at least
  if (p.pool_h * p.pool_w != 1 || p.x_cw % 4 != 0) return ALayout::kCoreMatrices;
  const cuuint64_t row_bytes = static_cast<cuuint64_t>(p.cw) * 4;
  if (p.x_cw == p.cw && p.kh == 1 && p.kw == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_top == 0 &&
      p.pad_left == 0 && p.out_h == p.in_h && p.out_w == p.in_w) {
    r.rank = 2;
    r.dims[0] = row_bytes;
    r.dims[1] = static_cast<cuuint64_t>(p.pooled_rows);
    r.strides[0] = row_bytes;
    r.box[0] = 128;
    r.box[1] = static_cast<cuuint32_t>(rows);
    r.swizzle = CU_TENSOR_MAP_SWIZZLE_128B;
    return ALayout::kSwizzledRows;
  }
  const long long image_pixels = static_cast<long long>(p.out_h) * p.out_w;
  int box_w = rows, box_h = 1, box_images = 1;
  if (p.out_w >= rows) {
    if (p.out_w % rows != 0) return ALayout::kCoreMatrices;
  } else if (rows % p.out_w == 0 && p.out_h % (rows / p.out_w) == 0) {
    box_w = p.out_w;
    box_h = rows / p.out_w;
  } else if (rows % image_pixels == 0) {
    box_w = p.out_w;
    box_h = p.out_h;
    box_images = static_cast<int>(rows / image_pixels);
  } else {
    return ALayout::kCoreMatrices;
  }
  // the TMA unit's limits: element strides of at most 8, box sides of at most 256. Strided problems of one short
  // K block (ResNet's 1x1 stride-2 shortcuts) stay with WgmmaKernel's short-K cp.async instances, which issue
  // only K's steps (a box layout's K block issues all four).
  const bool strided = p.stride_w != 1 || p.stride_h != 1;
  if (p.stride_w > 8 || p.stride_h > 8 || box_w * p.stride_w > 256 || box_h * p.stride_h > 256 ||
      (strided && p.k_words <= 24)) {
    return ALayout::kCoreMatrices;
  }
  // Tap rows where a tap's bytes allow (W-byte boxes with the W-byte swizzle), else 16-byte chunk boxes; the
  // stored pixel's bytes, so that a box never crosses a repeat (nor, in a doubled convolution, a tap's run).
  const int tap_row_bytes = ABoxTapBytes(p);
  r = NhwcBytes(p, tap_row_bytes ? tap_row_bytes : 16, box_w, box_h,
                tap_row_bytes == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                : tap_row_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                : tap_row_bytes == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                      : CU_TENSOR_MAP_SWIZZLE_NONE,
                box_images);
  return tap_row_bytes ? ALayout::kTapRows : ALayout::kChunkSlabs;
}

// The weights as a 3-D tensor of FSB tiles for WeightCopyMulticast: (128 bytes, w_k_tiles, w_row_tiles),
// boxes of 8 x 16 tiles.
TensorMapRecipe WeightRecipe(const BinaryGemmProblem& p) {
  TensorMapRecipe r;
  r.rank = 3;
  r.dims[0] = 128;
  r.dims[1] = static_cast<cuuint64_t>(p.w_k_tiles);
  r.dims[2] = static_cast<cuuint64_t>(p.w_row_tiles);
  r.strides[0] = 128;
  r.strides[1] = static_cast<cuuint64_t>(p.w_k_tiles) * 128;
  r.box[0] = 128;
  r.box[1] = kKBlockWords / 4;
  r.box[2] = kWgCols / 8 / kWgCluster;
  return r;
}

// The resident kernel's weights: one box of a column tile's `cols` / 8 row tiles of all K tiles (FSB tiles
// of 128 bytes; at most 256 of each, a box's limit: PlanResident's shared memory keeps K far below).
TensorMapRecipe ResidentWeightRecipe(const BinaryGemmProblem& p, int cols) {
  TensorMapRecipe r = WeightRecipe(p);
  r.box[1] = static_cast<cuuint32_t>(p.w_k_tiles);
  r.box[2] = static_cast<cuuint32_t>(cols / 8);
  return r;
}

}  // namespace jaxbnn::cuda
