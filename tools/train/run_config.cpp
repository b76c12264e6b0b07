// RunConfig: one table of (section, key, field) drives reading, overriding, writing and the error
// messages, so a key added to the struct is added here once and every path knows it.
#include "tools/train/run_config.h"

#include "engine/error.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string_view>
#include <variant>

namespace cw {

namespace {

// Where a field lives in the struct; the alternative is the field's TOML type.
using Target = std::variant<int64_t*, uint64_t*, double*, bool*, std::optional<bool>*, std::string*,
                            std::vector<std::string>*>;

struct Field {
  std::string_view section;
  std::string_view key;
  Target target;
  std::string name() const { return fmt::format("{}.{}", section, key); }
};

// Every key, in the order to_toml writes them. Takes a mutable config because the same table serves
// reading (writes through the pointers) and writing (reads through them).
std::vector<Field> fields_of(RunConfig& c) {
  return {
      {"model", "source", &c.model.source},
      {"model", "dtype", &c.model.dtype},
      {"model", "init_seed", &c.model.init_seed},
      {"model", "tie_embeddings", &c.model.tie_embeddings},
      {"data", "train", &c.data.train},
      {"data", "eval", &c.data.eval},
      {"data", "format", &c.data.format},
      {"data", "eval_fraction", &c.data.eval_fraction},
      {"data", "seq_len", &c.data.seq_len},
      {"data", "batch_size", &c.data.batch_size},
      {"data", "grad_accum", &c.data.grad_accum},
      {"data", "seed", &c.data.seed},
      {"data", "tokenizer", &c.data.tokenizer},
      {"schedule", "name", &c.schedule.name},
      {"schedule", "chunk", &c.schedule.chunk},
      {"schedule", "bwd_chunk", &c.schedule.bwd_chunk},
      {"schedule", "keep", &c.schedule.keep},
      {"schedule", "seed", &c.schedule.seed},
      {"schedule", "stratified", &c.schedule.stratified},
      {"schedule", "scale_loss", &c.schedule.scale_loss},
      {"schedule", "scale_relay", &c.schedule.scale_relay},
      {"schedule", "relay_cap", &c.schedule.relay_cap},
      {"schedule", "drop_relay", &c.schedule.drop_relay},
      {"schedule", "recompute", &c.schedule.recompute},
      {"schedule", "mlp_shards", &c.schedule.mlp_shards},
      {"schedule", "offload", &c.schedule.offload},
      {"schedule", "offload_window", &c.schedule.offload_window},
      {"schedule", "save_attention", &c.schedule.save_attention},
      {"optimizer", "lr", &c.optimizer.lr},
      {"optimizer", "min_lr", &c.optimizer.min_lr},
      {"optimizer", "warmup_steps", &c.optimizer.warmup_steps},
      {"optimizer", "decay", &c.optimizer.decay},
      {"optimizer", "beta1", &c.optimizer.beta1},
      {"optimizer", "beta2", &c.optimizer.beta2},
      {"optimizer", "eps", &c.optimizer.eps},
      {"optimizer", "weight_decay", &c.optimizer.weight_decay},
      {"optimizer", "grad_clip", &c.optimizer.grad_clip},
      {"train", "steps", &c.train.steps},
      {"train", "device", &c.train.device},
      {"train", "nonfinite", &c.train.nonfinite},
      {"train", "deterministic", &c.train.deterministic},
      {"train", "threads", &c.train.threads},
      {"eval", "every", &c.eval.every},
      {"eval", "batches", &c.eval.batches},
      {"checkpoint", "every", &c.checkpoint.every},
      {"checkpoint", "keep_last", &c.checkpoint.keep_last},
      {"checkpoint", "resume", &c.checkpoint.resume},
      {"log", "run_dir", &c.log.run_dir},
      {"log", "every", &c.log.every},
      {"log", "plot", &c.log.plot},
      {"sample", "prompt", &c.sample.prompt},
      {"sample", "tokens", &c.sample.tokens},
      {"sample", "temperature", &c.sample.temperature},
      {"sample", "top_k", &c.sample.top_k},
      {"sample", "top_p", &c.sample.top_p},
      {"sample", "seed", &c.sample.seed},
  };
}

// The names only (for suggestions and listings), from a config that lives as long as the program.
const std::vector<Field>& schema() {
  static RunConfig names_only = RunConfig::defaults();
  static const std::vector<Field> fields = fields_of(names_only);
  return fields;
}

std::vector<std::string_view> section_names() {
  std::vector<std::string_view> names;
  for (const Field& f : schema())
    if (names.empty() || names.back() != f.section) names.push_back(f.section);
  return names;
}

std::vector<std::string_view> keys_of(std::string_view section) {
  std::vector<std::string_view> keys;
  for (const Field& f : schema())
    if (f.section == section) keys.push_back(f.key);
  return keys;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The closest candidate within edit distance 2 (a typo, not a different word), or empty.
std::string_view closest(std::string_view word, const std::vector<std::string_view>& candidates) {
  std::string_view best;
  size_t best_distance = 3;
  for (std::string_view c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best_distance) best = c, best_distance = d;
  }
  return best;
}

std::string join(const std::vector<std::string_view>& words) {
  std::string out;
  for (std::string_view w : words) out += (out.empty() ? "" : ", ") + std::string(w);
  return out;
}

// User text inside a message, with control characters escaped: errors stay on one line.
std::string shown(std::string_view s) {
  std::string out;
  for (const char ch : s) {
    const auto byte = static_cast<unsigned char>(ch);
    if (ch == '\n') out += "\\n";
    else if (byte < 0x20 || byte == 0x7f) out += fmt::format("\\x{:02x}", static_cast<unsigned>(byte));
    else out += ch;
  }
  return out;
}

// ---- TOML text of values ----

std::string toml_string(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto byte = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        // TOML basic strings may not hold other control characters raw.
        if (byte < 0x20 || byte == 0x7f)
          out += fmt::format("\\u{:04X}", static_cast<unsigned>(byte));
        else
          out += ch;
    }
  }
  return out + "\"";
}

