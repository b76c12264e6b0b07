// The long-context demo's small form, end to end: `tools/run longctx` (repository-level code as
// documents, tokenized; SmolLM2 evaluated, extended with YaRN, fine-tuned with seco on
// packed documents, evaluated again, charted), each output read back and checked.

#include "tests/support.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace cw {
namespace {

namespace fs = std::filesystem;
using test::kSmolLm2Gguf;
using test::read_text;

bool have_python3() { return std::system("python3 -c 'import json' >/dev/null 2>&1") == 0; }

nlohmann::json read_json(const fs::path& p) { return nlohmann::json::parse(read_text(p)); }

}  // namespace

TEST_SUITE("longctx") {

TEST_CASE("longctx: tools/run longctx's CPU form runs end to end and writes what it promises "
          "(needs the SmolLM2 GGUF and python3)" *
          doctest::skip(!fs::exists(kSmolLm2Gguf) || !have_python3())) {
  test::TempDir dir("longctx");
  // The binaries under test: the directory holding tools/chunkwise (this build's, or the staged ones).
  const fs::path binaries = fs::path(test::chunkwise_exe()).parent_path().parent_path();
  const std::string log = dir.file("longctx.log");
  const std::string cmd =
      fmt::format("CHUNKWISE_PREBUILT='{}' LONGCTX_DIR='{}' '{}/tools/run' longctx >'{}' 2>&1", binaries.string(),
                  dir.path.string(), CW_SOURCE_ROOT, log);
  const int status = std::system(cmd.c_str());
  const std::string output = read_text(log);
  INFO(output);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);

  // The documents: one shard each for training and held-out, with the flags that mark their starts.
  for (const char* f : {"train.bin", "train.bin.flags", "eval.bin", "eval.bin.flags", "eval-orders.bin", "eval-orders.bin.flags"})
    CHECK(fs::file_size(dir.path / "dependency" / f) > 0);  // the default order's folder
  const fs::path out = dir.path / "dependency" / "cpu";

  // Loss by position, before (SmolLM2 as shipped) and after: every bucket counted and finite; the
  // real model predicts held-out code far better than chance (ln 49,152 = 10.8 nats).
  for (const char* name : {"before", "after"}) {
    const nlohmann::json j = read_json(out / fmt::format("loss-{}.json", name));
    CHECK(j.at("label") == name);
    CHECK(j.at("documents") == true);
    CHECK(j.at("seq") == 512);
    CHECK(j.at("min_document") == 512);  // the documents that fill a window: every bucket the same ones
    REQUIRE(j.at("buckets").size() == 4);  // [0,64), [64,128), [128,256), [256,512)
    for (const nlohmann::json& b : j.at("buckets")) {
      CHECK(b.at("tokens").get<int64_t>() > 0);
      CHECK(std::isfinite(b.at("mean_loss").get<double>()));
      CHECK(b.at("mean_loss").get<double>() < 5.0);
    }
  }
  // The same held-out packages with their files in random orders: four windows (the CPU form's), the
  // documents that fill them, every bucket counted.
  for (const char* name : {"before", "after"}) {
    const nlohmann::json j = read_json(out / fmt::format("loss-orders-{}.json", name));
    CHECK(j.at("label") == fmt::format("{}, files in random orders", name));
    CHECK(j.at("windows") == 4);
    CHECK(j.at("min_document") == 512);
    REQUIRE(j.at("buckets").size() == 4);
    for (const nlohmann::json& b : j.at("buckets")) {
      CHECK(b.at("tokens").get<int64_t>() > 0);
      CHECK(b.at("mean_loss").get<double>() < 5.0);
    }
  }
  // Passkey, before and after: a cell per length and depth; the base model finds every key at 256
  // and 512 tokens (its native context is 8,192).
  for (const char* name : {"before", "after"}) {
    const nlohmann::json j = read_json(out / fmt::format("passkey-{}.json", name));
    REQUIRE(j.at("cells").size() == 4);  // 2 lengths x 2 depths
    for (const nlohmann::json& c : j.at("cells")) {
      CHECK(c.at("trials") == 1);
      CHECK(c.at("correct").get<int64_t>() >= 0);
      CHECK(c.at("correct").get<int64_t>() <= 1);
      if (std::string(name) == "before") CHECK(c.at("correct") == 1);
    }
  }
  for (const char* svg : {"loss.svg", "loss-orders.svg", "passkey-before.svg", "passkey-after.svg"})
    CHECK(read_text(out / svg).find("<svg") != std::string::npos);

  // The run: its checkpoint carries YaRN into config.json (transformers reads it from there).
  const std::string latest = read_text(out / "run" / "latest");
  const fs::path ckpt = out / "run" / latest.substr(0, latest.find_last_not_of("\n ") + 1);
  const nlohmann::json config = read_json(ckpt / "config.json");
  const nlohmann::json& rope = config.at("rope_scaling");
  CHECK(rope.at("rope_type") == "yarn");
  CHECK(rope.at("factor") == 16.0);
  CHECK(rope.at("original_max_position_embeddings") == 8192);
  CHECK(rope.at("attention_factor") == 1.0);
  CHECK(config.at("max_position_embeddings") == 131072);
  int train_lines = 0;
  std::ifstream metrics(out / "run" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);)
    if (nlohmann::json::parse(line).contains("grad_norm")) ++train_lines;  // a training step's line
  CHECK(train_lines == 2);

  // Each phase's seconds.
  const std::string times = read_text(out / "times.txt");
  for (const char* phase : {"data ", "eval before ", "train ", "eval after "}) CHECK(times.find(phase) != std::string::npos);
}

