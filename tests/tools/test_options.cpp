// The option tables (optim/options.h): docs/options.md's table is the generated one (and
// docs/environment.md's tables the registry's, engine/env.h); every row
// round-trips through each of its spellings (CLI flag, TOML, --set, the resolved dump); every rule
// rejects a value that breaks it with a one-line message naming the key; train's flags win over
// --config and --set.
#include "optim/options.h"
#include "tools/cli_options.h"
#include "tools/train/run_config.h"

#include "engine/env.h"
#include "engine/error.h"

#include <CLI/CLI.hpp>
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace cw {
namespace {

// A valid value other than the option's current one, written into its target.
void change(const OptionRef& o) {
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) {
          *p += 3;  // integer rules are lower bounds only
        } else if constexpr (std::is_same_v<T, double>) {
          *p = o.rule->max ? (*p + *o.rule->max) / 2 : *p + 0.5;
        } else if constexpr (std::is_same_v<T, bool>) {
          *p = !*p;
        } else if constexpr (std::is_same_v<T, std::optional<bool>>) {
          *p = !p->value_or(true);
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (o.rule->words.empty()) *p = *p + " changed";
          else *p = std::string(o.rule->words[0] == *p ? o.rule->words[1] : o.rule->words[0]);
        } else if constexpr (std::is_enum_v<T>) {
          read_option_word(o.rule->words[0] == option_word(*p) ? o.rule->words[1] : o.rule->words[0], *p);
        } else {
          *p = {"a.bin", "dir with space/*.bin"};
        }
      },
      o.target);
}

// The value as a command-line argument (the text after the flag; booleans that are flags: none).
std::vector<std::string> cli_args(const OptionRef& o, const OptionTarget& value, bool default_value_of_bool) {
  std::vector<std::string> args{std::string(o.flag)};
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (default_value_of_bool) args.push_back(*p ? "true" : "false");  // an option taking a value
        } else if constexpr (std::is_same_v<T, std::string>) {
          args.push_back(*p);
        } else if constexpr (std::is_enum_v<T>) {
          args.emplace_back(option_word(*p));
        } else if constexpr (std::is_same_v<T, double> || std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) {
          args.push_back(fmt::format("{}", *p));
        }
      },
      value);
  return args;
}

// The lines of a document between the line holding `begin` and the line starting with `end`.
std::string generated_part(const char* document, const std::string& begin, const std::string& end) {
  std::ifstream f(std::filesystem::path(CW_SOURCE_ROOT) / document);
  std::stringstream text;
  text << f.rdbuf();
  const std::string s = text.str();
  const auto b = s.find(begin);
  const auto e = s.find(end);
  REQUIRE(b != std::string::npos);
  REQUIRE(e != std::string::npos);
  const auto first = s.find('\n', b) + 1;
  return s.substr(first, e - first);
}

TEST_CASE("options: docs/options.md's table is `chunkwise options --markdown`") {
  // On a mismatch: build/tools/chunkwise options --markdown, and paste it between the markers.
  CHECK(generated_part("docs/options.md", "<!-- options table:", "<!-- end of options table -->") ==
        RunConfig::options_markdown());
}

TEST_CASE("options: docs/environment.md's tables are `chunkwise options --env`") {
  // On a mismatch: build/tools/chunkwise options --env, and paste it between the markers.
  CHECK(generated_part("docs/environment.md", "<!-- environment tables:", "<!-- end of environment tables -->") ==
        env::tables_markdown());
}

