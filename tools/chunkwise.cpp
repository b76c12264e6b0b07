// `chunkwise`: the command line. Each subcommand is a thin layer over a library function in tools/,
// optim/ or model/, so tests call the same code. Errors end in one clear line and a non-zero exit.
#include "chunkwise_config.h"
#include "engine/device.h"
#include "engine/error.h"
#include "tools/gradcheck.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>

namespace {

void add_schedule_options(CLI::App* app, cw::ScheduleOptions& s) {
  app->add_option("--schedule", s.name, "full | seco | spaco")->capture_default_str();
  app->add_option("--chunk", s.chunk, "prefill chunk length in tokens (seco, spaco); 0: whole sequence")
      ->capture_default_str();
  app->add_option("--bwd-chunk", s.bwd_chunk, "reverse-sweep chunk length; 0: same as --chunk")->capture_default_str();
  app->add_option("--keep", s.keep, "spaco: chunks backpropagated per step (t of k); 0: all")->capture_default_str();
  app->add_option("--spaco-seed", s.seed, "spaco: seed of the chunk sample")->capture_default_str();
  app->add_flag("--stratified", s.stratified, "spaco: sample chunks with and without labels in proportion");
  app->add_option("--scale-loss", s.scale_loss, "spaco: scale visited chunks' loss gradient by k/t")
      ->capture_default_str();
  app->add_flag("--scale-relay", s.scale_relay, "spaco: scale relayed dK/dV by k/t per hop");
  app->add_option("--relay-cap", s.relay_cap, "spaco: cap of the cumulative relay factor (0: none)")
      ->capture_default_str();
  app->add_flag("--drop-relay", s.drop_relay, "spaco: discard all cross-chunk relay (chunk-local gradient)");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"chunkwise: exact long-sequence training of Llama models (SeCO / SpaCO)"};
  app.set_version_flag("--version", std::string("chunkwise ") + CW_VERSION);
  app.require_subcommand(1);

  cw::GradcheckOptions gc;
  CLI::App* gradcheck = app.add_subcommand("gradcheck", "check a schedule's gradients (finite differences or full)");
  gradcheck->add_option("--model", gc.model, "preset, config.json or HF checkpoint directory")->capture_default_str();
  gradcheck->add_option("--seq", gc.seq, "tokens per sequence")->capture_default_str();
  gradcheck->add_option("--batch", gc.batch, "sequences")->capture_default_str();
  gradcheck->add_option("--dtype", gc.dtype, "f64 | f32")->capture_default_str();
  add_schedule_options(gradcheck, gc.schedule);
  gradcheck->add_option("--against", gc.against, "fd | full (default: fd for full, full otherwise)");
  gradcheck->add_option("--tol", gc.tol, "fail above this max_rel_err (default 1e-7 fd, 1e-12 full in f64)");
  gradcheck->add_option("--directions", gc.directions, "random directions per tensor (fd)")->capture_default_str();
  gradcheck->add_option("--step", gc.step, "finite-difference step along a unit direction")->capture_default_str();
  gradcheck->add_option("--seed", gc.seed, "seed of the init, batch and directions")->capture_default_str();
  gradcheck->add_option("--norm-jitter", gc.norm_jitter, "random init: norm weights 1 + N(0, jitter)")
      ->capture_default_str();
  gradcheck->add_option("--tie-embeddings", gc.tie_embeddings, "override tie_word_embeddings (0 or 1)");
  gradcheck->add_option("--tokens", gc.tokens_file, "batch from a headerless little-endian uint32 file (B x T ids)");
  gradcheck->add_option("--save-grads", gc.save_grads, "write the loss and gradients (f64, HF names) as safetensors");

  CLI::App* devices = app.add_subcommand("devices", "list the build's features and the devices it sees");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*gradcheck) return cw::run_gradcheck(gc, std::cout);
    if (*devices) {
      std::cout << cw::describe_devices();
      return 0;
    }
  } catch (const cw::Error& e) {
    std::cerr << "chunkwise: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "chunkwise: unexpected error: " << e.what() << "\n";
    return 3;
  }
  return 0;
}
