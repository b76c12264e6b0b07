// Typed reads of JSON keys for the model files chunkwise reads (config.json, tokenizer.json,
// tokenizer_config.json, adapter_config.json, model.safetensors.index.json).
//
// nlohmann::json throws its own exceptions ("[json.exception.type_error.302] type must be string,
// but is number") when a value has another type than the code expects; those name neither the file
// nor the key. Every read of a key goes through JsonObject instead, and a wrong or missing value
// fails with one cw::Error line naming the file, the key path as the file spells it, what was
// expected and what was found:
//   config.json: "rope_scaling.factor" must be a number, found a string "x"
// A key holding null counts as absent, as transformers reads it.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>

namespace cw {

// What a value is, for messages: its type and, for scalars, the value itself, cut short when long
// (a whole nested value is never dumped: it may be huge).
std::string json_found(const nlohmann::json& value);

// `file: "path"`, the way every message names a key.
std::string json_where(const std::string& file, const std::string& path);

// Parses a whole document; invalid JSON fails naming the file and where the parser stopped (without
// nlohmann's "[json.exception.parse_error.101]" tag).
nlohmann::json json_parse(const std::string& text, const std::string& file, const std::string& hint);

// Typed reads of a value reached some other way (an array element): `path` names it in messages.
int64_t json_integer(const nlohmann::json& value, const std::string& file, const std::string& path,
                     const std::string& hint = "");
double json_number(const nlohmann::json& value, const std::string& file, const std::string& path,
                   const std::string& hint = "");
const std::string& json_string(const nlohmann::json& value, const std::string& file, const std::string& path,
                               const std::string& hint = "");

// A JSON object of `file` at key path `path` ("" for the document itself). The hint is what every
// failure of this object and of the objects reached through it tells the user to do.
class JsonObject {
 public:
  // Fails naming file and path unless `value` is an object.
  JsonObject(const nlohmann::json& value, std::string file, std::string path = "", std::string hint = "");

  const nlohmann::json& value() const { return value_; }
  const std::string& file() const { return file_; }
  const std::string& path() const { return path_; }
  // The key path of `key` in this object ("rope_scaling.factor"), and its `file: "path"` form.
  std::string path_of(std::string_view key) const;
  std::string where(std::string_view key) const { return json_where(file_, path_of(key)); }

  // The value of `key`, nullptr when it is absent or null.
  const nlohmann::json* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }

  // Required keys: absent, null or of another type is an error naming the key. Integers accept a
  // number with an integral value that fits int64 (2048.0, as some exporters write it).
  int64_t integer(std::string_view key) const;
  double number(std::string_view key) const;   // finite
  std::string string(std::string_view key) const;
  bool boolean(std::string_view key) const;
  JsonObject object(std::string_view key) const;
  const nlohmann::json& array(std::string_view key) const;

  // Optional keys: the fallback when absent or null; of another type, an error.
  int64_t integer_or(std::string_view key, int64_t fallback) const;
  double number_or(std::string_view key, double fallback) const;
  std::string string_or(std::string_view key, const std::string& fallback) const;
  bool boolean_or(std::string_view key, bool fallback) const;

  // Fails with `file: "path.key" <what>` and this object's hint (or `hint` when given).
  [[noreturn]] void fail_key(std::string_view key, const std::string& what, const std::string& hint = "") const;

 private:
  const nlohmann::json& required(std::string_view key) const;

  const nlohmann::json& value_;
  std::string file_, path_, hint_;
};

}  // namespace cw