TEST_CASE("options: every row of the run config round-trips through TOML, --set, the dump and its flag") {
  RunConfig all = RunConfig::defaults();
  const std::vector<OptionRef> all_options = all.options();
  for (size_t i = 0; i < all_options.size(); ++i) {
    RunConfig expected = RunConfig::defaults();
    const OptionRef o = expected.options()[i];
    INFO(o.name());
    change(o);
    change(all_options[i]);
    const std::string value = toml_value(o).value();
    // TOML.
    CHECK(RunConfig::from_toml(fmt::format("[{}]\n{} = {}\n", o.section, o.key, value), "one.toml") == expected);
    // --set, with the value as TOML.
    RunConfig set = RunConfig::defaults();
    set.apply_override(fmt::format("{}={}", o.name(), value));
    CHECK(set == expected);
    // The flag, where the row has one, as train applies it (after the file and --set).
    if (!o.flag.empty()) {
      RunConfig given = RunConfig::defaults();
      const std::vector<OptionRef> given_options = given.options();
      CLI::App app;
      const std::vector<CLI::Option*> flags = add_option_flags(app, given_options);
      std::vector<std::string> args = cli_args(o, o.target, std::get_if<bool*>(&o.target) && !**std::get_if<bool*>(&o.target));
      std::reverse(args.begin(), args.end());  // CLI11 takes argv reversed
      app.parse(args);
      RunConfig applied = RunConfig::defaults();
      copy_given_flags(flags, given_options, applied.options());
      CHECK(applied == expected);
    }
  }
  // Every value changed at once: the dump reads back to the same config.
  CHECK(all != RunConfig::defaults());
  CHECK(RunConfig::from_toml(all.to_toml(), "resolved.toml") == all);
  CHECK(RunConfig::from_toml(all.commented_toml(), "commented.toml") == all);
}

TEST_CASE("options: the schedule's flags (bench, gradcheck, plan) write every ScheduleOptions field") {
  const std::vector<Option<ScheduleOptions>>& table = schedule_option_table();
  for (size_t i = 0; i < table.size(); ++i) {
    ScheduleOptions expected;
    const OptionRef o = bind_options("schedule", table, expected)[i];
    INFO(o.name());
    REQUIRE(!o.flag.empty());
    const bool default_true_bool = std::get_if<bool*>(&o.target) && **std::get_if<bool*>(&o.target);
    change(o);
    ScheduleOptions parsed;
    CLI::App app;
    add_schedule_flags(app, parsed);
    std::vector<std::string> args = cli_args(o, o.target, default_true_bool);
    std::reverse(args.begin(), args.end());
    app.parse(args);
    CHECK(parsed == expected);
  }
  // An excepted key gets no flag (a command that spells it itself).
  ScheduleOptions s;
  CLI::App app;
  add_schedule_flags(app, s, {"chunk"});
  CHECK(app.get_option_no_throw("--chunk") == nullptr);
  CHECK(app.get_option_no_throw("--keep") != nullptr);
}

TEST_CASE("options: the schedule's name is its kind, recompute its mode; another word is one line naming the key") {
  const std::vector<std::string_view> names = schedule_names();
  REQUIRE(names.size() == 4);
  for (size_t i = 0; i < names.size(); ++i) {
    const ScheduleKind kind = static_cast<ScheduleKind>(i);
    CHECK(schedule_name(kind) == names[i]);
    CHECK(parse_schedule_kind(names[i]) == kind);
    const ScheduleOptions o{.kind = kind};
    CHECK(o.chunked() == (kind == ScheduleKind::seco || kind == ScheduleKind::spaco));
  }
  const std::vector<std::string_view> modes = recompute_names();
  REQUIRE(modes.size() == 4);
  for (size_t i = 0; i < modes.size(); ++i) {
    const RecomputeMode mode = static_cast<RecomputeMode>(i);
    CHECK(recompute_name(mode) == modes[i]);
    CHECK(parse_recompute_mode(modes[i]) == mode);
  }
  CHECK(recompute_name(RecomputeMode::automatic) == "auto");
  // automatic resolves by the schedule: checkpointed recomputes every layer, the others keep everything.
  CHECK(ScheduleOptions{.kind = ScheduleKind::checkpointed}.recompute_mode() == RecomputeMode::full);
  CHECK(ScheduleOptions{.kind = ScheduleKind::seco}.recompute_mode() == RecomputeMode::none);
  CHECK_THROWS_WITH_AS(parse_schedule_kind("SeCO"),
                       doctest::Contains("schedule.name must be one of full | checkpointed | seco | spaco, got \"SeCO\""),
                       Error);
  CHECK_THROWS_WITH_AS(parse_recompute_mode("partial"),
                       doctest::Contains("schedule.recompute must be one of auto | full | selective | none, got "
                                         "\"partial\""),
                       Error);
  // The table's rules list the same words, and every reader refuses another: TOML, --set, the flag.
  struct Bad {
    const char* key;
    const char* flag;
    const char* word;
    const char* error;
  };
  for (const Bad& b : {Bad{"name", "--schedule", "fast", "schedule.name must be one of full | checkpointed | seco | "
                                                         "spaco, got \"fast\""},
                       Bad{"recompute", "--recompute", "partial", "schedule.recompute must be one of auto | full | "
                                                                  "selective | none, got \"partial\""}}) {
    INFO(b.key);
    CHECK_THROWS_WITH_AS(RunConfig::from_toml(fmt::format("[schedule]\n{} = \"{}\"\n", b.key, b.word), "bad.toml"),
                         doctest::Contains(b.error), Error);
    RunConfig c = RunConfig::defaults();
    CHECK_THROWS_WITH_AS(c.apply_override(fmt::format("schedule.{}={}", b.key, b.word)), doctest::Contains(b.error),
                         Error);
    ScheduleOptions parsed;
    CLI::App app;
    add_schedule_flags(app, parsed);
    const auto parse_flag = [&] { app.parse(std::vector<std::string>{b.word, b.flag}); };  // argv reversed
    CHECK_THROWS_WITH_AS(parse_flag(), doctest::Contains(b.error), Error);
  }
}

