// Bias gradients and row copies over ragged groups (host-callable launchers).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "moegraph/types.hpp"

namespace moegraph::kernels {

struct BiasGradParams {
  const void* dy = nullptr;          // [capacity_rows, N]
  const float* bias_scale = nullptr; // [capacity_rows] or null (s = 1)
  const void* bias = nullptr;        // [G, N], for dbias_scale
  int64_t n = 0;
  const int32_t* splits = nullptr;
  const int64_t* offsets = nullptr;
  int num_groups = 0;
  void* dbias = nullptr;             // [G, N]: db_e = sum_r s_r dy_r (empty group: zeros)
  float* dbias_scale = nullptr;      // [capacity_rows]: ds_r = <dy_r, b_e> (gap rows: 0)
  float* partials = nullptr;         // workspace, bias_grad_workspace_floats() floats
};

// Rows summed by one block into one fp32 partial; partials are then reduced in a fixed order,
// so the bias gradient is deterministic and every group's rows are spread over many blocks.
constexpr int kBiasGradChunkRows = 256;
std::size_t bias_grad_workspace_floats(int64_t capacity_rows, int num_groups, int64_t n);

void launch_bias_grad(DType dtype, const BiasGradParams& p, int grid, cudaStream_t stream);

// Copies the rows [0, offsets[G]) of a [capacity_rows, row_bytes] buffer: the used rows only, so
// the cost follows the routing rather than the capacity.
void launch_copy_used_rows(void* dst, const void* src, std::size_t row_bytes, const int64_t* offsets,
                           int num_groups, int grid, cudaStream_t stream);

}  // namespace moegraph::kernels

namespace moegraph::kernels {

// SwiGLU over the used rows [0, offsets[G]) of h = [rows, 2 * ffn] laid out as (gate | up):
// a[r, j] = silu(gate[r, j]) * up[r, j]. Gap rows are zero in h, so they stay zero in a.
void launch_swiglu_forward(DType dtype, const void* h, void* a, int64_t ffn, const int64_t* offsets, int num_groups,
                           int grid, cudaStream_t stream);
// dgate = da * up * silu'(gate), dup = da * silu(gate), written into dh = [rows, 2 * ffn].
void launch_swiglu_backward(DType dtype, const void* h, const void* da, void* dh, int64_t ffn, const int64_t* offsets,
                            int num_groups, int grid, cudaStream_t stream);
// The grid the layer gives them: every SM filled with as many blocks as fit (host set-up; the
// used rows are known on the device only).
int swiglu_grid(DType dtype, bool backward);

}  // namespace moegraph::kernels

namespace moegraph::kernels {

// p[i] = uniform in [-scale, scale) from a hash of (seed, i): deterministic, never all zero.
// For initializing weights on the device without a host round trip.
void launch_fill_uniform(DType dtype, void* p, std::size_t count, float scale, uint64_t seed, cudaStream_t stream);

}  // namespace moegraph::kernels
