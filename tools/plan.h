// `chunkwise plan`: the planner's report of one training step (tools/planner/planner.h: its memory
// by category and its time) printed as a table and written as JSON, for the settings given or the
// ones `auto` chooses (--explain lists what it compared) or the longest sequence that fits.
#pragma once

#include "tools/planner/planner.h"

#include <iosfwd>
#include <string>

namespace cw {

std::string plan_table(const PlanReport& report);  // the human table, device and host by category
std::string plan_json(const PlanReport& report);   // peak_device_gib, peak_host_gib, step_s, categories, ...
struct PlanOptions;
// ZeRO 3's collectives a step: counts, bytes and their time at the NVLink and network bandwidths.
std::string zero3_table(const Zero3Plan& zero3, const PlanOptions& options);
// Context parallelism's collectives a step (PlanReport's cp fields), the same way.
std::string context_parallel_table(const PlanReport& report, const PlanOptions& options);

struct PlanOptions {
  std::string model = "llama-3.2-1b";
  int64_t seq = 4096, batch = 1;
  ScheduleOptions schedule{.kind = ScheduleKind::seco};  // chunk and offload_window may be kAuto (--chunk auto)
  LoraConfig lora;                           // rank > 0: LoRA adapters, the base frozen
  std::string dtype = "bf16";
  double device_memory_gib = 0;      // 0: the GPU's when one is present, else 80
  double host_memory_gib = 0;        // 0: this machine's available memory when it has a GPU, else not checked
  bool optimizer_offload = false;    // master weights and moments in host memory
  bool longest = false;              // plan the longest sequence that fits instead of `seq`
  bool explain = false;              // with auto: also list every plan auto compared
  int64_t tp = 1;                    // tensor parallel: plan one rank's shard (model/shard.h), no SP
  int64_t dp = 1;                    // data-parallel ranks (with zero 3: the ranks the parameters are sharded over)
  int64_t zero = 0;                  // 3: plan one rank of ZeRO 3 (parallel/zero3.h); 0-2 plan as one process
  int64_t cp = 1;                    // context parallel: plan one rank of cp (model/cp_group.h), its all-to-alls
  double nvlink_gbps = 450, network_gbps = 50;  // all-gather bus bandwidth per GPU for zero 3's collective times
  std::string documents;             // packed documents as `bench --documents` draws them: L or LO:HI
  std::string json;                  // also write the report as JSON here
};
// Prints the table (and writes the JSON); returns 0 when the step fits, 1 when it does not.
int run_plan(const PlanOptions& options, std::ostream& out);

}  // namespace cw
