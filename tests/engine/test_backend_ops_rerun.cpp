// Selecting rows of the op table and repeating one run (tests/engine/backend_ops.h).
//
// Seeds: each run draws a fresh seed; operand i of a row draws from (seed, i) alone, so a row's
// inputs do not depend on which rows ran before it or were left out. Every check logs the one line
// that repeats exactly its run of its row (no variant for the CPU runners; a comma in the runner's
// name escaped for doctest's filter):
//   rerun: CW_TEST_SEED=<n> CW_TEST_ROW='<row>' CW_TEST_DTYPE=<dt> CW_TEST_VARIANT='<variant>' <binary> -tc='<runner>'
// The variables, each unset or empty taking everything: CW_TEST_SEED=<n> the seed; CW_TEST_OPS=<text>
// the rows whose name contains the text (or any of several, written <text>|<text>|...); CW_TEST_ROW=<name> the row of exactly this name;
// CW_TEST_DTYPE=f64|f32|bf16 the tested dtype; CW_TEST_VARIANT=<name> the GPU variant of exactly this
// name; CW_TEST_MAX_ELEMENTS=<n> the rows whose largest operand holds at most n elements,
// CW_TEST_MIN_ELEMENTS=<n> those whose largest holds more (the two at one n split the table in two).
// CW_TEST_TRACE=1 prints each run's rerun line as it starts; CW_TEST_POISON_SCRATCH=1 fills a GPU
// run's scratch arena and cuBLASLt's workspace with NaN bytes before every call (an op reading scratch
// it did not write then fails every time). tools/op-check-loop runs the GPU runner many times, under compute-sanitizer, or
// one rerun line many times (tests/README.md).
#include "tests/engine/backend_ops.h"

