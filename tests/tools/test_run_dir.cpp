// The run directory: checkpoint rotation and `latest`, detection of interrupted and corrupted
// checkpoints (each simulated by doing to the files what the crash or the disk would have done),
// failed writes leaving nothing behind, the metrics log's resume truncation and torn-line repair,
// and atomic text replacement.
#include "tools/train/run_dir.h"

#include "engine/error.h"
#include "tests/support.h"

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using cw::CheckpointRef;
using cw::RunDirectory;
using cw::test::read_text;

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  REQUIRE(out);
  out << text;
}

// What a trainer would write: a weights file and a small state file, both depending on the step.
CheckpointRef save(RunDirectory& run, int64_t step, int keep_last = 3) {
  return run.save_checkpoint(
      step,
      [step](const std::string& dir) {
        write_text(fs::path(dir) / "model.bin", std::string(1000 + static_cast<size_t>(step), 'w'));
        write_text(fs::path(dir) / "state.json", fmt::format("{{\"step\": {}}}\n", step));
      },
      keep_last);
}

std::vector<int64_t> steps_of(const std::vector<CheckpointRef>& refs) {
  std::vector<int64_t> out;
  for (const auto& r : refs) out.push_back(r.step);
  return out;
}

// Every entry of the run directory whose name starts with a dot: temporaries.
std::vector<std::string> hidden_entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name[0] == '.') out.push_back(name);
  }
  return out;
}

