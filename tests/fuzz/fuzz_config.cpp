// libFuzzer target: the config parser (moegraph::parse_config) on arbitrary bytes.
// ConfigError is its documented answer to bad input. An accepted config must also survive the trip
// through to_json (what --plan and result files print): printed and parsed again, it prints the same.
#include <cstddef>
#include <cstdint>
#include <string>

#include "moegraph/config.hpp"
#include "tests/fuzz/fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  moegraph::fuzz::expect_only<moegraph::ConfigError>("parse_config", [&] {
    const moegraph::Config config = moegraph::parse_config(text, "<fuzz>");
    const std::string printed = moegraph::to_json(config);
    std::string again;
    try {
      again = moegraph::to_json(moegraph::parse_config(printed, "<to_json>"));
    } catch (const moegraph::ConfigError& e) {
      moegraph::fuzz::finding("to_json printed a config that parse_config refuses: " + std::string(e.what()) +
                              "\n" + printed);
    }
    if (again != printed) moegraph::fuzz::finding("to_json is not stable:\n" + printed + "\nthen\n" + again);
  });
  return 0;
}
