// Instantiates the warp-specialized TMA kernels (bf16 and fp16; fprop, dgrad, wgrad; 128- and 256-wide
// tiles) and encodes their tensor maps. Encoding is host-only arithmetic on pointers and sizes (no
// device access, no synchronization), so the launchers stay capturable; the driver entry point is
// looked up once at set-up.
#include <cuda.h>
#include <cudaTypedefs.h>

#include "kernels/grouped_gemm/grouped_gemm_tma.hpp"
#include "kernels/grouped_gemm/sm90_grouped_gemm_tma.cuh"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

namespace {

namespace t = tma_gemm;

PFN_cuTensorMapEncodeTiled_v12000 g_encode = nullptr;

// A row-major tensor of 16-bit elements with dims[0] contiguous; strides in elements for dims 1...
template <int kRank>
CUtensorMap encode(DType dtype, const void* base, const uint64_t (&dims)[kRank], const uint64_t (&strides)[kRank - 1],
                   const uint32_t (&box)[kRank]) {
  MG_CHECK(g_encode != nullptr, "prepare_grouped_gemm must run before the TMA launchers (at set-up)");
  MG_CHECK(reinterpret_cast<uintptr_t>(base) % 16 == 0, "the TMA grouped GEMM needs 16-byte aligned operands");
  cuuint64_t gdims[kRank], gstrides[kRank > 1 ? kRank - 1 : 1];
  cuuint32_t gbox[kRank], estrides[kRank];
  for (int i = 0; i < kRank; ++i) gdims[i] = dims[i] > 0 ? dims[i] : 1, gbox[i] = box[i], estrides[i] = 1;
  for (int i = 0; i + 1 < kRank; ++i) gstrides[i] = strides[i] * 2;
  CUtensorMap map;
  const CUresult r = g_encode(&map, dtype == DType::kFP16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                              kRank, const_cast<void*>(base), gdims, gstrides, gbox, estrides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MG_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed with code ", static_cast<int>(r));
  return map;
}

// Rows [capacity, cols] with a box of box_rows x 64 columns.
CUtensorMap rows_map(DType dtype, const void* base, int64_t capacity, int64_t cols, uint32_t box_rows) {
  return encode<2>(dtype, base, {static_cast<uint64_t>(cols), static_cast<uint64_t>(capacity)},
                   {static_cast<uint64_t>(cols)}, {64u, box_rows});
}
// W [G][N][K] with a box of 64 K x box_n N x 1.
CUtensorMap weight_map(DType dtype, const void* w, int64_t groups, int64_t n, int64_t k, uint32_t box_n) {
  return encode<3>(dtype, w, {static_cast<uint64_t>(k), static_cast<uint64_t>(n), static_cast<uint64_t>(groups)},
                   {static_cast<uint64_t>(k), static_cast<uint64_t>(n * k)}, {64u, box_n, 1u});
}

template <class Kernel>
void allow_smem(Kernel kernel, int smem_bytes) {
  MG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
}

template <class T>
void prepare() {
  allow_smem(t::ragged_gemm_ws_kernel<T, t::Ws128, false>, t::Ws128::kSmemBytes);
  allow_smem(t::ragged_gemm_ws_kernel<T, t::Ws128, true>, t::Ws128::kSmemBytes);
  allow_smem(t::grouped_wgrad_ws_kernel<T, t::Ws128>, t::Ws128::kSmemBytes);
  allow_smem(t::ragged_gemm_ws_kernel<T, t::Ws256, false>, t::Ws256::kSmemBytes);
  allow_smem(t::ragged_gemm_ws_kernel<T, t::Ws256, true>, t::Ws256::kSmemBytes);
  allow_smem(t::grouped_wgrad_ws_kernel<T, t::Ws256>, t::Ws256::kSmemBytes);
}

template <class T, class Shape>
void launch_ragged(bool dgrad, DType dtype, const RaggedGemmParams& p, int grid, cudaStream_t stream) {
  t::RaggedTmaParams tp;
  tp.p = p;
  const int64_t red = dgrad ? p.n : p.k;
  tp.a = rows_map(dtype, p.a, p.capacity_rows, red, t::BM);
  tp.b = weight_map(dtype, p.w, p.num_groups, p.n, p.k, dgrad ? 64u : static_cast<uint32_t>(Shape::BN));
  if (dgrad) t::ragged_gemm_ws_kernel<T, Shape, true><<<grid, t::THREADS, Shape::kSmemBytes, stream>>>(tp);
  else t::ragged_gemm_ws_kernel<T, Shape, false><<<grid, t::THREADS, Shape::kSmemBytes, stream>>>(tp);
}

template <class T, class Shape>
void launch_wgrad(DType dtype, const WgradParams& p, int grid, cudaStream_t stream) {
  t::WgradTmaParams tp;
  tp.p = p;
  tp.dy = rows_map(dtype, p.dy, p.capacity_rows, p.n, 64);
  tp.x = rows_map(dtype, p.x, p.capacity_rows, p.k, 64);
  t::grouped_wgrad_ws_kernel<T, Shape><<<grid, t::THREADS, Shape::kSmemBytes, stream>>>(tp);
}

}  // namespace

GemmTileConfig tma_tile_config(int tile_n) {
  return tile_n == 256 ? GemmTileConfig{"wgmma_tma_ws_sw128", t::BM, 256, t::BK, t::Ws256::STAGES, t::THREADS}
                       : GemmTileConfig{"wgmma_tma_ws_sw128", t::BM, 128, t::BK, t::Ws128::STAGES, t::THREADS};
}

void prepare_tma_gemm(DType dtype) {
  if (g_encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    MG_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
    MG_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr, "the driver has no cuTensorMapEncodeTiled");
    g_encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  if (dtype == DType::kFP16) prepare<__half>();
  else prepare<__nv_bfloat16>();
}

void launch_ragged_gemm_tma(DType dtype, RaggedGemmKind kind, const RaggedGemmParams& p, int sm_count,
                            cudaStream_t stream) {
  MG_CHECK(p.capacity_rows > 0, "the TMA grouped GEMM needs capacity_rows");
  const bool dgrad = kind == RaggedGemmKind::kDgrad;
  const bool half = dtype == DType::kFP16;
  if (p.tile_n == 256) {
    if (half) launch_ragged<__half, t::Ws256>(dgrad, dtype, p, sm_count, stream);
    else launch_ragged<__nv_bfloat16, t::Ws256>(dgrad, dtype, p, sm_count, stream);
  } else {
    if (half) launch_ragged<__half, t::Ws128>(dgrad, dtype, p, sm_count, stream);
    else launch_ragged<__nv_bfloat16, t::Ws128>(dgrad, dtype, p, sm_count, stream);
  }
}

void launch_grouped_wgrad_tma(DType dtype, const WgradParams& p, int sm_count, cudaStream_t stream) {
  MG_CHECK(p.capacity_rows > 0, "the TMA grouped GEMM needs capacity_rows");
  const bool half = dtype == DType::kFP16;
  if (p.tile_n == 256) {
    if (half) launch_wgrad<__half, t::Ws256>(dtype, p, sm_count, stream);
    else launch_wgrad<__nv_bfloat16, t::Ws256>(dtype, p, sm_count, stream);
  } else {
    if (half) launch_wgrad<__half, t::Ws128>(dtype, p, sm_count, stream);
    else launch_wgrad<__nv_bfloat16, t::Ws128>(dtype, p, sm_count, stream);
  }
}

}  // namespace moegraph::kernels
