#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moegraph {

// Element types of grouped buffers. Activations and weights are bf16 or fp16; fp32 is used for
// main_grad, bias scales and their gradients.
enum class DType { kBF16, kFP16, kFP32 };

constexpr std::size_t dtype_size(DType t) { return t == DType::kFP32 ? 4 : 2; }
std::string_view dtype_name(DType t);

// How the GEMMs compute: kBF16 on the activation dtype; kMXFP8 on E4M3 operands with one E8M0
// scale per 32 elements (docs/mxfp8.md). Backward always gets the recipe explicitly.
enum class Recipe { kBF16, kMXFP8 };
std::string_view recipe_name(Recipe r);

// Weight gradient of a backward call: computed at once, or queued for backward_dw().
enum class WgradMode { kImmediate, kDelayed };

}  // namespace moegraph
