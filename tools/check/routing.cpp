#include "tools/check/routing.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "testing/data.hpp"

namespace moegraph::check {
namespace {

using config_detail::integer_in;

// Rows of one case: large enough for every routing test, small enough for the fp64 reference.
constexpr int64_t kMaxRows = int64_t{1} << 22;

std::vector<int64_t> integer_list(const Json& value, const std::string& path, int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  for (const Json& item : config_detail::array(value, path))
    out.push_back(integer_in(item, detail::concat(path, "[", out.size(), "]"), lo, hi));
  return out;
}

std::vector<int32_t> read_explicit_splits(const JsonObject& o, int groups) {
  const std::string path = o.path("splits");
  const std::vector<int64_t> splits = integer_list(o.required("splits"), path, 0, kMaxRows);
  MG_CONFIG_CHECK(static_cast<int64_t>(splits.size()) == groups, path, " must list one split per expert (",
                  groups, "), got ", splits.size());
  const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  MG_CONFIG_CHECK(total <= kMaxRows, path, " must sum to at most ", kMaxRows, " rows, got ", total);
  return {splits.begin(), splits.end()};
}

std::vector<int> read_empty_experts(const JsonObject& o, int groups, int64_t rows) {
  const std::string path = o.path("experts");
  const std::vector<int64_t> listed = integer_list(o.required("experts"), path, 0, groups - 1);
  MG_CONFIG_CHECK(!listed.empty(), path, " must list at least one expert");
  std::vector<int> experts(listed.begin(), listed.end());
  std::sort(experts.begin(), experts.end());
  const auto repeated = std::adjacent_find(experts.begin(), experts.end());
  MG_CONFIG_CHECK(repeated == experts.end(), path, " lists expert ", repeated == experts.end() ? 0 : *repeated,
                  " twice");
  MG_CONFIG_CHECK(static_cast<int>(experts.size()) < groups || rows == 0, path,
                  " leaves no expert for the ", rows, " rows");
  return experts;
}

}  // namespace

RoutingSpec read_routing(const Json& value, const std::string& path, int groups) {
  MG_CONFIG_CHECK(value.is_object(), path, " must be an object, got ", config_detail::describe(value));
  // The kind decides which other keys are valid, so it is read first.
  const auto kind_it = value.find("kind");
  MG_CONFIG_CHECK(kind_it != value.end(), config_detail::missing_key_message(value, path + ".kind", "kind"));
  const std::string kind =
      choice(*kind_it, path + ".kind", {"explicit", "random", "empty_experts", "one_expert"});
  auto rows_of = [](const JsonObject& o) { return integer_in(o.required("rows"), o.path("rows"), 0, kMaxRows); };
  auto seed_of = [](const JsonObject& o) { return config_detail::non_negative_integer(o.required("seed"), o.path("seed")); };

  RoutingSpec spec;
  if (kind == "explicit") {
    const JsonObject o(value, path, {"kind", "splits"});
    spec.kind = RoutingKind::kExplicit;
    spec.splits = read_explicit_splits(o, groups);
  } else if (kind == "random") {
    const JsonObject o(value, path, {"kind", "rows", "seed", "skew"});
    spec.kind = RoutingKind::kRandom;
    spec.rows = rows_of(o);
    spec.seed = seed_of(o);
    spec.skew = optional_value(o, "skew", 0.0, config_detail::number);
    MG_CONFIG_CHECK(spec.skew >= 0.0 && spec.skew <= 10.0, o.path("skew"),
                    " must be in [0, 10] (0: uniform, else a Zipf exponent), got ", spec.skew);
  } else if (kind == "empty_experts") {
    const JsonObject o(value, path, {"kind", "rows", "seed", "experts"});
    spec.kind = RoutingKind::kEmptyExperts;
    spec.rows = rows_of(o);
    spec.seed = seed_of(o);
    spec.empty_experts = read_empty_experts(o, groups, spec.rows);
  } else {
    const JsonObject o(value, path, {"kind", "rows", "expert"});
    spec.kind = RoutingKind::kOneExpert;
    spec.rows = rows_of(o);
    spec.expert = static_cast<int>(integer_in(o.required("expert"), o.path("expert"), 0, groups - 1));
  }
  return spec;
}

SplitGenerator::SplitGenerator(const RoutingSpec& spec, int groups) : spec_(spec), groups_(groups), rng_(spec.seed) {}

std::vector<int32_t> SplitGenerator::next() {
  switch (spec_.kind) {
    case RoutingKind::kExplicit:
      return spec_.splits;
    case RoutingKind::kRandom:
      return testing::random_splits(rng_, groups_, spec_.rows, spec_.skew);
    case RoutingKind::kEmptyExperts: {
      // Random splits over the experts that may get rows, scattered back into place.
      std::vector<int> used;
      for (int e = 0; e < groups_; ++e)
        if (!std::binary_search(spec_.empty_experts.begin(), spec_.empty_experts.end(), e)) used.push_back(e);
      std::vector<int32_t> splits(groups_, 0);
      if (used.empty()) return splits;
      const auto packed = testing::random_splits(rng_, static_cast<int>(used.size()), spec_.rows, 0.0);
      for (std::size_t i = 0; i < used.size(); ++i) splits[used[i]] = packed[i];
      return splits;
    }
    case RoutingKind::kOneExpert: {
      std::vector<int32_t> splits(groups_, 0);
      splits[spec_.expert] = static_cast<int32_t>(spec_.rows);
      return splits;
    }
  }
  return {};
}

}  // namespace moegraph::check