// fmt's "{}" is the shortest text that reads back to the same double; TOML needs a '.' or an
// exponent to read it as a float rather than an integer ("inf" and "nan" are floats already).
std::string toml_float(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::string toml_list(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + toml_string(items[i]);
  return out + "]";
}

// The value as TOML text; nullopt for an unset optional (TOML has no null).
std::optional<std::string> toml_value(const Target& target) {
  return std::visit(
      [](auto* p) -> std::optional<std::string> {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) return fmt::format("{}", *p);
        else if constexpr (std::is_same_v<T, double>) return toml_float(*p);
        else if constexpr (std::is_same_v<T, bool>) return *p ? "true" : "false";
        else if constexpr (std::is_same_v<T, std::optional<bool>>) {
          if (!p->has_value()) return std::nullopt;
          return **p ? "true" : "false";
        } else if constexpr (std::is_same_v<T, std::string>) return toml_string(*p);
        else return toml_list(*p);
      },
      target);
}

// What a field takes, for "must be ..." messages.
std::string_view expected(const Target& target) {
  switch (target.index()) {
    case 0: return "an integer";
    case 1: return "a non-negative integer";
    case 2: return "a number";
    case 3: case 4: return "true or false";
    case 5: return "a string";
    default: return "a list of strings";
  }
}

// An example assignment for the hint: the default value, or a made-up one where the default is
// empty or unset and so shows nothing.
std::string example(const Field& f) {
  const Field* d = nullptr;
  for (const Field& s : schema())
    if (s.section == f.section && s.key == f.key) d = &s;
  std::optional<std::string> v = d ? toml_value(d->target) : std::nullopt;
  if (!v || *v == "\"\"" || *v == "[]") {
    if (f.target.index() == 4) v = "true";
    else if (f.target.index() == 6) v = "[\"data/train_*.bin\"]";
    else v = "\"runs/example\"";
  }
  return fmt::format("e.g. {} = {}", f.key, *v);
}

