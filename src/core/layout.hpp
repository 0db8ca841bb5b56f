// Carves named buffers out of one block of device memory. The same walk runs twice: with a null
// base to size the block (no GPU needed, e.g. for --plan), then with the real base.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "moegraph/error.hpp"
#include "src/core/checked.hpp"

namespace moegraph {

class LayoutWalker {
 public:
  static constexpr std::size_t kAlignment = 256;
  // The most bytes one walk may lay out (256 TiB: past any device's memory, far below 2^64), so a
  // size computed from absurd options is refused here, naming its buffer, instead of allocated.
  static constexpr std::size_t kMaxBytes = std::size_t{1} << 48;
  struct Entry {
    std::string name;
    std::size_t offset, bytes;
  };

  explicit LayoutWalker(std::byte* base = nullptr) : base_(base) {}

  // The next buffer (aligned) of as many bytes as the product of `extents` (e.g. rows, cols and the
  // element size), or null when sizing or when it has no bytes. Throws moegraph::Error naming the
  // buffer when the product does not fit 64 bits or the walk would pass kMaxBytes.
  template <class T = void, class... Extents>
  T* take(std::string name, Extents... extents) {
    static_assert(sizeof...(Extents) >= 1, "a buffer's size is the product of at least one extent");
    const std::size_t bytes = checked_mul(name, extents...);
    // offset_ never passes kMaxBytes (a multiple of kAlignment), so neither the rounding nor the
    // subtraction below can wrap.
    const std::size_t offset = aligned(offset_);
    MG_CHECK(bytes <= kMaxBytes - offset, "workspace buffer \"", name, "\" of ", bytes, " bytes at offset ", offset,
             " would pass the layout maximum of ", kMaxBytes, " bytes (2^48)");
    entries_.push_back({std::move(name), offset, bytes});
    std::byte* p = base_ != nullptr && bytes > 0 ? base_ + offset : nullptr;
    offset_ = offset + bytes;
    return reinterpret_cast<T*>(p);
  }
  std::size_t bytes() const { return aligned(offset_); }
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  static_assert(kMaxBytes % kAlignment == 0, "an aligned offset at or below kMaxBytes stays at or below it");
  static std::size_t aligned(std::size_t offset) { return (offset + kAlignment - 1) / kAlignment * kAlignment; }

  std::byte* base_;
  std::size_t offset_ = 0;
  std::vector<Entry> entries_;
};

}  // namespace moegraph
