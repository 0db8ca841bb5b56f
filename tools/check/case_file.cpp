#include "tools/check/case_file.hpp"

#include <cctype>
#include <fstream>
#include <sstream>
#include <string_view>

#include "moegraph/config.hpp"
#include "tools/check/case_json.hpp"
#include "tools/check/grouped_linear_case.hpp"
#include "tools/check/moe_layer_case.hpp"

namespace moegraph::check {
namespace {

// One parser per op; a new op adds its own file and a row here.
struct OpParser {
  std::string_view op;
  std::unique_ptr<CaseRunner> (*parse)(const Json& value, const std::string& name);
};
constexpr OpParser kOps[] = {
    {"grouped_linear", parse_grouped_linear_case},
    {"moe_layer", parse_moe_layer_case},
};

// Names become dump folders, so they stay plain.
bool plain_name(const std::string& name) {
  if (name.empty() || name.size() > 100 || name[0] == '.') return false;
  for (char c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.') return false;
  return true;
}

std::string read_name(const Json& value) {
  MG_CONFIG_CHECK(value.is_object(), "a case must be an object, got ", config_detail::describe(value));
  const auto it = value.find("name");
  MG_CONFIG_CHECK(it != value.end(), config_detail::missing_key_message(value, "name", "name"));
  const std::string name = config_detail::string(*it, "name");
  MG_CONFIG_CHECK(plain_name(name), "name must be 1 to 100 letters, digits, '_', '-' or '.' (not starting with '.'), got ",
                  in_quotes(name));
  return name;
}

std::unique_ptr<CaseRunner> parse_case(const Json& value, const std::string& name) {
  const auto it = value.find("op");
  MG_CONFIG_CHECK(it != value.end(), config_detail::missing_key_message(value, "op", "op"));
  const std::string op = config_detail::string(*it, "op");
  std::string known;
  for (const OpParser& p : kOps) {
    if (p.op == op) return p.parse(value, name);
    known += detail::concat(known.empty() ? "" : ", ", in_quotes(p.op));
  }
  MG_CONFIG_FAIL("op ", in_quotes(op), " is not supported (supported: ", known, ")");
}

}  // namespace

std::vector<std::unique_ptr<CaseRunner>> load_case_file(const std::string& path) {
  std::string text;
  try {
    text = config_detail::read_document_file(path, "case file");  // its messages name the path
  } catch (const ConfigError& e) {
    throw CaseFileError(e.message());
  }
  Json document;
  try {
    document = config_detail::parse_document(text);
  } catch (const ConfigError& e) {
    throw CaseFileError(path + ": " + e.message());
  }
  // Either {"cases": [...]} (and nothing else) or a single case object.
  std::vector<const Json*> cases;
  std::vector<std::string> positions;
  if (document.is_object() && document.contains("cases")) {
    if (document.size() > 1) {  // not "unknown key" on the case's own keys: "cases" is the stray one, or they are
      std::string others;
      for (const auto& [k, v] : document.items())
        if (k != "cases") others += (others.empty() ? "\"" : ", \"") + k + "\"";
      throw CaseFileError(path + ": a case file is either {\"cases\": [...]} alone or one case object, but this "
                          "one has \"cases\" beside " + others);
    }
    try {
      const JsonObject file(document, "", {"cases"});
      const std::string key = "cases";  // named: a temporary here makes g++ 13 warn of a dangling reference
      const auto& items = config_detail::array(file.required(key), key);
      MG_CONFIG_CHECK(!items.empty(), "cases must list at least one case");
      for (std::size_t i = 0; i < items.size(); ++i) {
        cases.push_back(&items[i]);
        positions.push_back(detail::concat("cases[", i, "]"));
      }
    } catch (const ConfigError& e) {
      throw CaseFileError(path + ": " + e.message());
    }
  } else {
    cases.push_back(&document);
    positions.push_back("");
  }

  std::vector<std::unique_ptr<CaseRunner>> runners;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    std::string where = positions[i];
    try {
      const std::string name = read_name(*cases[i]);
      where = detail::concat("case ", in_quotes(name));
      runners.push_back(parse_case(*cases[i], name));
    } catch (const ConfigError& e) {
      throw CaseFileError(detail::concat(path, ": ", where, where.empty() ? "" : ": ", e.message()));
    }
  }
  return runners;
}

}  // namespace moegraph::check
