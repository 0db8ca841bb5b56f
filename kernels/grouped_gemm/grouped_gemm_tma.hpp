// The warp-specialized TMA grouped GEMMs (grouped_gemm_tma.cu), dispatched to by grouped_gemm.cu's
// launchers; internal to kernels/.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/grouped_gemm/grouped_gemm.hpp"

namespace moegraph::kernels {

GemmTileConfig tma_tile_config(int tile_n);
// Set-up, before capture: looks up the tensor-map encoder and raises the kernels' shared memory.
void prepare_tma_gemm(DType dtype);
// One CTA per SM; p.capacity_rows gives the extent of the row buffers.
void launch_ragged_gemm_tma(DType dtype, RaggedGemmKind kind, const RaggedGemmParams& p, int sm_count,
                            cudaStream_t stream);
void launch_grouped_wgrad_tma(DType dtype, const WgradParams& p, int sm_count, cudaStream_t stream);

}  // namespace moegraph::kernels
