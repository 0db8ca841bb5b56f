#include "kernels/grouped_gemm/sm90_tensor_maps.hpp"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include "kernels/common/alignment.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

void* tensor_map_encoder() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  MG_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
  MG_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr, "the driver has no cuTensorMapEncodeTiled");
  return fn;
}

CUtensorMap encode_sw128_map(void* encoder, CUtensorMapDataType type, int rank, const void* base, const uint64_t* dims,
                             const uint64_t* byte_strides, const uint32_t* box) {
  MG_CHECK(encoder != nullptr, "the TMA plan was not prepared (prepare_gemm at set-up)");
  MG_CHECK(rank >= 1 && rank <= 5, "a tensor map has 1 to 5 dims, got ", rank);
  MG_CHECK(aligned16(base), "TMA operands must be 16-byte aligned");
  cuuint64_t gdims[5], gstrides[4];
  cuuint32_t gbox[5], estrides[5];
  for (int i = 0; i < rank; ++i) gdims[i] = dims[i] > 0 ? dims[i] : 1, gbox[i] = box[i], estrides[i] = 1;
  for (int i = 0; i + 1 < rank; ++i) gstrides[i] = byte_strides[i];
  CUtensorMap map;
  const CUresult r = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(encoder)(
      &map, type, static_cast<cuuint32_t>(rank), const_cast<void*>(base), gdims, gstrides, gbox, estrides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MG_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed with code ", static_cast<int>(r));
  return map;
}

CUtensorMap encode_rows_map(void* encoder, CUtensorMapDataType type, int elem_bytes, const void* base, int64_t rows,
                            int64_t cols, uint32_t box_cols, uint32_t box_rows) {
  const uint64_t dims[2] = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
  const uint64_t strides[1] = {static_cast<uint64_t>(cols) * elem_bytes};
  const uint32_t box[2] = {box_cols, box_rows};
  return encode_sw128_map(encoder, type, 2, base, dims, strides, box);
}

CUtensorMap encode_grouped_map(void* encoder, CUtensorMapDataType type, int elem_bytes, const void* base, int64_t groups,
                               int64_t n, int64_t k, uint32_t box_k, uint32_t box_n) {
  const uint64_t dims[3] = {static_cast<uint64_t>(k), static_cast<uint64_t>(n), static_cast<uint64_t>(groups)};
  const uint64_t strides[2] = {static_cast<uint64_t>(k) * elem_bytes, static_cast<uint64_t>(n * k) * elem_bytes};
  const uint32_t box[3] = {box_k, box_n, 1};
  return encode_sw128_map(encoder, type, 3, base, dims, strides, box);
}

CUtensorMapDataType tensor_map_type_16bit(DType dtype) {
  return dtype == DType::kFP16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

}  // namespace moegraph::kernels