TEST_CASE("longctx: code_documents.py joins a package's files in dependency order, each after the files it "
          "imports, and a directory of headers each after the headers it includes (needs python3)" *
          doctest::skip(!have_python3())) {
  test::TempDir dir("code-documents");
  const auto write = [&](const std::string& rel, const std::string& text) {
    fs::create_directories((dir.path / rel).parent_path());
    std::ofstream(dir.path / rel) << text << std::string(400, '#') << "\n";  // past --min-chars below
  };
  // A package whose sorted order is the reverse of its imports: a uses b (absolutely), b uses c
  // (relatively, from inside a function), sub/d uses a (two levels up); __init__ imports them all.
  // c and e import each other: the cycle is broken where the sorted order enters it: c is reached
  // first, so e, its import, goes before it.
  write("lib/pkg/__init__.py", "from . import a, b, c\nfrom .sub import d\n");
  write("lib/pkg/a.py", "import pkg.b\n");
  write("lib/pkg/b.py", "def f():\n    from .c import g\n");
  write("lib/pkg/c.py", "from pkg import e\n");
  write("lib/pkg/e.py", "from . import c\n");
  write("lib/pkg/sub/d.py", "from ..a import x\nimport os\n");
  write("lib/held/x.py", "import json\n");
  write("headers/12/a.h", "#include <bits/z.h>\n#include \"b.h\"\n");
  write("headers/12/b.h", "#include <vector>\n");
  write("headers/12/bits/z.h", "\n");
  const auto run = [&](const std::string& order) {
    const std::string cmd = fmt::format(
        "python3 '{}/tools/data/code_documents.py' --root '{}' --headers '{}' --eval-packages held --min-chars 100 "
        "{} --train '{}' --eval '{}' --eval-orders '{}' --orders 3 >'{}' 2>&1",
        CW_SOURCE_ROOT, dir.file("lib"), dir.file("headers/12"), order, dir.file("train.jsonl"), dir.file("eval.jsonl"),
        dir.file(order.empty() ? "orders-sorted.jsonl" : "orders-dependency.jsonl"), dir.file("log"));
    const int status = std::system(cmd.c_str());
    INFO(read_text(dir.file("log")));
    REQUIRE(status == 0);
    // The files of each training document, in the order they were joined.
    std::map<std::string, std::vector<std::string>> files;
    std::istringstream lines(read_text(dir.file("train.jsonl")));
    for (std::string line; std::getline(lines, line);) {
      const nlohmann::json r = nlohmann::json::parse(line);
      std::istringstream text(r.at("text").get<std::string>());
      for (std::string l; std::getline(text, l);)
        for (const char* opener : {"# file: ", "// file: "})
          if (l.rfind(opener, 0) == 0) files[r.at("name")].push_back(l.substr(std::string(opener).size()));
    }
    return files;
  };
  auto files = run("--order dependency");
  CHECK(files["pkg"] == std::vector<std::string>{"pkg/e.py", "pkg/c.py", "pkg/b.py", "pkg/a.py", "pkg/sub/d.py",
                                                 "pkg/__init__.py"});
  CHECK(files["12"] == std::vector<std::string>{"12/b.h", "12/a.h"});  // bits/z.h is another directory's
  CHECK(files["12/bits"] == std::vector<std::string>{"12/bits/z.h"});
  files = run("");  // sorted, the default
  CHECK(files["pkg"] == std::vector<std::string>{"pkg/__init__.py", "pkg/a.py", "pkg/b.py", "pkg/c.py", "pkg/e.py",
                                                 "pkg/sub/d.py"});
  CHECK(files["12"] == std::vector<std::string>{"12/a.h", "12/b.h"});
  // The held-out package's random orders are drawn from the sorted order whatever --order is: the
  // same three documents either way.
  const std::string orders = read_text(dir.file("orders-sorted.jsonl"));
  CHECK(std::count(orders.begin(), orders.end(), '\n') == 3);
  CHECK(orders == read_text(dir.file("orders-dependency.jsonl")));
}

TEST_CASE("longctx: tools/run longctx refuses an --order it does not know, in one line") {
  test::TempDir dir("longctx-order");
  const fs::path binaries = fs::path(test::chunkwise_exe()).parent_path().parent_path();
  const std::string log = dir.file("log");
  const std::string cmd = fmt::format("CHUNKWISE_PREBUILT='{}' LONGCTX_DIR='{}' '{}/tools/run' longctx --order random >'{}' 2>&1",
                                      binaries.string(), dir.path.string(), CW_SOURCE_ROOT, log);
  const int status = std::system(cmd.c_str());
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 2);
  CHECK(read_text(log) == "tools/run longctx: --order 'random': give dependency or sorted\n");
  CHECK(!fs::exists(dir.path / "random"));  // nothing made
}

}  // TEST_SUITE

}  // namespace cw