std::string_view type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::array: return "array";
    case toml::node_type::table: return "table";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
    default: return "nothing";
  }
}

// "integer 3", "string \"x\"": the found value, so the message shows what to change.
std::string describe(const toml::node& node) {
  if (const auto* s = node.as_string()) return fmt::format("string {}", toml_string(s->get()));
  if (const auto* i = node.as_integer()) return fmt::format("integer {}", i->get());
  if (const auto* x = node.as_floating_point()) return fmt::format("float {}", toml_float(x->get()));
  if (const auto* b = node.as_boolean()) return fmt::format("boolean {}", b->get() ? "true" : "false");
  return std::string(type_name(node));
}

// ---- reading ----

// The position prefix of messages: "path:line:column" in a file, "--set" for an override.
struct Origin {
  std::string source;
  bool positions = true;
  std::string at(const toml::source_region& region) const {
    if (!positions) return source;
    return fmt::format("{}:{}:{}", source, region.begin.line, region.begin.column);
  }
};

[[noreturn]] void wrong_type(const Field& f, const toml::node& node, const std::string& where) {
  fail(fmt::format("{}: {} must be {}, got {}", where, f.name(), expected(f.target), describe(node)), example(f));
}

void assign(const Field& f, const toml::node& node, const std::string& where) {
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) {
          const auto* i = node.as_integer();
          if (!i) wrong_type(f, node, where);
          if constexpr (std::is_same_v<T, uint64_t>) {
            if (i->get() < 0) wrong_type(f, node, where);
            *p = static_cast<uint64_t>(i->get());
          } else {
            *p = i->get();
          }
        } else if constexpr (std::is_same_v<T, double>) {
          // An integer is a number too: lr = 3 means 3.0.
          if (const auto* x = node.as_floating_point()) *p = x->get();
          else if (const auto* i = node.as_integer()) *p = static_cast<double>(i->get());
          else wrong_type(f, node, where);
        } else if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::optional<bool>>) {
          const auto* b = node.as_boolean();
          if (!b) wrong_type(f, node, where);
          *p = b->get();
        } else if constexpr (std::is_same_v<T, std::string>) {
          const auto* s = node.as_string();
          if (!s) wrong_type(f, node, where);
          *p = s->get();
        } else {
          const auto* a = node.as_array();
          if (!a) wrong_type(f, node, where);
          std::vector<std::string> items;
          for (size_t i = 0; i < a->size(); ++i) {
            const auto* s = (*a)[i].as_string();
            if (!s)
              fail(fmt::format("{}: {}[{}] must be a string, got {}", where, f.name(), i, describe((*a)[i])),
                   example(f));
            items.push_back(s->get());
          }
          *p = std::move(items);
        }
      },
      f.target);
}

[[noreturn]] void unknown_section(std::string_view section, const std::string& where) {
  const std::vector<std::string_view> sections = section_names();
  const std::string_view near = closest(section, sections);
  fail(fmt::format("{}: unknown section [{}]", where, shown(section)),
       near.empty() ? fmt::format("sections are {}", join(sections)) : fmt::format("did you mean [{}]?", near));
}

// The field for section.key, or a one-line error suggesting what was probably meant.
Field& find_field(std::vector<Field>& fields, std::string_view section, std::string_view key,
                  const std::string& where) {
  const std::vector<std::string_view> sections = section_names();
  if (std::find(sections.begin(), sections.end(), section) == sections.end()) unknown_section(section, where);
  for (Field& f : fields)
    if (f.section == section && f.key == key) return f;
  const std::vector<std::string_view> keys = keys_of(section);
  std::string hint;
  if (const std::string_view near = closest(key, keys); !near.empty()) {
    hint = fmt::format("did you mean {}.{}?", section, near);
  } else {
    for (const Field& f : schema())
      if (f.key == key) hint = fmt::format("did you mean {}?", f.name());
    if (hint.empty()) hint = fmt::format("keys of [{}] are {}", section, join(keys));
  }
  fail(fmt::format("{}: unknown key {}.{}", where, section, shown(key)), hint);
}