bool any_contains(const std::vector<std::string>& lines, const std::string& a, const std::string& b) {
  for (const auto& l : lines) {
    if (l.find(a) != std::string::npos && l.find(b) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("run_dir: checkpoints rotate to keep_last and latest names the newest") {
  cw::test::TempDir tmp("run-dir-rotate");
  RunDirectory run((tmp.path / "run").string());
  CHECK(fs::is_directory(run.path()));
  save(run, 20, 2);
  save(run, 40, 2);
  const CheckpointRef newest = save(run, 60, 2);

  CHECK(newest.step == 60);
  CHECK(newest.path == (fs::path(run.path()) / "step-000060").string());
  CHECK_FALSE(fs::exists(fs::path(run.path()) / "step-000020"));
  CHECK(steps_of(run.complete_checkpoints()) == std::vector<int64_t>{40, 60});
  CHECK(read_text(fs::path(run.path()) / "latest") == "step-000060\n");
  CHECK(hidden_entries(run.path()).empty());

  std::vector<std::string> skipped;
  const auto latest = run.latest_complete(&skipped);
  REQUIRE(latest);
  CHECK(latest->step == 60);
  CHECK(skipped.empty());

  // The manifest lists the trainer's files with sizes and hashes (and not itself).
  const auto manifest = nlohmann::json::parse(read_text(fs::path(newest.path) / "manifest.json"));
  CHECK(manifest["step"] == 60);
  REQUIRE(manifest["files"].size() == 2);
  CHECK(manifest["files"][0]["name"] == "model.bin");
  CHECK(manifest["files"][0]["bytes"] == 1060);
  CHECK(manifest["files"][0]["fnv1a64"].get<std::string>().size() == 16);
  CHECK(manifest["files"][1]["name"] == "state.json");
  CHECK(read_text(fs::path(newest.path) / "state.json") == "{\"step\": 60}\n");

  CHECK(cw::checkpoint_dir_name(1234567) == "step-1234567");
  CHECK(run.find(40));
  CHECK_FALSE(run.find(20));
}

TEST_CASE("run_dir: an interrupted write (no manifest) is skipped with a reason") {
  cw::test::TempDir tmp("run-dir-interrupted");
  RunDirectory run(tmp.path.string());
  save(run, 20);
  save(run, 40);
  // What a crash of an older, non-atomic writer (or a hand copy) leaves: files but no manifest.
  fs::create_directory(tmp.path / "step-000070");
  write_text(tmp.path / "step-000070" / "model.bin", "partial");

  std::vector<std::string> skipped;
  const auto latest = run.latest_complete(&skipped);
  REQUIRE(latest);
  CHECK(latest->step == 40);
  REQUIRE(skipped.size() == 1);
  CHECK(skipped[0].find("step-000070: manifest.json missing (interrupted write?); using step-000040") !=
        std::string::npos);
  CHECK(steps_of(run.complete_checkpoints()) == std::vector<int64_t>{20, 40});

  std::string why;
  CHECK_FALSE(run.find(70, &why));
  CHECK(why.find("manifest.json missing") != std::string::npos);
  CHECK_FALSE(run.find(50, &why));
  CHECK(why.find("no such checkpoint") != std::string::npos);
}

TEST_CASE("run_dir: truncated and bit-flipped files are detected") {
  cw::test::TempDir tmp("run-dir-corrupt");
  RunDirectory run(tmp.path.string());
  save(run, 20);
  save(run, 40);
  const fs::path model40 = tmp.path / "step-000040" / "model.bin";

  SUBCASE("truncated after the manifest was written") {
    fs::resize_file(model40, 500);
    std::vector<std::string> skipped;
    const auto latest = run.latest_complete(&skipped);
    REQUIRE(latest);
    CHECK(latest->step == 20);
    REQUIRE(skipped.size() == 1);
    CHECK(any_contains(skipped, "'model.bin' is 500 bytes but manifest.json says 1040", "using step-000020"));
  }
  SUBCASE("one byte flipped, size unchanged") {
    std::string bytes = read_text(model40);
    bytes[123] ^= 0x01;
    write_text(model40, bytes);
    std::vector<std::string> skipped;
    const auto latest = run.latest_complete(&skipped);
    REQUIRE(latest);
    CHECK(latest->step == 20);
    CHECK(any_contains(skipped, "step-000040", "does not match its FNV-1a hash"));
    std::string why;
    CHECK_FALSE(run.find(40, &why));
    CHECK(why.find("FNV-1a") != std::string::npos);
  }
  SUBCASE("a listed file deleted") {
    fs::remove(tmp.path / "step-000040" / "state.json");
    std::vector<std::string> skipped;
    CHECK(run.latest_complete(&skipped)->step == 20);
    CHECK(any_contains(skipped, "'state.json' listed in manifest.json is missing", "using step-000020"));
  }
  SUBCASE("a torn manifest") {
    const fs::path manifest = tmp.path / "step-000040" / "manifest.json";
    write_text(manifest, read_text(manifest).substr(0, 30));
    std::vector<std::string> skipped;
    CHECK(run.latest_complete(&skipped)->step == 20);
    CHECK(any_contains(skipped, "step-000040", "manifest.json is not valid JSON"));
  }
  SUBCASE("every checkpoint corrupt") {
    fs::resize_file(model40, 1);
    fs::resize_file(tmp.path / "step-000020" / "model.bin", 1);
    std::vector<std::string> skipped;
    CHECK_FALSE(run.latest_complete(&skipped));
    CHECK(skipped.size() == 2);
    CHECK(any_contains(skipped, "step-000020", "no complete checkpoint left"));
  }
}

TEST_CASE("run_dir: latest naming a deleted checkpoint falls back to the scan") {
  cw::test::TempDir tmp("run-dir-latest");
  RunDirectory run(tmp.path.string());
  save(run, 20);
  save(run, 40);
  fs::remove_all(tmp.path / "step-000040");
  CHECK(read_text(tmp.path / "latest") == "step-000040\n");
  std::vector<std::string> skipped;
  const auto latest = run.latest_complete(&skipped);
  REQUIRE(latest);
  CHECK(latest->step == 20);
  CHECK(any_contains(skipped, "latest: names step-000040, which does not exist", "using step-000020"));

  // A crash between the rename and the update of `latest` leaves it naming an older checkpoint: the
  // newer complete one wins, and that is no cause for a warning.
  save(run, 60);
  write_text(tmp.path / "latest", "step-000020\n");
  skipped.clear();
  CHECK(run.latest_complete(&skipped)->step == 60);
  CHECK(skipped.empty());
}

TEST_CASE("run_dir: stale temporaries are reported and removed") {
  cw::test::TempDir tmp("run-dir-stale");
  RunDirectory run(tmp.path.string());
  save(run, 20);
  fs::create_directory(tmp.path / ".step-000040.tmp-99999");
  write_text(tmp.path / ".step-000040.tmp-99999" / "model.bin", "half");
  fs::create_directory(tmp.path / ".step-000010.tmp-99999.del");
  write_text(tmp.path / "notes.txt", "the user's own file");

  std::vector<std::string> skipped;
  CHECK(run.latest_complete(&skipped)->step == 20);
  CHECK(skipped.size() == 2);
  CHECK(any_contains(skipped, ".step-000040.tmp-99999: leftover", "using step-000020"));

  CHECK(run.remove_stale_temporaries() == 2);
  CHECK(hidden_entries(tmp.path).empty());
  CHECK(fs::exists(tmp.path / "notes.txt"));
  CHECK(run.find(20));
  CHECK(run.remove_stale_temporaries() == 0);
}

TEST_CASE("run_dir: a failed write leaves no checkpoint and latest unchanged") {
  cw::test::TempDir tmp("run-dir-throw");
  RunDirectory run(tmp.path.string());
  save(run, 20);

  SUBCASE("write_files throws") {
    CHECK_THROWS_AS(run.save_checkpoint(
                        40,
                        [](const std::string& dir) {
                          write_text(fs::path(dir) / "model.bin", "half written");
                          throw std::runtime_error("out of memory while gathering weights");
                        },
                        2),
                    std::runtime_error);
  }
  SUBCASE("write_files writes the reserved manifest name") {
    CHECK_THROWS_AS(run.save_checkpoint(
                        40, [](const std::string& dir) { write_text(fs::path(dir) / "manifest.json", "{}"); }, 2),
                    cw::Error);
  }
  SUBCASE("write_files makes a subdirectory") {
    CHECK_THROWS_AS(run.save_checkpoint(
                        40, [](const std::string& dir) { fs::create_directory(fs::path(dir) / "shards"); }, 2),
                    cw::Error);
  }
  CHECK_FALSE(fs::exists(tmp.path / "step-000040"));
  CHECK(hidden_entries(tmp.path).empty());
  CHECK(read_text(tmp.path / "latest") == "step-000020\n");
  CHECK(steps_of(run.complete_checkpoints()) == std::vector<int64_t>{20});
}

TEST_CASE("run_dir: saving a step again replaces it and drops the abandoned newer timeline") {
  cw::test::TempDir tmp("run-dir-resave");
  RunDirectory run(tmp.path.string());
  save(run, 20, 5);
  save(run, 40, 5);
  save(run, 60, 5);
  // Corrupt 40, then resume from 20 (as a user would after seeing 40 rejected) and save 40 again:
  // the corrupt one is swapped out, and 60, from the abandoned timeline, is removed so the next
  // resume cannot jump back onto it.
  fs::resize_file(tmp.path / "step-000040" / "model.bin", 3);
  const CheckpointRef ref = run.save_checkpoint(
      40, [](const std::string& dir) { write_text(fs::path(dir) / "model.bin", "second timeline"); }, 5);
  CHECK(read_text(fs::path(ref.path) / "model.bin") == "second timeline");
  CHECK_FALSE(fs::exists(tmp.path / "step-000040" / "state.json"));
  CHECK(steps_of(run.complete_checkpoints()) == std::vector<int64_t>{20, 40});
  CHECK(run.latest_complete()->step == 40);
  CHECK(hidden_entries(tmp.path).empty());
}

TEST_CASE("run_dir: metrics log appends lines and truncates on resume") {
  cw::test::TempDir tmp("run-dir-metrics");
  const std::string path = tmp.file("metrics.jsonl");
  CHECK(cw::truncate_metrics_after(path, 3) == 0);  // no log yet: nothing to do
  CHECK_FALSE(fs::exists(path));
  {
    cw::MetricsLog log(path);
    log.append({{"event", "start"}});
    for (int s = 1; s <= 5; ++s) log.append({{"step", s}, {"loss", 1.0 / s}});
    CHECK_THROWS_AS(log.append(nlohmann::json::array({1, 2})), cw::Error);
  }
  const auto lines_of = [&] {
    std::vector<nlohmann::json> out;
    std::istringstream in(read_text(path));
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  };
  CHECK(lines_of().size() == 6);

  CHECK(cw::truncate_metrics_after(path, 3) == 2);
  auto lines = lines_of();
  REQUIRE(lines.size() == 4);
  CHECK(lines[0]["event"] == "start");
  CHECK(lines[3]["step"] == 3);
  CHECK(cw::truncate_metrics_after(path, 3) == 0);

  // A crash mid-write leaves a torn last line: reopening cuts it so the next record parses.
  {
    std::ofstream out(path, std::ios::app);
    out << "{\"step\": 4, \"lo";
  }
  {
    cw::MetricsLog log(path);
    log.append({{"step", 4}, {"loss", 0.25}});
  }
  lines = lines_of();
  REQUIRE(lines.size() == 5);
  CHECK(lines[4]["loss"] == 0.25);

  // Reopening for a resume from step 2 drops steps 3 and 4.
  {
    cw::MetricsLog log(path, int64_t{2});
    log.append({{"step", 3}, {"loss", 0.3}});
  }
  lines = lines_of();
  REQUIRE(lines.size() == 4);
  CHECK(lines[3]["loss"] == 0.3);

  // A damaged line in the middle is not guessed at: the error names the file and line.
  write_text(path, "{\"step\": 1}\nnot json\n{\"step\": 2}\n");
  try {
    cw::truncate_metrics_after(path, 1);
    FAIL("expected an error");
  } catch (const cw::Error& e) {
    CHECK(std::string(e.what()).find("metrics.jsonl' line 2: not valid JSON") != std::string::npos);
  }
}

TEST_CASE("run_dir: write_text_atomic replaces content and leaves no temporary") {
  cw::test::TempDir tmp("run-dir-atomic");
  const std::string path = tmp.file("config.toml");
  cw::write_text_atomic(path, "lr = 1e-3\n");
  CHECK(read_text(path) == "lr = 1e-3\n");
  cw::write_text_atomic(path, "lr = 3e-4\n");
  CHECK(read_text(path) == "lr = 3e-4\n");
  CHECK(std::distance(fs::directory_iterator(tmp.path), fs::directory_iterator()) == 1);
  CHECK_THROWS_AS(cw::write_text_atomic(tmp.file("missing-dir/config.toml"), "x"), cw::Error);
}

TEST_CASE("run_dir: default_run_dir is base/YYYYmmdd-HHMMSS") {
  const std::string dir = cw::default_run_dir("runs");
  REQUIRE(dir.size() == std::string("runs/20250101-120000").size());
  CHECK(dir.rfind("runs/", 0) == 0);
  CHECK(dir[13] == '-');
  for (size_t i = 5; i < dir.size(); ++i) {
    if (i != 13) CHECK(std::isdigit(static_cast<unsigned char>(dir[i])));
  }
}
