#include "tools/cli_options.h"

#include "engine/error.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <type_traits>

namespace cw {

std::vector<CLI::Option*> add_option_flags(CLI::App& app, const std::vector<OptionRef>& options,
                                           std::initializer_list<std::string_view> except) {
  std::vector<CLI::Option*> added;
  for (const OptionRef& o : options) {
    if (o.flag.empty() || std::find(except.begin(), except.end(), o.key) != except.end()) {
      added.push_back(nullptr);
      continue;
    }
    const std::string flag(o.flag), help(o.help);
    added.push_back(std::visit(
        [&](auto* p) -> CLI::Option* {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, bool>) {
            if (!*p) return app.add_flag(flag, *p, help);
            return app.add_option(flag, *p, help)->capture_default_str();
          } else if constexpr (std::is_same_v<T, std::optional<bool>>) {
            fail(fmt::format("{}: an unset-able boolean has no command-line flag", o.name()));
          } else if constexpr (std::is_same_v<T, int64_t>) {
            CLI::Option* opt = app.add_option(flag, *p, help)->capture_default_str();
            // "auto" reads as kAuto where the rule takes it (the planner chooses the value); kAuto is
            // -1, so a negative count is refused rather than read as "auto".
            if (o.rule->or_auto)
              opt->transform(CLI::Validator(
                  [name = o.name(), rule = o.rule](std::string& v) {
                    if (v == "auto") {
                      v = std::to_string(kAuto);
                      return std::string();
                    }
                    if (!v.empty() && v[0] == '-')
                      return fmt::format("{} must be {}, got {} (write auto for the planner's choice)", name,
                                         rule->describe(), v);
                    return std::string();
                  },
                  "INT or auto"));
            return opt;
          } else if constexpr (std::is_enum_v<T>) {
            // A word option takes its word; any other word is a cw::Error naming the key and the words.
            return app
                .add_option_function<std::string>(
                    flag, [p](const std::string& word) { read_option_word(word, *p); }, help)
                ->default_str(std::string(option_word(*p)));
          } else {
            return app.add_option(flag, *p, help)->capture_default_str();
          }
        },
        o.target));
  }
  return added;
}

void add_schedule_flags(CLI::App& app, ScheduleOptions& schedule, std::initializer_list<std::string_view> except) {
  add_option_flags(app, bind_options("schedule", schedule_option_table(), schedule), except);
}

void add_lora_flags(CLI::App& app, LoraConfig& lora) {
  add_option_flags(app, bind_options("lora", lora_option_table(), lora));
}

void add_parallel_flags(CLI::App& app, ParallelOptions& parallel, std::initializer_list<std::string_view> except) {
  add_option_flags(app, bind_options("parallel", parallel_option_table(), parallel), except);
}

void copy_given_flags(const std::vector<CLI::Option*>& flags, const std::vector<OptionRef>& given,
                      const std::vector<OptionRef>& into) {
  CW_CHECK(flags.size() == given.size() && given.size() == into.size(), "copy_given_flags: {} flags, {} and {} options",
           flags.size(), given.size(), into.size());
  for (size_t i = 0; i < flags.size(); ++i)
    if (flags[i] && flags[i]->count() > 0) copy_option_value(into[i].target, given[i].target);
}

}  // namespace cw