std::string trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return "";
  const auto last = s.find_last_not_of(" \t\r\n");
  return std::string(s.substr(first, last - first + 1));
}

// One value written as TOML, or nullopt if the text is not exactly one TOML value.
std::optional<toml::table> parse_value(const std::string& raw) {
  if (raw.empty() || raw.find_first_of("\r\n") != std::string::npos) return std::nullopt;
  try {
    toml::table t = toml::parse("v = " + raw);
    if (t.size() == 1 && t.contains("v")) return t;
  } catch (const toml::parse_error&) {
  }
  return std::nullopt;
}


// ---- validation ----

void check(bool ok, std::string_view key, const std::string& problem, const std::string& hint = "") {
  if (!ok) fail(fmt::format("{} {}", key, problem), hint);
}

void check_one_of(std::string_view key, const std::string& value, std::initializer_list<std::string_view> options) {
  for (std::string_view o : options)
    if (value == o) return;
  std::string list;
  for (std::string_view o : options) list += (list.empty() ? "" : " | ") + std::string(o);
  fail(fmt::format("{} must be one of {}, got {}", key, list, toml_string(value)));
}

// Seeds are unsigned in the engine but written as TOML integers, which are signed 64-bit.
void check_seed(std::string_view key, uint64_t seed) {
  check(seed <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), key,
        fmt::format("must be < 2^63 to be written as a TOML integer, got {}", seed));
}

// Non-finite values pass or fail comparisons by accident; name them explicitly.
void check_finite(std::string_view key, double v) {
  check(std::isfinite(v), key, fmt::format("must be a finite number, got {}", v));
}

}  // namespace

RunConfig RunConfig::defaults() { return RunConfig{}; }

RunConfig RunConfig::from_toml(const std::string& text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    fail(fmt::format("{}:{}:{}: TOML syntax error: {}", source, e.source().begin.line, e.source().begin.column,
                     shown(e.description())),
         "see https://toml.io for the syntax");
  }
  const Origin origin{source, true};
  RunConfig config = defaults();
  std::vector<Field> fields = fields_of(config);
  const std::vector<std::string_view> sections = section_names();
  for (const auto& [name, node] : root) {
    const std::string where = origin.at(name.source());
    const auto* table = node.as_table();
    if (std::find(sections.begin(), sections.end(), name.str()) == sections.end()) {
      // A known key here was most likely written above its section header.
      if (!table)
        for (const Field& f : schema())
          if (f.key == name.str())
            fail(fmt::format("{}: key {} is outside any section", where, f.key),
                 fmt::format("put it under [{}]", f.section));
      unknown_section(name.str(), where);
    }
    if (!table)
      fail(fmt::format("{}: {} must be a table, got {}", where, name.str(), describe(node)),
           fmt::format("write [{}] on a line of its own and its keys below it", name.str()));
    for (const auto& [key, value] : *table) {
      const std::string key_where = origin.at(key.source());
      const Field& f = find_field(fields, name.str(), key.str(), key_where);
      assign(f, value, origin.at(value.source()));
    }
  }
  return config;
}

RunConfig RunConfig::from_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    fail(fmt::format("{}: is a directory, not a config file", path), "give the path of a .toml file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(fmt::format("{}: cannot open config file", path), "check the path given to --config");
  std::ostringstream text;
  text << in.rdbuf();
  return from_toml(text.str(), path);
}

