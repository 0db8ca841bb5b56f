// A minimal NumPy .npy writer (format version 1.0: little-endian, C order), enough for dumps that
// numpy.load reads back.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string_view>
#include <type_traits>
#include <vector>

namespace moegraph::check {

static_assert(std::endian::native == std::endian::little, "the .npy writer stores host bytes as little-endian");

// Creates `dir` and removes the .npy files an earlier dump left there: one this run does not write
// would be read back as this run's.
void prepare_dump_dir(const std::filesystem::path& dir);

// Writes `bytes` bytes of element type `descr` (e.g. "<f4") with `shape`; throws on I/O errors or
// when the shape does not match the byte count.
void write_npy_bytes(const std::filesystem::path& path, const void* data, std::size_t bytes, std::string_view descr,
                     std::size_t element_size, const std::vector<int64_t>& shape);

template <class T>
void write_npy(const std::filesystem::path& path, const std::vector<T>& values, const std::vector<int64_t>& shape) {
  constexpr std::string_view descr = std::is_same_v<T, float>     ? "<f4"
                                     : std::is_same_v<T, double>  ? "<f8"
                                     : std::is_same_v<T, int32_t> ? "<i4"
                                     : std::is_same_v<T, int64_t> ? "<i8"
                                                                  : "";
  static_assert(!descr.empty(), "write_npy supports float, double, int32_t and int64_t");
  write_npy_bytes(path, values.data(), values.size() * sizeof(T), descr, sizeof(T), shape);
}

}  // namespace moegraph::check
