#include "model/json_fields.h"

#include "engine/error.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

namespace cw {

namespace {

constexpr size_t kShownChars = 60;  // a found string is shown up to this many bytes

[[noreturn]] void wrong(const nlohmann::json& value, const std::string& file, const std::string& path,
                        const char* expected, const std::string& hint) {
  fail(fmt::format("{} must be {}, found {}", json_where(file, path), expected, json_found(value)),
       hint.empty() ? "fix the value in the file" : hint);
}

}  // namespace

std::string json_found(const nlohmann::json& value) {
  switch (value.type()) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::object: return fmt::format("an object of {} keys", value.size());
    case nlohmann::json::value_t::array: return fmt::format("an array of {}", value.size());
    case nlohmann::json::value_t::string: {
      const std::string& s = value.get_ref<const std::string&>();
      if (s.size() <= kShownChars) return "a string " + value.dump();
      return "a string " + nlohmann::json(s.substr(0, kShownChars)).dump(-1, ' ', false,
                                                                        nlohmann::json::error_handler_t::replace) +
             "...";
    }
    case nlohmann::json::value_t::boolean: return fmt::format("a boolean {}", value.get<bool>());
    case nlohmann::json::value_t::number_float: return fmt::format("the number {}", value.get<double>());
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: return fmt::format("the integer {}", value.dump());
    default: return value.type_name();
  }
}

nlohmann::json json_parse(const std::string& text, const std::string& file, const std::string& hint) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // parse_error, or out_of_range for a number like 1e400: keep the position and the reason.
    std::string why = e.what();
    if (const size_t tag = why.find("] "); tag != std::string::npos) why = why.substr(tag + 2);
    fail(fmt::format("{}: not valid JSON: {}", file, why), hint);
  }
}

std::string json_where(const std::string& file, const std::string& path) {
  if (path.empty()) return file;
  return fmt::format("{}: \"{}\"", file, path);
}

int64_t json_integer(const nlohmann::json& value, const std::string& file, const std::string& path,
                     const std::string& hint) {
  if (value.is_number_unsigned()) {
    const auto u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) wrong(value, file, path, "an int64", hint);
    return static_cast<int64_t>(u);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) {
    const double d = value.get<double>();
    // 2^63 is the first double past int64's range.
    if (std::isfinite(d) && std::floor(d) == d && d >= -0x1p63 && d < 0x1p63) return static_cast<int64_t>(d);
  }
  wrong(value, file, path, "an integer", hint);
}

double json_number(const nlohmann::json& value, const std::string& file, const std::string& path,
                   const std::string& hint) {
  if (!value.is_number()) wrong(value, file, path, "a number", hint);
  const double d = value.get<double>();
  if (!std::isfinite(d)) wrong(value, file, path, "a finite number", hint);
  return d;
}

const std::string& json_string(const nlohmann::json& value, const std::string& file, const std::string& path,
                               const std::string& hint) {
  if (!value.is_string()) wrong(value, file, path, "a string", hint);
  return value.get_ref<const std::string&>();
}

JsonObject::JsonObject(const nlohmann::json& value, std::string file, std::string path, std::string hint)
    : value_(value), file_(std::move(file)), path_(std::move(path)), hint_(std::move(hint)) {
  if (!value_.is_object()) wrong(value_, file_, path_.empty() ? "" : path_, "an object", hint_);
}

std::string JsonObject::path_of(std::string_view key) const {
  return path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
}

const nlohmann::json* JsonObject::find(std::string_view key) const {
  const auto it = value_.find(key);
  if (it == value_.end() || it->is_null()) return nullptr;
  return &*it;
}

void JsonObject::fail_key(std::string_view key, const std::string& what, const std::string& hint) const {
  fail(fmt::format("{} {}", where(key), what),
       !hint.empty() ? hint : !hint_.empty() ? hint_ : "fix the value in the file");
}

const nlohmann::json& JsonObject::required(std::string_view key) const {
  const nlohmann::json* v = find(key);
  if (!v) fail_key(key, "is missing", hint_.empty() ? "add the key to the file" : hint_);
  return *v;
}

int64_t JsonObject::integer(std::string_view key) const { return json_integer(required(key), file_, path_of(key), hint_); }

double JsonObject::number(std::string_view key) const { return json_number(required(key), file_, path_of(key), hint_); }

std::string JsonObject::string(std::string_view key) const {
  return json_string(required(key), file_, path_of(key), hint_);
}

bool JsonObject::boolean(std::string_view key) const {
  const nlohmann::json& v = required(key);
  if (!v.is_boolean()) wrong(v, file_, path_of(key), "true or false", hint_);
  return v.get<bool>();
}

JsonObject JsonObject::object(std::string_view key) const { return JsonObject(required(key), file_, path_of(key), hint_); }

const nlohmann::json& JsonObject::array(std::string_view key) const {
  const nlohmann::json& v = required(key);
  if (!v.is_array()) wrong(v, file_, path_of(key), "an array", hint_);
  return v;
}

int64_t JsonObject::integer_or(std::string_view key, int64_t fallback) const { return has(key) ? integer(key) : fallback; }

double JsonObject::number_or(std::string_view key, double fallback) const { return has(key) ? number(key) : fallback; }

std::string JsonObject::string_or(std::string_view key, const std::string& fallback) const {
  return has(key) ? string(key) : fallback;
}

bool JsonObject::boolean_or(std::string_view key, bool fallback) const { return has(key) ? boolean(key) : fallback; }

}  // namespace cw
