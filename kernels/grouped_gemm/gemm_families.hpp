// The per-family entry points behind grouped_gemm.hpp (internal to kernels/grouped_gemm): each
// family's translation unit knows its tile shapes (config), its set-up on the current device
// (prepare: raise the shared-memory limit, return the resident CTAs per SM) and its launches.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/grouped_gemm/grouped_gemm.hpp"

namespace moegraph::kernels {

// sm80_grouped_gemm_16bit_wmma.cu
GemmConfig reference_gemm_config(GemmPhase phase, DType dtype);
int prepare_reference_gemm(const GemmConfig& config);
void launch_reference_gemm(const GemmPlan& plan, const RaggedGemmParams& p, cudaStream_t stream);
void launch_reference_wgrad(const GemmPlan& plan, const WgradParams& p, cudaStream_t stream);

// sm90_grouped_gemm_16bit_cp_async.cu
GemmConfig cp_async_gemm_config(GemmPhase phase, DType dtype, int tile_n);
int prepare_cp_async_gemm(const GemmConfig& config);
void launch_cp_async_gemm(const GemmPlan& plan, const RaggedGemmParams& p, cudaStream_t stream);
void launch_cp_async_wgrad(const GemmPlan& plan, const WgradParams& p, cudaStream_t stream);

// sm90_grouped_gemm_16bit_tma.cu
// ping_pong (wgrad only): the ping-pong consumer kernel, 128 x 128 tiles.
GemmConfig tma_gemm_config(GemmPhase phase, DType dtype, int tile_n, bool ping_pong = false, bool into_main_grad = false);
int prepare_tma_gemm(const GemmConfig& config, void** encode_tensor_map);
void launch_tma_gemm(const GemmPlan& plan, const RaggedGemmParams& p, cudaStream_t stream);
void launch_tma_wgrad(const GemmPlan& plan, const WgradParams& p, cudaStream_t stream);

// sm90_grouped_gemm_mxfp8_cp_async.cu
GemmConfig mxfp8_gemm_config(GemmPhase phase, DType out, bool ping_pong);
int prepare_mxfp8_gemm(const GemmConfig& config);

// sm90_grouped_gemm_mxfp8_swap_ab.cu (fprop and dgrad)
GemmConfig mxfp8_swap_ab_config(GemmPhase phase, DType out);
int prepare_mxfp8_swap_ab(const GemmConfig& config, void** encode_tensor_map);
void launch_mxfp8_swap_ab(const GemmPlan& plan, const Mxfp8RaggedGemmParams& p, cudaStream_t stream);
// Its scratch for split reductions (counters and fp32 partials), 0 where no launch can split.
std::size_t mxfp8_swap_ab_split_bytes(int groups, int64_t capacity_rows, int64_t n);

// sm90_grouped_gemm_mxfp8_dequant.cu (fprop and dgrad)
GemmConfig mxfp8_dequant_config(GemmPhase phase, DType out);
int prepare_mxfp8_dequant(const GemmConfig& config, void** encode_tensor_map);
void launch_mxfp8_dequant(const GemmPlan& plan, const Mxfp8RaggedGemmParams& p, cudaStream_t stream);

// mxfp8_staged.cpp (every phase): the 16-bit TMA kernel of tile_n (ping_pong: wgrad's ping-pong
// kernel) over operands dequantized to bf16 in Mxfp8*Params::staging.
GemmConfig mxfp8_staged_config(GemmPhase phase, DType out, int tile_n, bool ping_pong, bool into_main_grad = false);
int prepare_mxfp8_staged(const GemmConfig& config, void** encode_tensor_map);
void launch_mxfp8_staged(const GemmPlan& plan, const Mxfp8RaggedGemmParams& p, cudaStream_t stream);
void launch_mxfp8_staged_wgrad(const GemmPlan& plan, const Mxfp8WgradParams& p, cudaStream_t stream);

}  // namespace moegraph::kernels