void RunConfig::apply_override(const std::string& assignment) {
  const std::string where = "--set";
  const auto eq = assignment.find('=');
  if (eq == std::string::npos)
    fail(fmt::format("{} '{}': expected section.key=value", where, shown(assignment)), "e.g. --set optimizer.lr=1e-3");
  const std::string name = trim(std::string_view(assignment).substr(0, eq));
  const std::string raw = trim(std::string_view(assignment).substr(eq + 1));
  const auto dot = name.find('.');
  if (dot == std::string::npos) {
    std::string hint = "e.g. --set optimizer.lr=1e-3";
    for (const Field& f : schema())
      if (f.key == name) hint = fmt::format("did you mean {}?", f.name());
    fail(fmt::format("{} '{}': key '{}' has no section (write section.key)", where, shown(assignment), shown(name)),
         hint);
  }
  std::vector<Field> fields = fields_of(*this);
  const Field& f = find_field(fields, name.substr(0, dot), name.substr(dot + 1), where);

  const std::optional<toml::table> parsed = parse_value(raw);
  const toml::node* node = parsed ? parsed->get("v") : nullptr;
  const bool quoted_or_list = !raw.empty() && (raw[0] == '"' || raw[0] == '\'' || raw[0] == '[');
  if (auto* s = std::get_if<std::string*>(&f.target)) {
    // A path or a name given bare on the command line is the string itself.
    if (node && node->is_string()) **s = node->as_string()->get();
    else if (quoted_or_list)
      fail(fmt::format("{}: {} is not a valid TOML string: {}", where, f.name(), shown(raw)), example(f));
    else **s = raw;
    return;
  }
  if (auto* list = std::get_if<std::vector<std::string>*>(&f.target)) {
    if (node && node->is_array()) assign(f, *node, where);
    else if (node && node->is_string()) **list = {node->as_string()->get()};
    else if (quoted_or_list)
      fail(fmt::format("{}: {} is not a valid TOML list: {}", where, f.name(), shown(raw)), example(f));
    else **list = {raw};
    return;
  }
  if (!node)
    fail(fmt::format("{}: {} must be {}, got '{}'", where, f.name(), expected(f.target), shown(raw)), example(f));
  assign(f, *node, where);
}