TEST_CASE("options: chunk and offload_window take auto in TOML, --set and their flags, and dump it back") {
  RunConfig c = RunConfig::from_toml("[schedule]\nname = \"seco\"\nchunk = \"auto\"\n", "auto.toml");
  CHECK(c.schedule.chunk == kAuto);
  c.apply_override("schedule.offload_window=auto");
  CHECK(c.schedule.offload_window == kAuto);
  c.validate();
  CHECK(c.to_toml().find("chunk = \"auto\"") != std::string::npos);
  CHECK(RunConfig::from_toml(c.to_toml(), "resolved.toml") == c);
  ScheduleOptions parsed;
  CLI::App app;
  add_schedule_flags(app, parsed);
  app.parse(std::vector<std::string>{"auto", "--offload-window", "auto", "--chunk"});  // argv reversed
  CHECK(parsed.chunk == kAuto);
  CHECK(parsed.offload_window == kAuto);
  // Other integers do not take it; auto is for the chunked schedules; a schedule never sees it.
  CHECK_THROWS_WITH_AS(c.apply_override("schedule.keep=auto"), doctest::Contains("schedule.keep"), Error);
  CHECK_THROWS_WITH_AS(c.apply_override("schedule.chunk=-2"); c.validate(), doctest::Contains("schedule.chunk"), Error);
  RunConfig full = RunConfig::defaults();
  full.apply_override("schedule.name=full");
  full.apply_override("schedule.chunk=auto");
  CHECK_THROWS_WITH_AS(full.validate(), doctest::Contains("seco and spaco"), Error);
  ScheduleOptions unresolved{.kind = ScheduleKind::seco, .chunk = kAuto};
  CHECK_THROWS_WITH_AS(Schedule::create(unresolved), doctest::Contains("planner"), Error);
}

TEST_CASE("options: the LoRA flags (bench, gradcheck, plan) write every LoraConfig field") {
  const std::vector<Option<LoraConfig>>& table = lora_option_table();
  for (size_t i = 0; i < table.size(); ++i) {
    LoraConfig expected;
    const OptionRef o = bind_options("lora", table, expected)[i];
    INFO(o.name());
    REQUIRE(!o.flag.empty());
    change(o);
    LoraConfig parsed;
    CLI::App app;
    add_lora_flags(app, parsed);
    std::vector<std::string> args = cli_args(o, o.target, false);
    std::reverse(args.begin(), args.end());
    app.parse(args);
    CHECK(parsed == expected);
  }
  // The rules between the options: targets need a rank, and every target must be known.
  LoraConfig l;
  l.targets = "q_proj";
  CHECK_THROWS_WITH_AS(validate_lora(l), doctest::Contains("lora.targets = \"q_proj\" but lora.rank is 0"), Error);
  l.rank = 8;
  l.targets = "q_proj,o_proj,lm_head";
  CHECK_THROWS_WITH_AS(validate_lora(l), doctest::Contains("lora.targets: unknown LoRA target 'lm_head'"), Error);
  RunConfig rc = RunConfig::defaults();
  rc.apply_override("lora.targets=v_proj");
  CHECK_THROWS_WITH_AS(rc.validate(), doctest::Contains("lora.rank is 0"), Error);
  rc.apply_override("lora.rank=4");
  CHECK_NOTHROW(rc.validate());
}