#include "engine/random.h"
#include "tests/gpu_support.h"

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace cw::test::op_table {

// CW_TEST_POISON_SCRATCH=1: GPU runs fill their scratch arena's first block with 0xff bytes (NaN as
// f32 or bf16, -1 as i32) before every call, so an op that reads scratch before writing it fails in
// every run instead of only when an earlier row left unlucky values in the reused block.
bool poison_scratch_on() {
  static const bool on = [] {
    const char* e = std::getenv(kPoisonVar);
    return e != nullptr && std::string(e) == "1";
  }();
  return on;
}

namespace {

uint64_t parse_count(const char* var, const char* text) {
  const std::string s = text;
  CW_CHECK(!s.empty() && s.find_first_not_of("0123456789") == std::string::npos && s.size() <= 20,
           "test_backend_ops: {}='{}' is no unsigned decimal number: give digits only (a seed as a rerun line prints it)",
           var, s);
  errno = 0;
  const unsigned long long v = std::strtoull(s.c_str(), nullptr, 10);
  CW_CHECK(errno == 0, "test_backend_ops: {}='{}' is out of range for 64 bits", var, s);
  return v;
}

// `text` as one shell word in single quotes (a quote inside written '\'').
std::string shell_quote(const std::string& text) {
  std::string q = "'";
  for (const char c : text) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// The shell words of `line`: blanks split, single quotes keep everything up to the next quote,
// a backslash outside quotes keeps the next character (what shell_quote writes, and plain words).
std::vector<std::string> shell_words(const std::string& line) {
  std::vector<std::string> words;
  std::string word;
  bool in_word = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (c == ' ' || c == '\t') {
      if (in_word) words.push_back(word);
      word.clear(), in_word = false;
    } else if (c == '\'') {
      const size_t end = line.find('\'', i + 1);
      CW_CHECK(end != std::string::npos, "test_backend_ops: rerun line has an unclosed quote: {}", line);
      word += line.substr(i + 1, end - i - 1), in_word = true, i = end;
    } else if (c == '\\' && i + 1 < line.size()) {
      word += line[++i], in_word = true;
    } else {
      word += c, in_word = true;
    }
  }
  if (in_word) words.push_back(word);
  return words;
}

// A doctest -tc filter that matches exactly `name`: commas (which separate filters) and backslashes
// escaped with a backslash; and back.
std::string doctest_filter(const std::string& name) {
  std::string f;
  for (const char c : name) f += c == ',' || c == '\\' ? std::string{'\\', c} : std::string(1, c);
  return f;
}
std::string unescape_filter(const std::string& filter) {
  std::string name;
  for (size_t i = 0; i < filter.size(); ++i) name += filter[i] == '\\' && i + 1 < filter.size() ? filter[++i] : filter[i];
  return name;
}

}  // namespace

int64_t largest_operand(const Row& row) {
  int64_t largest = 0;
  for (const Arg& a : row.args) {
    int64_t n = 1;
    for (size_t d = 0; d < a.shape.size(); ++d) n *= d == 1 && a.store > 0 ? a.store : a.shape[d];
    largest = std::max(largest, n);
  }
  return largest;
}

Selection Selection::from(const VarLookup& get) {
  Selection s;
  const auto text = [&](const char* var) {
    const char* v = get(var);
    return std::string(v != nullptr ? v : "");
  };
  s.contains = text(kOpsVar), s.row = text(kRowVar), s.dtype = text(kDtypeVar), s.variant = text(kVariantVar);
  if (!s.dtype.empty())
    CW_CHECK(s.dtype == "f64" || s.dtype == "f32" || s.dtype == "bf16",
             "test_backend_ops: {}='{}' is no tested dtype: give f64, f32 or bf16", kDtypeVar, s.dtype);
  if (const std::string m = text(kMaxElementsVar); !m.empty())
    s.max_elements = static_cast<int64_t>(parse_count(kMaxElementsVar, m.c_str()));
  if (const std::string m = text(kMinElementsVar); !m.empty())
    s.min_elements = static_cast<int64_t>(parse_count(kMinElementsVar, m.c_str()));
  return s;
}
Selection Selection::from_env() {
  return from([](const char* var) -> const char* { return std::getenv(var); });
}

// Whether `name` contains `texts` or, where it holds '|', any of the texts between them (no row name
// holds a '|', so a group of rows can be taken in one run).
bool contains_any(const std::string& name, const std::string& texts) {
  for (size_t begin = 0;;) {
    const size_t end = texts.find('|', begin);
    const std::string_view text = std::string_view(texts).substr(begin, end == std::string::npos ? end : end - begin);
    if (!text.empty() && name.find(text) != std::string::npos) return true;
    if (end == std::string::npos) return false;
    begin = end + 1;
  }
}

bool Selection::takes(const Row& r) const {
  return (contains.empty() || contains_any(r.name, contains)) && (row.empty() || r.name == row) &&
         (max_elements == 0 || largest_operand(r) <= max_elements) && (min_elements == 0 || largest_operand(r) > min_elements);
}
bool Selection::takes(DType dt) const { return dtype.empty() || dtype == dtype_name(dt); }
bool Selection::takes(const Variant& v) const { return variant.empty() || variant == v.name; }
// CW_TEST_ROW takes the first row of its name: a name states the op and every size, so rows of one
// name run the same calls on the same draws (the table lists one twice: a CPU row that the GPU's
// head-dim loop repeats).
std::vector<Row> select_rows(std::vector<Row> all, const Selection& s) {
  std::vector<Row> picked;
  for (Row& r : all)
    if (s.takes(r) && (s.row.empty() || picked.empty())) picked.push_back(std::move(r));
  CW_CHECK(s.row.empty() || !picked.empty(),
           "test_backend_ops: {}='{}' names no row of the op table{}: copy the name from a rerun line, or take the "
           "rows whose name contains a text with {}=<text>",
           kRowVar, s.row, s.contains.empty() && s.max_elements == 0 && s.min_elements == 0 ? "" : " that the other variables leave", kOpsVar);
  if (!s.variant.empty()) {
    bool known = false;
    for (const Row& r : picked)
      for (const Variant& v : r.variants) known = known || v.name == s.variant;
    CW_CHECK(known || picked.empty(),
             "test_backend_ops: {}='{}' is no variant of the selected rows: give one a rerun line names (e.g. "
             "'cuda', 'flash-mma (atomic dQ)')",
             kVariantVar, s.variant);
  }
  return picked;
}

// The rows this run takes (the selection of the environment).
const std::vector<Row>& table() {
  static const std::vector<Row> rows = select_rows(build_table(), Selection::from_env());
  return rows;
}

// The seed of this run: CW_TEST_SEED, else a fresh one. Every row draws from (seed, operand index)
// alone, so a row's inputs are the same whichever rows run before it or are left out.
uint64_t run_seed() {
  static const uint64_t seed = []() -> uint64_t {
    if (const char* e = std::getenv(kSeedVar); e != nullptr && *e != '\0') return parse_count(kSeedVar, e);
    return mix64(std::random_device{}() ^ static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  }();
  return seed;
}

// This test binary as the rerun line names it: relative to the working directory when below it.
std::string test_binary() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "chunkwise-tests";
  const std::filesystem::path rel = exe.lexically_relative(std::filesystem::current_path(ec));
  return !ec && !rel.empty() && *rel.begin() != ".." ? rel.string() : exe.string();
}

// The one line that repeats a runner's run of one row, to paste into a shell:
//   rerun: CW_TEST_SEED=<n> CW_TEST_ROW='<row>' CW_TEST_DTYPE=<dt> [CW_TEST_VARIANT='<v>']
//          [CW_TEST_POISON_SCRATCH=1] <binary> -tc='<runner>'
std::string rerun_line(const Rerun& r, const std::string& binary) {
  std::string line = fmt::format("rerun: {}={} {}={} {}={}", kSeedVar, r.seed, kRowVar, shell_quote(r.row), kDtypeVar, r.dtype);
  if (!r.variant.empty()) line += fmt::format(" {}={}", kVariantVar, shell_quote(r.variant));
  if (r.poison) line += fmt::format(" {}=1", kPoisonVar);
  const bool plain = binary.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_./-+") ==
                     std::string::npos && !binary.empty();
  return line + fmt::format(" {} -tc={}", plain ? binary : shell_quote(binary), shell_quote(doctest_filter(r.runner)));
}

// The rerun line of a runner's run of a row, as context for every check of the run; with
// CW_TEST_TRACE=1 also printed as the run starts ("op-table: rerun: ..."), so that what another tool
// prints meanwhile (a compute-sanitizer report) follows the row it concerns.
std::string rerun_of(const char* runner, const Row& row, DType dt, const Variant* variant, uint64_t seed) {
  static const std::string binary = test_binary();
  static const bool trace = [] {
    const char* e = std::getenv(kTraceVar);
    return e != nullptr && std::string(e) == "1";
  }();
  std::string line = rerun_line(
      {seed, runner, row.name, dtype_name(dt), variant != nullptr ? variant->name : "", poison_scratch_on()}, binary);
  if (trace) {
    std::printf("op-table: %s\n", line.c_str());
    std::fflush(stdout);
  }
  return line;
}

namespace {

// A rerun line read back: its variables (to select as the environment would) and its run.
struct ParsedRerun {
  std::map<std::string, std::string> vars;
  std::string binary;
  Rerun run;
};
ParsedRerun parse_rerun(const std::string& line) {
  ParsedRerun p;
  for (const std::string& w : shell_words(line)) {
    if (w == "rerun:") continue;
    if (w.rfind("CW_TEST_", 0) == 0 && w.find('=') != std::string::npos) p.vars[w.substr(0, w.find('='))] = w.substr(w.find('=') + 1);
    else if (w.rfind("-tc=", 0) == 0) p.run.runner = unescape_filter(w.substr(4));
    else if (p.binary.empty()) p.binary = w;
  }
  const auto var = [&](const char* name) { return p.vars.count(name) ? p.vars.at(name) : std::string(); };
  CW_CHECK(!var(kSeedVar).empty() && !var(kRowVar).empty() && !p.run.runner.empty(),
           "test_backend_ops: '{}' is no rerun line: it needs {}, {} and -tc (copy it whole from a failure)", line,
           kSeedVar, kRowVar);
  p.run.seed = parse_count(kSeedVar, var(kSeedVar).c_str());
  p.run.row = var(kRowVar), p.run.dtype = var(kDtypeVar), p.run.variant = var(kVariantVar);
  p.run.poison = var(kPoisonVar) == "1";
  return p;
}

// A deep copy of each value (empty where the operand is not given).
std::vector<OwnedTensor> copies(const std::vector<OwnedTensor>& values) {
  std::vector<OwnedTensor> c(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    if (values[i].tensor.data != nullptr) {
      c[i] = OwnedTensor::of_shape(values[i].tensor.dtype, shape_of(values[i].tensor));
      copy_convert(c[i], values[i]);
    }
  return c;
}

// The selection a parsed rerun line makes, read through the same code as the environment.
Selection selection_of(const ParsedRerun& p) {
  return Selection::from([&](const char* var) -> const char* {
    const auto it = p.vars.find(var);
    return it == p.vars.end() ? nullptr : it->second.c_str();
  });
}

}  // namespace

TEST_CASE("backend ops: a rerun line reads back as the run it names, for every row, dtype and variant") {
  // A rerun line selects exactly one row by its name.
  const std::vector<Row> all = build_table();
  int lines = 0;
  for (const Row& row : all)
    for (const DType dt : row.gpu_dtypes)
      for (const Variant& v : row.variants) {
        const Rerun run{run_seed(), kCudaRunner, row.name, dtype_name(dt), v.name};
        const std::string line = rerun_line(run, "build/tests/chunkwise-tests");
        INFO(line);
        const ParsedRerun parsed = parse_rerun(line);
        CHECK(parsed.run == run);
        CHECK(parsed.binary == "build/tests/chunkwise-tests");
        CHECK(selection_of(parsed) == run.selection());
        const std::vector<Row> picked = select_rows(build_table(), selection_of(parsed));
        REQUIRE(picked.size() == 1);
        CHECK(picked[0].name == row.name);
        ++lines;
      }
  CHECK(lines > 0);
  // A runner whose name holds a comma (doctest's filter separator) is named with it escaped.
  const Rerun contract{7, kCpuContractRunner, all.front().name, "f64", ""};
  const std::string contract_line = rerun_line(contract, "b");
  CHECK(contains(contract_line, "-tc='backend ops: cpu contract\\, every operand"));
  CHECK(parse_rerun(contract_line).run == contract);
  // No name holds a quote, so tools/op-check-loop reads the quoted names back with a plain pattern.
  for (const Row& row : all) {
    CHECK(row.name.find('\'') == std::string::npos);
    for (const Variant& v : row.variants) CHECK(v.name.find('\'') == std::string::npos);
  }
  // Quotes, backslashes and runs of blanks in a name survive; the binary may hold a blank too.
  const Rerun odd{18446744073709551615ull, kCpuF32Runner, "it's  a \\ row (p=0) [x, y)", "f32", "a 'variant'", true};
  const ParsedRerun parsed = parse_rerun(rerun_line(odd, "/opt/my build/chunkwise-tests"));
  CHECK(parsed.run == odd);
  CHECK(parsed.binary == "/opt/my build/chunkwise-tests");
}

TEST_CASE("backend ops: a mistyped selection or rerun line is an error naming its variable") {
  const auto select = [](std::map<std::string, std::string> vars) {
    return cw::test::error_of([&] {
      select_rows(build_table(), selection_of(ParsedRerun{std::move(vars), "", {}}));
    });
  };
  CHECK(contains(select({{kRowVar, "rmsnorm N=5"}}), kRowVar));  // a part of a name is no name
  CHECK(contains(select({{kRowVar, "rmsnorm N=5 C=8"}, {kVariantVar, "flash"}}), kVariantVar));
  CHECK(contains(select({{kDtypeVar, "fp16"}}), kDtypeVar));
  CHECK(contains(select({{kMaxElementsVar, "many"}}), kMaxElementsVar));
  CHECK(contains(select({{kMinElementsVar, "-3"}}), kMinElementsVar));
  CHECK(contains(cw::test::error_of([] { parse_rerun("rerun: CW_TEST_SEED=12x CW_TEST_ROW='r' b -tc='t'"); }), kSeedVar));
  CHECK(contains(cw::test::error_of([] { parse_rerun("CW_TEST_ROW='rmsnorm N=5 C=8' b -tc='t'"); }), "no rerun line"));
  CHECK(contains(cw::test::error_of([] { parse_rerun("rerun: CW_TEST_SEED=1 CW_TEST_ROW='r b"); }), "unclosed quote"));
  // Alternatives in CW_TEST_OPS take the rows of each; an empty alternative takes nothing.
  Selection either;
  either.contains = "rmsnorm N=5 C=8|adamw";
  const std::vector<Row> picked = select_rows(build_table(), either);
  CHECK(picked.size() >= 2);
  for (const Row& r : picked) CHECK((contains(r.name, "rmsnorm N=5 C=8") || contains(r.name, "adamw")));
  either.contains = "no such row|";
  CHECK(select_rows(build_table(), either).empty());
  // The size bound keeps small rows and leaves the large ones.
  Selection bounded;
  bounded.max_elements = 300000;
  const std::vector<Row> small = select_rows(build_table(), bounded);
  CHECK_FALSE(small.empty());
  CHECK(small.size() < build_table().size());
  for (const Row& r : small) CHECK(largest_operand(r) <= 300000);
  // ... and the lower bound at the same size takes exactly the rows it left.
  Selection large;
  large.min_elements = 300000;
  const std::vector<Row> big = select_rows(build_table(), large);
  CHECK_FALSE(big.empty());
  CHECK(small.size() + big.size() == build_table().size());
  for (const Row& r : big) CHECK(largest_operand(r) > 300000);
}

TEST_CASE("backend ops: a row rerun from its line draws the very inputs of the whole-table run") {
  // The whole CPU f32 table in order, as its runner runs it, keeping what every row drew; then rows
  // rerun alone from their rerun lines must draw the same bits (a row's inputs depend on no other row).
  // A fixed seed: the property holds for any seed, and this one's comparisons are known to pass, so
  // this case fails only for what it checks.
  constexpr uint64_t seed = 12345;
  std::map<std::string, std::vector<OwnedTensor>> whole;
  Outcome outcome;
  std::vector<std::string> cpu_rows;
  for (const Row& row : build_table())
    if (row.cpu) {
      compare_run(kCpuF32Runner, row, Device::host(), DType::f32, kCuda, seed, outcome,
                  [&](const Row& r, const std::vector<OwnedTensor>& v) { whole[r.name] = copies(v); });
      cpu_rows.push_back(row.name);
    }
  REQUIRE(cpu_rows.size() > 2);
  // The first row, one from the middle, the last (ids, labels, K/V stores and state among them).
  for (const std::string& name : {cpu_rows.front(), cpu_rows[cpu_rows.size() / 2], cpu_rows.back()}) {
    const Rerun run{seed, kCpuF32Runner, name, "f32", ""};
    const std::string line = rerun_line(run, test_binary());
    INFO(line);
    const ParsedRerun parsed = parse_rerun(line);
    REQUIRE(parsed.run == run);
    const std::vector<Row> rows = select_rows(build_table(), selection_of(parsed));
    REQUIRE(rows.size() == 1);
    std::vector<OwnedTensor> alone;
    Outcome rerun_outcome;
    compare_run(parsed.run.runner.c_str(), rows[0], Device::host(), parse_dtype(parsed.run.dtype), kCuda,
                parsed.run.seed, rerun_outcome, [&](const Row&, const std::vector<OwnedTensor>& v) { alone = copies(v); });
    const std::vector<OwnedTensor>& before = whole.at(name);
    REQUIRE(alone.size() == before.size());
    int given = 0;
    for (size_t i = 0; i < alone.size(); ++i) {
      INFO(rows[0].args[i].name);
      CHECK((alone[i].tensor.data == nullptr) == (before[i].tensor.data == nullptr));
      if (alone[i].tensor.data == nullptr || before[i].tensor.data == nullptr) continue;
      CHECK(same_bits(alone[i], before[i]));
      ++given;
    }
    CHECK(given > 0);
  }
}

}  // namespace cw::test::op_table