void RunConfig::validate() const {
  check(!model.source.empty(), "model.source", "must not be empty",
        "a preset name, a config.json or a checkpoint directory");
  check_one_of("model.dtype", model.dtype, {"auto", "f64", "f32", "bf16"});
  check_seed("model.init_seed", model.init_seed);

  for (const std::string& p : data.train) check(!p.empty(), "data.train", "holds an empty path");
  for (const std::string& p : data.eval) check(!p.empty(), "data.eval", "holds an empty path");
  check_one_of("data.format", data.format, {"shard", "u16", "u32"});
  check_finite("data.eval_fraction", data.eval_fraction);
  check(data.eval_fraction >= 0 && data.eval_fraction < 1, "data.eval_fraction",
        fmt::format("must be in [0, 1), got {}", data.eval_fraction));
  check(data.seq_len >= 2, "data.seq_len", fmt::format("must be >= 2, got {}", data.seq_len));
  check(data.batch_size >= 1, "data.batch_size", fmt::format("must be >= 1, got {}", data.batch_size));
  check(data.grad_accum >= 1, "data.grad_accum", fmt::format("must be >= 1, got {}", data.grad_accum));
  check_seed("data.seed", data.seed);
  check(!data.tokenizer.empty(), "data.tokenizer", "must not be empty", "e.g. tokenizer = \"bytes\"");

  check_one_of("schedule.name", schedule.name, {"full", "checkpointed", "seco", "spaco"});
  check_one_of("schedule.recompute", schedule.recompute, {"full", "selective", "none"});
  check(schedule.mlp_shards >= 0, "schedule.mlp_shards", fmt::format("must be >= 0 (0: automatic), got {}", schedule.mlp_shards));
  check(schedule.offload_window >= 0, "schedule.offload_window",
        fmt::format("must be >= 0 (0: the whole K/V store on the device), got {}", schedule.offload_window));
  check(schedule.chunk >= 0, "schedule.chunk", fmt::format("must be >= 0, got {}", schedule.chunk));
  check(schedule.bwd_chunk >= 0, "schedule.bwd_chunk", fmt::format("must be >= 0, got {}", schedule.bwd_chunk));
  check(schedule.keep >= 0, "schedule.keep", fmt::format("must be >= 0, got {}", schedule.keep));
  check_seed("schedule.seed", schedule.seed);
  check_finite("schedule.relay_cap", schedule.relay_cap);
  check(schedule.relay_cap >= 0, "schedule.relay_cap", fmt::format("must be >= 0, got {}", schedule.relay_cap));
  // Name the first spaco-only option set on another schedule, rather than the whole group.
  if (schedule.name != "spaco") {
    const std::string why = fmt::format("is a spaco option; schedule.name is {}", toml_string(schedule.name));
    check(schedule.keep == 0, "schedule.keep", why, "set schedule.name = \"spaco\" or remove it");
    check(!schedule.stratified, "schedule.stratified", why, "set schedule.name = \"spaco\" or remove it");
    check(!schedule.scale_relay, "schedule.scale_relay", why, "set schedule.name = \"spaco\" or remove it");
    check(!schedule.drop_relay, "schedule.drop_relay", why, "set schedule.name = \"spaco\" or remove it");
  }
  // The schedule's own rules, should they grow beyond the ones above.
  schedule_options().validate();

  check_finite("optimizer.lr", optimizer.lr);
  check(optimizer.lr > 0, "optimizer.lr", fmt::format("must be > 0, got {}", optimizer.lr));
  check_finite("optimizer.min_lr", optimizer.min_lr);
  check(optimizer.min_lr >= 0, "optimizer.min_lr", fmt::format("must be >= 0, got {}", optimizer.min_lr));
  check_one_of("optimizer.decay", optimizer.decay, {"cosine", "linear", "constant"});
  // A constant rate never reaches min_lr, so only a decay makes the pair inconsistent.
  if (optimizer.decay != "constant")
    check(optimizer.min_lr <= optimizer.lr, "optimizer.min_lr",
          fmt::format("must be <= optimizer.lr ({}), got {}", optimizer.lr, optimizer.min_lr),
          "the decay goes from lr down to min_lr");
  check(optimizer.warmup_steps >= 0, "optimizer.warmup_steps",
        fmt::format("must be >= 0, got {}", optimizer.warmup_steps));
  check_finite("optimizer.beta1", optimizer.beta1);
  check(optimizer.beta1 >= 0 && optimizer.beta1 < 1, "optimizer.beta1",
        fmt::format("must be in [0, 1), got {}", optimizer.beta1));
  check_finite("optimizer.beta2", optimizer.beta2);
  check(optimizer.beta2 >= 0 && optimizer.beta2 < 1, "optimizer.beta2",
        fmt::format("must be in [0, 1), got {}", optimizer.beta2));
  check_finite("optimizer.eps", optimizer.eps);
  check(optimizer.eps > 0, "optimizer.eps", fmt::format("must be > 0, got {}", optimizer.eps));
  check_finite("optimizer.weight_decay", optimizer.weight_decay);
  check(optimizer.weight_decay >= 0, "optimizer.weight_decay",
        fmt::format("must be >= 0, got {}", optimizer.weight_decay));
  check_finite("optimizer.grad_clip", optimizer.grad_clip);
  check(optimizer.grad_clip >= 0, "optimizer.grad_clip",
        fmt::format("must be >= 0 (0: off), got {}", optimizer.grad_clip));

  check(train.steps >= 1, "train.steps", fmt::format("must be >= 1, got {}", train.steps));
  check_one_of("train.device", train.device, {"auto", "cpu", "cuda"});
  check_one_of("train.nonfinite", train.nonfinite, {"skip", "stop"});
  check(train.threads >= 0, "train.threads", fmt::format("must be >= 0 (0: all cores), got {}", train.threads));

  check(eval.every >= 0, "eval.every", fmt::format("must be >= 0 (0: never), got {}", eval.every));
  check(eval.batches >= 1, "eval.batches", fmt::format("must be >= 1, got {}", eval.batches));
  check(eval.every == 0 || !data.eval.empty() || data.eval_fraction > 0, "eval.every",
        fmt::format("is {} but there is no eval data (data.eval is empty and data.eval_fraction is 0)", eval.every),
        "set eval.every = 0, give data.eval, or set data.eval_fraction > 0");

  check(checkpoint.every >= 0, "checkpoint.every", fmt::format("must be >= 0 (0: never), got {}", checkpoint.every));
  check(checkpoint.keep_last >= 1, "checkpoint.keep_last", fmt::format("must be >= 1, got {}", checkpoint.keep_last));

  check(log.every >= 1, "log.every", fmt::format("must be >= 1, got {}", log.every));

  check(sample.tokens >= 0, "sample.tokens", fmt::format("must be >= 0 (0: no sample), got {}", sample.tokens));
  check_finite("sample.temperature", sample.temperature);
  check(sample.temperature >= 0, "sample.temperature",
        fmt::format("must be >= 0 (0: greedy), got {}", sample.temperature));
  check(sample.top_k >= 0, "sample.top_k", fmt::format("must be >= 0 (0: off), got {}", sample.top_k));
  check_finite("sample.top_p", sample.top_p);
  check(sample.top_p > 0 && sample.top_p <= 1, "sample.top_p", fmt::format("must be in (0, 1], got {}", sample.top_p));
  check_seed("sample.seed", sample.seed);
}

