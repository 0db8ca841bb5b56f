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

// How backward computes: the recipe is always passed explicitly, never taken from hidden state.
enum class Recipe { kBF16 };

// Weight gradient of a backward call: computed at once, or queued for backward_dw().
enum class WgradMode { kImmediate, kDelayed };

}  // namespace moegraph