TEST_CASE("options: every rule rejects a value that breaks it, naming the key") {
  const size_t n = RunConfig::defaults().options().size();
  int checked = 0;
  for (size_t i = 0; i < n; ++i) {
    RunConfig c = RunConfig::defaults();
    const OptionRef o = c.options()[i];
    const OptionRule& r = *o.rule;
    bool broken = true;
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, int64_t>) {
            if (r.min) *p = static_cast<int64_t>(*r.min) - (r.or_auto ? 2 : 1);  // -1 is auto there
            else broken = false;
          } else if constexpr (std::is_same_v<T, uint64_t>) {
            *p = uint64_t(1) << 63;  // not a TOML integer
          } else if constexpr (std::is_same_v<T, double>) {
            if (r.max) *p = r.max_open ? *r.max : *r.max + 1;
            else if (r.min) *p = r.min_open ? *r.min : *r.min - 1;
            else *p = std::numeric_limits<double>::quiet_NaN();
          } else if constexpr (std::is_same_v<T, std::string>) {
            if (!r.words.empty()) *p = "bogus";
            else if (r.non_empty) *p = "";
            else broken = false;
          } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
            if (r.no_empty_path) *p = {"a.bin", ""};
            else broken = false;
          } else {
            broken = false;
          }
        },
        o.target);
    if (!broken) continue;
    INFO(o.name());
    ++checked;
    std::string message;
    try {
      c.validate();
    } catch (const Error& e) {
      message = e.what();
    }
    CHECK(message.find(o.name() + " ") != std::string::npos);
    CHECK(message.find('\n') == std::string::npos);
    if (o.section == "schedule") {  // the same from ScheduleOptions alone (bench, gradcheck)
      CHECK_THROWS_WITH_AS(c.schedule.validate(), doctest::Contains(o.name().c_str()), Error);
    }
  }
  CHECK(checked >= 30);
  // Non-finite numbers, for every number.
  for (size_t i = 0; i < n; ++i) {
    RunConfig c = RunConfig::defaults();
    const OptionRef o = c.options()[i];
    if (auto* p = std::get_if<double*>(&o.target)) {
      INFO(o.name());
      **p = std::numeric_limits<double>::infinity();
      CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains((o.name() + " must be a finite number").c_str()), Error);
    }
  }
  // One past the upper bound, for every count that has one: every count of a size or a number of
  // steps, ranks or layers has one (optim/options.h).
  int bounded = 0;
  for (size_t i = 0; i < n; ++i) {
    RunConfig c = RunConfig::defaults();
    const OptionRef o = c.options()[i];
    if (auto* p = std::get_if<int64_t*>(&o.target); p && o.rule->max) {
      INFO(o.name());
      ++bounded;
      **p = static_cast<int64_t>(*o.rule->max) + 1;
      CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains((o.name() + " must be in [").c_str()), Error);
    }
  }
  CHECK(bounded >= 20);
}

TEST_CASE("options: train's flags are applied after --config and --set; flags not given change nothing") {
  RunConfig given = RunConfig::defaults();
  const std::vector<OptionRef> given_options = given.options();
  CLI::App app;
  const std::vector<CLI::Option*> flags = add_option_flags(app, given_options);
  app.parse(std::vector<std::string>{"cpu", "--device", "32", "--chunk", "--deterministic"});
  RunConfig rc = RunConfig::from_toml("[schedule]\nchunk = 16\nbwd_chunk = 8\n[train]\ndevice = \"cuda\"\n", "cfg.toml");
  rc.apply_override("train.steps=5");
  copy_given_flags(flags, given_options, rc.options());
  CHECK(rc.schedule.chunk == 32);
  CHECK(rc.schedule.bwd_chunk == 8);
  CHECK(rc.train.device == "cpu");
  CHECK(rc.train.deterministic);
  CHECK(rc.train.steps == 5);
  CHECK(rc.schedule.kind == ScheduleKind::seco);
}

}  // namespace
}  // namespace cw