ScheduleOptions RunConfig::schedule_options() const {
  ScheduleOptions o;
  o.name = schedule.name;
  o.chunk = schedule.chunk;
  o.bwd_chunk = schedule.bwd_chunk;
  o.keep = schedule.keep;
  o.seed = schedule.seed;
  o.stratified = schedule.stratified;
  o.scale_loss = schedule.scale_loss;
  o.scale_relay = schedule.scale_relay;
  o.relay_cap = schedule.relay_cap;
  o.drop_relay = schedule.drop_relay;
  o.recompute = schedule.recompute;
  o.mlp_shards = schedule.mlp_shards;
  o.offload = schedule.offload;
  o.offload_window = schedule.offload_window;
  o.save_attention = schedule.save_attention;
  return o;
}

std::string RunConfig::to_toml() const {
  // The field table only reads through its pointers here.
  RunConfig& self = const_cast<RunConfig&>(*this);
  std::string out = "# chunkwise train: the resolved configuration of this run.\n";
  std::string_view section;
  for (const Field& f : fields_of(self)) {
    if (f.section != section) {
      section = f.section;
      out += fmt::format("\n[{}]\n", section);
    }
    if (const std::optional<std::string> v = toml_value(f.target))
      out += fmt::format("{} = {}\n", f.key, *v);
    else
      out += fmt::format("# {} is unset: as the model configures it\n", f.key);
  }
  return out;
}

nlohmann::json RunConfig::to_json() const {
  RunConfig& self = const_cast<RunConfig&>(*this);  // read only, as in to_toml
  nlohmann::json j = nlohmann::json::object();
  for (const Field& f : fields_of(self)) {
    nlohmann::json& slot = j[std::string(f.section)][std::string(f.key)];
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::optional<bool>>)
            slot = p->has_value() ? nlohmann::json(**p) : nlohmann::json(nullptr);
          else slot = *p;
        },
        f.target);
  }
  return j;
}

const char* const kDefaultRunToml = R"toml(# chunkwise train: the default run.
#
# Every key below is at its default value; a --config file need only name the keys it changes, and
# --set section.key=value overrides either (e.g. --set optimizer.lr=1e-3 --set data.train=my.bin).

[model]
# A preset name (tiny, small, ...), the path of an HF config.json (random initialisation), or an HF
# checkpoint directory (config.json + safetensors) to continue training from.
source = "small"
# Compute precision: auto (bf16 with f32 master weights on a GPU, f32 on the CPU) | f64 (CPU) | f32 | bf16 (GPU).
dtype = "auto"
# Seed of the random initialisation (unused when source is a checkpoint).
init_seed = 1234
# tie_embeddings = true    # unset: as the model config says; true/false overrides it

