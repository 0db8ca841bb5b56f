#include "tools/check/npy.hpp"

#include <fstream>
#include <string>

#include "moegraph/error.hpp"

namespace moegraph::check {

void write_npy_bytes(const std::filesystem::path& path, const void* data, std::size_t bytes, std::string_view descr,
                     std::size_t element_size, const std::vector<int64_t>& shape) {
  std::size_t elements = 1;
  std::string dims;
  for (int64_t d : shape) {
    elements *= static_cast<std::size_t>(d);
    dims += detail::concat(d, ", ");
  }
  if (shape.size() > 1) dims.erase(dims.size() - 2);  // "(3, 4)"; a 1-D shape keeps its comma: "(5,)"
  else if (shape.size() == 1) dims.pop_back();
  MG_CHECK(elements * element_size == bytes, path.string(), ": shape (", dims, ") does not match ", bytes, " bytes");

  std::string header = detail::concat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (", dims, "), }");
  // The data starts on a 64-byte boundary: magic (6) + version (2) + header length (2) + header + '\n'.
  const std::size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  MG_CHECK(header.size() <= 0xffff, path.string(), ": .npy header too long");

  std::ofstream out(path, std::ios::binary);
  MG_CHECK(out, "cannot write ", path.string());
  const char preamble[] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0, static_cast<char>(header.size() & 0xff),
                           static_cast<char>(header.size() >> 8)};
  out.write(preamble, sizeof(preamble));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  MG_CHECK(out.good(), "error writing ", path.string());
}

void prepare_dump_dir(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().extension() == ".npy") std::filesystem::remove(entry.path());
}

}  // namespace moegraph::check
