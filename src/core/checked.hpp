// Size arithmetic on user options: every element count, byte size and offset derived from them goes
// through these, so a value too large for 64 bits is refused (naming what was being computed and its
// operands) instead of wrapping into a small size that would under-allocate.
#pragma once

#include <cstdint>
#include <limits>
#include <sstream>
#include <string_view>
#include <type_traits>

#include "moegraph/error.hpp"

namespace moegraph {

namespace checked_detail {

template <class T>
void require_non_negative(std::string_view what, T value) {
  static_assert(std::is_integral_v<T>, "sizes are integers");
  if constexpr (std::is_signed_v<T>)
    if (value < 0) MG_FAIL(what, ": operand ", value, " is negative (sizes are counts of elements or bytes)");
}

template <class... Ts>
[[noreturn]] void fail_overflow(std::string_view what, const char* op, Ts... operands) {
  std::ostringstream os;
  const char* sep = "";
  ((os << sep << operands, sep = op), ...);
  MG_FAIL(what, ": ", os.str(), " is more than ", std::numeric_limits<int64_t>::max(),
          " (the 64-bit size limit)");
}

}  // namespace checked_detail

// The product of non-negative integers, or moegraph::Error (kInvalidArgument) naming `what`. The
// result fits int64_t, so it converts to either int64_t or size_t unchanged.
template <class... Factors>
int64_t checked_mul(std::string_view what, Factors... factors) {
  (checked_detail::require_non_negative(what, factors), ...);
  int64_t product = 1;
  const bool overflow = (__builtin_mul_overflow(product, factors, &product) || ...);
  if (overflow) checked_detail::fail_overflow(what, " * ", factors...);
  return product;
}

// The sum of non-negative integers, or moegraph::Error (kInvalidArgument) naming `what`.
template <class... Terms>
int64_t checked_add(std::string_view what, Terms... terms) {
  (checked_detail::require_non_negative(what, terms), ...);
  int64_t sum = 0;
  const bool overflow = (__builtin_add_overflow(sum, terms, &sum) || ...);
  if (overflow) checked_detail::fail_overflow(what, " + ", terms...);
  return sum;
}

// `value` rounded up to a multiple of `alignment` (positive), or moegraph::Error naming `what`.
inline int64_t checked_align_up(std::string_view what, int64_t value, int64_t alignment) {
  return checked_add(what, value, alignment - 1) / alignment * alignment;
}

}  // namespace moegraph