[data]
# Token files: paths and glob patterns, concatenated in order (globs sorted). "@demo" is the small
# built-in demo corpus.
train = ["@demo"]
# Held-out token files; when empty, the last eval_fraction of the training stream is held out.
eval = []
eval_fraction = 0.05
# File format: shard (llm.c, with header) | u16 | u32 (headerless ids).
format = "shard"
# Tokens per sequence, sequences per micro-batch, and micro-batches per optimizer step: a step sees
# seq_len * batch_size * grad_accum tokens.
seq_len = 256
batch_size = 8
grad_accum = 1
# Seed of the shuffle of training windows.
seed = 1
# Tokenizer for the sample's prompt and output.
tokenizer = "bytes"

[schedule]
# How gradients are computed: full (everything kept) | checkpointed (layer inputs kept, each layer
# recomputed before its backward) | seco (exact, chunk by chunk, keeping only K/V) | spaco (seco
# visiting a sample of the chunks on the way back).
name = "seco"
# Prefill chunk length (0: the whole sequence) and reverse-sweep chunk length (0: same as chunk).
chunk = 64
bwd_chunk = 0
# spaco only: chunks backpropagated per step (0: all), the sample's seed, sampling supervised and
# unsupervised chunks in proportion, and how the estimate is rescaled (see optim/schedule.h).
keep = 0
seed = 0
stratified = false
scale_loss = true
scale_relay = false
relay_cap = 0.0
drop_relay = false
# checkpointed: what is recomputed (full: everything but each layer's input; selective: only the
# MLP's [tokens, ffn] intermediates; none: nothing), and whether the kept layer inputs are offloaded
# to pinned host memory (GPU, recompute = full). Any
# schedule: the MLP in row shards, its [rows, F] intermediates recomputed per shard (1: untiled,
# 0: automatic, ceil(F / hidden)).
recompute = "full"
offload = false
mlp_shards = 1
# seco, spaco: K/V store layers kept on the GPU, the rest in pinned host memory (0: all on the GPU).
offload_window = 0
# seco, spaco: the prefill saves each layer's attention output and log-sum-exp (with the K/V store,
# offloaded with it), so the reverse sweep does not run the attention forward again.
save_attention = false

[optimizer]
# AdamW. The rate rises linearly from 0 over warmup_steps to lr, then decays to min_lr by the last
# step: cosine | linear | constant (stays at lr).
lr = 0.003
min_lr = 0.0003
warmup_steps = 20
decay = "cosine"
beta1 = 0.9
beta2 = 0.95
eps = 1e-8
# Decoupled weight decay.
weight_decay = 0.1
# Clip the global gradient L2 norm to this (0: no clipping).
grad_clip = 1.0

[train]
# Optimizer steps.
steps = 300
# auto (CUDA when available) | cpu | cuda.
device = "auto"
# A step whose loss or gradient is NaN/inf: skip it, or stop the run.
nonfinite = "skip"
# GPU: bitwise-reproducible gradients run to run. false lets the attention backward use cuDNN's
# fastest engine, which sums dQ with atomics (same values up to f32 rounding order).
deterministic = false
# CPU threads (0: all cores).
threads = 0

[eval]
# Evaluate every this many steps (0: never) on this many eval batches.
every = 50
batches = 8

[checkpoint]
# Save every this many steps (0: never), keeping the newest keep_last; resume continues from the
# run directory's latest checkpoint.
every = 100
keep_last = 2
resume = false

[log]
# Where the run writes its log, config, checkpoints and plots (empty: the trainer chooses).
run_dir = ""
# Log a line every this many steps; plot loss, learning rate and memory as loss.svg.
every = 1
plot = true

[sample]
# Text generated from the trained model at the end of the run (tokens = 0: none).
prompt = "The "
tokens = 200
# Sampling: temperature (0: greedy), top-k (0: off), nucleus top-p (1: off), seed.
temperature = 0.8
top_k = 40
top_p = 0.95
seed = 1
)toml";

}  // namespace cw
