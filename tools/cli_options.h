// Command-line flags made from option tables (optim/options.h): the spelling, help and accepted
// values of each flag come from its row, its default from the bound struct's current value.
#pragma once

#include "optim/options.h"
#include "optim/schedule.h"

#include <initializer_list>
#include <string_view>
#include <vector>

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace cw {

// A flag for every option that names one, writing into the bound struct. A boolean that is false
// is a plain flag (--offload); one that is true takes a value (--scale-loss false). `except`: keys
// the caller spells itself. Returns each option's CLI option, nullptr where it added none.
std::vector<CLI::Option*> add_option_flags(CLI::App& app, const std::vector<OptionRef>& options,
                                           std::initializer_list<std::string_view> except = {});

// The schedule's flags (--schedule, --chunk, ..., spaco's included), writing into `schedule`.
void add_schedule_flags(CLI::App& app, ScheduleOptions& schedule, std::initializer_list<std::string_view> except = {});

// The LoRA flags (--lora-rank, --lora-alpha, --lora-dropout, --lora-targets, --lora-seed), writing into `lora`.
void add_lora_flags(CLI::App& app, LoraConfig& lora);

// The data/tensor-parallel flags (--dp, --zero, --bucket-mb, ...), writing into `parallel`.
void add_parallel_flags(CLI::App& app, ParallelOptions& parallel, std::initializer_list<std::string_view> except = {});

// For each option whose flag was given on the command line, copies its value from `given` (where
// the flags wrote) into `into` (the same options bound to another instance, in the same order).
void copy_given_flags(const std::vector<CLI::Option*>& flags, const std::vector<OptionRef>& given,
                      const std::vector<OptionRef>& into);

}  // namespace cw
