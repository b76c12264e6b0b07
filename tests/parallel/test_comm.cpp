// The threads backend of parallel/comm.h: every collective at group sizes 1-4 and odd lengths, f32 and
// f64, bitwise against a serial rank-ordered sum (so bitwise identical across ranks), whatever the
// threads' timing; asynchronous calls in flight together; split into groups (by color, ordered by key,
// nested); and the failures that must not deadlock: a rank that throws, a rank that returns early, and
// ranks whose calls disagree, in the world or in a split group.
//
// The checks run on the main thread after run_thread_ranks returns: the ranks only record results.
#include "engine/random.h"
#include "parallel/comm.h"
#include "tests/support.h"

#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

using namespace cw;

namespace {

using test::contains;
using test::error_of;

constexpr int kMaxGroup = 4;
const int64_t kLengths[] = {1, 7, 1001};  // one element, and odd lengths that no vector width divides

// Rank r's input: random values of varied magnitude (so the order of summation shows in the bits).
OwnedTensor rank_input(DType dtype, int64_t n, int rank, uint64_t seed) {
  OwnedTensor t = OwnedTensor::of_shape(dtype, std::vector<int64_t>{n});
  fill_normal(t, seed, static_cast<uint64_t>(rank), 0.0, 1.0 + 1000.0 * rank);
  return t;
}

// The reference: x0 + x1 + ... + x(n-1) left to right, element by element, in the input's dtype.
template <class T> OwnedTensor serial_sum(const std::vector<OwnedTensor>& parts, int64_t begin, int64_t n) {
  OwnedTensor s = OwnedTensor::of_shape(parts[0].tensor.dtype, std::vector<int64_t>{n});
  for (int64_t i = 0; i < n; ++i) {
    T acc = parts[0].tensor.ptr<T>()[begin + i];
    for (size_t r = 1; r < parts.size(); ++r) acc += parts[r].tensor.ptr<T>()[begin + i];
    s.tensor.ptr<T>()[i] = acc;
  }
  return s;
}

OwnedTensor serial_sum(const std::vector<OwnedTensor>& parts, int64_t begin, int64_t n) {
  return parts[0].tensor.dtype == DType::f64 ? serial_sum<double>(parts, begin, n) : serial_sum<float>(parts, begin, n);
}

bool same_bytes(const Tensor& a, const void* b) { return a.bytes() == 0 || std::memcmp(a.data, b, a.bytes()) == 0; }

// A short random pause so the ranks arrive in different orders from run to run.
void jitter(int rank, int call) { std::this_thread::sleep_for(std::chrono::microseconds(((rank * 7 + call * 13) % 5) * 200)); }

}  // namespace

TEST_CASE("comm threads: all_reduce, reduce, reduce_scatter, all_gather, broadcast are rank-ordered and bitwise equal") {
  for (DType dtype : {DType::f64, DType::f32})
    for (int size = 1; size <= kMaxGroup; ++size)
      for (int64_t n : kLengths) {
        CAPTURE(std::string(dtype_name(dtype)));
        CAPTURE(size);
        CAPTURE(n);
        const uint64_t seed = 100 + static_cast<uint64_t>(size * 10 + n);
        std::vector<OwnedTensor> inputs, shard_inputs;
        for (int r = 0; r < size; ++r) {
          inputs.push_back(rank_input(dtype, n, r, seed));
          shard_inputs.push_back(rank_input(dtype, n * size, r, seed + 1));
        }
        std::vector<OwnedTensor> reduced(static_cast<size_t>(size)), scattered(static_cast<size_t>(size)),
            gathered(static_cast<size_t>(size)), broadcast(static_cast<size_t>(size)), rooted(static_cast<size_t>(size));
        const int root = size / 2;
        run_thread_ranks(size, [&](Communicator& comm) {
          const int r = comm.rank();
          REQUIRE(comm.size() == size);
          reduced[r] = rank_input(dtype, n, r, seed);
          jitter(r, 0);
          comm.all_reduce(reduced[r])->wait();

          scattered[r] = OwnedTensor::of_shape(dtype, std::vector<int64_t>{n});
          jitter(r, 1);
          comm.reduce_scatter(scattered[r], shard_inputs[r])->wait();

          gathered[r] = OwnedTensor::of_shape(dtype, std::vector<int64_t>{n * size});
          jitter(r, 2);
          comm.all_gather(gathered[r], inputs[r])->wait();

          broadcast[r] = rank_input(dtype, n, r, seed);
          comm.broadcast(broadcast[r], size - 1)->wait();

          rooted[r] = rank_input(dtype, n, r, seed);
          jitter(r, 3);
          comm.reduce(rooted[r], root)->wait();
          comm.barrier();
        });
        const OwnedTensor sum = serial_sum(inputs, 0, n);
        for (int r = 0; r < size; ++r) {
          CAPTURE(r);
          CHECK(same_bytes(reduced[r], sum.tensor.data));
          const OwnedTensor shard = serial_sum(shard_inputs, r * n, n);
          CHECK(same_bytes(scattered[r], shard.tensor.data));
          for (int q = 0; q < size; ++q)
            CHECK(same_bytes(gathered[r].tensor.slice(0, q * n, n), inputs[q].tensor.data));
          CHECK(same_bytes(broadcast[r], inputs[size - 1].tensor.data));
          // reduce: the root gets the sum, every other rank keeps its own values.
          CHECK(same_bytes(rooted[r], r == root ? sum.tensor.data : inputs[r].tensor.data));
        }
      }
}

TEST_CASE("comm threads: several collectives in flight, waited in reverse, and in-place reduce_scatter/all_gather") {
  const int size = 3;
  const int64_t n = 5;
  std::vector<OwnedTensor> a_in, b_in;
  for (int r = 0; r < size; ++r) {
    a_in.push_back(rank_input(DType::f64, n, r, 1));
    b_in.push_back(rank_input(DType::f64, n * size, r, 2));
  }
  std::vector<OwnedTensor> a(size), b(size), c(size);
  run_thread_ranks(size, [&](Communicator& comm) {
    const int r = comm.rank();
    a[r] = rank_input(DType::f64, n, r, 1);
    b[r] = rank_input(DType::f64, n * size, r, 2);
    // In place, as ZeRO uses them: the shard is the rank's own slice of the full buffer.
    auto w1 = comm.all_reduce(a[r]);
    auto w2 = comm.reduce_scatter(b[r].tensor.slice(0, r * n, n), b[r]);
    jitter(r, 3);
    w2->wait();
    w1->wait();
    c[r] = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{n * size});
    copy_convert(c[r].tensor.slice(0, r * n, n), b[r].tensor.slice(0, r * n, n));
    comm.all_gather(c[r], c[r].tensor.slice(0, r * n, n))->wait();
  });
  const OwnedTensor a_sum = serial_sum(a_in, 0, n);
  const OwnedTensor b_sum = serial_sum(b_in, 0, n * size);
  for (int r = 0; r < size; ++r) {
    CHECK(same_bytes(a[r], a_sum.tensor.data));
    CHECK(same_bytes(c[r], b_sum.tensor.data));
  }
}

TEST_CASE("comm threads: all_to_all delivers rank src's block for rank dst to dst's block src, in every dtype") {
  for (DType dtype : {DType::f64, DType::f32, DType::bf16})
    for (int size = 1; size <= kMaxGroup; ++size)
      for (int64_t n : kLengths) {
        CAPTURE(std::string(dtype_name(dtype)));
        CAPTURE(size);
        CAPTURE(n);
        std::vector<OwnedTensor> inputs;  // rank r's [size * n]: its block for rank q at [q * n, +n)
        for (int r = 0; r < size; ++r) inputs.push_back(rank_input(dtype, size * n, r, 300 + size));
        std::vector<OwnedTensor> outputs(static_cast<size_t>(size));
        run_thread_ranks(size, [&](Communicator& comm) {
          const int r = comm.rank();
          outputs[r] = OwnedTensor::of_shape(dtype, std::vector<int64_t>{size * n});
          jitter(r, 4);
          comm.all_to_all(outputs[r], inputs[r])->wait();
        });
        for (int dst = 0; dst < size; ++dst)
          for (int src = 0; src < size; ++src) {
            CAPTURE(dst);
            CAPTURE(src);
            CHECK(same_bytes(outputs[dst].tensor.slice(0, src * n, n), inputs[src].tensor.slice(0, dst * n, n).data));
          }
      }
  // Refused in one line, on the rank that called it: sizes that do not split into the group's blocks,
  // outputs of another size or dtype, and an output overlapping its input.
  run_thread_ranks(2, [&](Communicator& comm) {
    OwnedTensor in = OwnedTensor::of_shape(DType::f32, std::vector<int64_t>{6});
    OwnedTensor odd = OwnedTensor::of_shape(DType::f32, std::vector<int64_t>{5});
    OwnedTensor other = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{6});
    CHECK(contains(error_of([&] { comm.all_to_all(odd, odd); }), "out and in must hold the same elements, a multiple"));
    CHECK(contains(error_of([&] { comm.all_to_all(odd, in); }), "out and in must hold the same elements"));
    CHECK(contains(error_of([&] { comm.all_to_all(other, in); }), "all_to_all: out is"));
    CHECK(contains(error_of([&] { comm.all_to_all(in, in); }), "all_to_all: out and in overlap"));
  });
}

TEST_CASE("comm threads: a rank that throws releases the others, and its error is the one rethrown") {
  std::vector<std::string> released(3);
  const std::string err = error_of([&] {
    run_thread_ranks(3, [&](Communicator& comm) {
      OwnedTensor t = rank_input(DType::f64, 4, comm.rank(), 3);
      comm.all_reduce(t)->wait();
      if (comm.rank() == 1) fail("rank one's own failure");
      try {
        comm.all_reduce(t)->wait();  // rank 1 never joins this one
      } catch (const Error& e) {
        released[comm.rank()] = e.what();
        throw;
      }
    });
  });
  CHECK(contains(err, "rank one's own failure"));
  for (int r : {0, 2}) {
    CAPTURE(released[r]);
    CHECK(contains(released[r], "rank 1 failed: rank one's own failure"));
  }
}

TEST_CASE("comm threads: a rank that returns while others wait, and ranks whose calls disagree, fail with a clear error") {
  std::string err = error_of([] {
    run_thread_ranks(2, [](Communicator& comm) {
      if (comm.rank() == 0) return;
      OwnedTensor t(DType::f32, {3});
      comm.all_reduce(t)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "rank 0 returned after 0 collectives, but rank 1 issued collective #0 (all_reduce f32 [3])"));

  err = error_of([] {
    run_thread_ranks(3, [](Communicator& comm) {
      OwnedTensor t(DType::f64, {comm.rank() == 2 ? 4 : 3});
      comm.all_reduce(t)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "collective #0: rank 0 issued all_reduce f64 [3] but rank 2 issued all_reduce f64 [4]"));

  err = error_of([] {
    run_thread_ranks(2, [](Communicator& comm) {
      OwnedTensor t(comm.rank() == 0 ? DType::f64 : DType::f32, {3});
      comm.broadcast(t, 0)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "rank 0 issued broadcast f64 [3] from rank 0 but rank 1 issued broadcast f32 [3] from rank 0"));

  err = error_of([] {
    run_thread_ranks(2, [](Communicator& comm) {
      OwnedTensor t(DType::f64, {4});
      if (comm.rank() == 0) comm.barrier();
      else comm.all_reduce(t)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "rank 0 issued barrier but rank 1 issued all_reduce f64 [4]"));

  // Checked on the calling rank before anything is posted.
  err = error_of([] {
    run_thread_ranks(2, [](Communicator& comm) {
      OwnedTensor in(DType::f64, {5}), out(DType::f64, {2});
      comm.reduce_scatter(out, in)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "reduce_scatter: in must hold size x out's elements"));
  err = error_of([] {
    run_thread_ranks(1, [](Communicator& comm) {
      OwnedTensor t(DType::i32, {2});
      comm.all_reduce(t)->wait();
    });
  });
  CHECK(contains(err, "the threads backend sums f64 or f32"));
  CHECK(contains(error_of([] { run_thread_ranks(0, [](Communicator&) {}); }), "at least one rank"));
}

TEST_CASE("comm threads: split makes groups by color ordered by key, nested; each sums its members in their order") {
  // World of 6 as a grid of 2 rows x 3 columns, w = row * 3 + column. Rows keep the world order;
  // columns are ranked by a descending key, so their order (and the order of their sums) is reversed.
  const int size = 6, columns = 3;
  const int64_t n = 7;
  std::vector<OwnedTensor> inputs;
  for (int w = 0; w < size; ++w) inputs.push_back(rank_input(DType::f64, n, w, 42));
  std::vector<OwnedTensor> row_sum(size), column_sum(size), pair_gather(size);
  std::vector<int> row_rank(size), row_size(size), column_rank(size), column_size(size), pair_size(size);
  std::vector<char> outside(size);
  run_thread_ranks(size, [&](Communicator& world) {
    const int w = world.rank(), row = w / columns, column = w % columns;
    jitter(w, 0);
    const std::unique_ptr<Communicator> rows = world.split(row, column);
    jitter(w, 1);
    const std::unique_ptr<Communicator> cols = world.split(column, -row);
    // Only the ranks of column 0 form a group; the others pass a negative color.
    const std::unique_ptr<Communicator> none = world.split(column == 0 ? 5 : -1, 0);
    outside[w] = none == nullptr;
    row_rank[w] = rows->rank();
    row_size[w] = rows->size();
    column_rank[w] = cols->rank();
    column_size[w] = cols->size();
    row_sum[w] = rank_input(DType::f64, n, w, 42);
    column_sum[w] = rank_input(DType::f64, n, w, 42);
    // Both groups' collectives in flight at once, waited in the other order.
    auto a = rows->all_reduce(row_sum[w]);
    auto b = cols->all_reduce(column_sum[w]);
    jitter(w, 2);
    b->wait();
    a->wait();
    // A split of a split: each row into singletons {column 0} and {columns 1, 2}.
    const std::unique_ptr<Communicator> pair = rows->split(column == 0 ? 0 : 1, column);
    pair_size[w] = pair->size();
    pair_gather[w] = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{n * pair->size()});
    pair->all_gather(pair_gather[w], inputs[static_cast<size_t>(w)])->wait();
    world.barrier();
  });
  for (int w = 0; w < size; ++w) {
    CAPTURE(w);
    const int row = w / columns, column = w % columns;
    CHECK(row_rank[w] == column);
    CHECK(row_size[w] == columns);
    CHECK(column_rank[w] == 1 - row);  // key -row: row 1 first
    CHECK(column_size[w] == 2);
    CHECK(static_cast<bool>(outside[w]) == (column != 0));
    std::vector<OwnedTensor> row_parts, column_parts;
    for (int c = 0; c < columns; ++c) row_parts.push_back(rank_input(DType::f64, n, row * columns + c, 42));
    for (int r : {1, 0}) column_parts.push_back(rank_input(DType::f64, n, r * columns + column, 42));  // key order
    CHECK(same_bytes(row_sum[w], serial_sum(row_parts, 0, n).tensor.data));
    CHECK(same_bytes(column_sum[w], serial_sum(column_parts, 0, n).tensor.data));
    CHECK(pair_size[w] == (column == 0 ? 1 : 2));
    if (column > 0)
      for (int m = 0; m < 2; ++m)
        CHECK(same_bytes(pair_gather[w].tensor.slice(0, m * n, n), inputs[static_cast<size_t>(row * columns + 1 + m)].tensor.data));
  }
}

TEST_CASE("comm threads: a failure in one split group releases ranks waiting in another, and names the group") {
  // Ranks {0, 1} and {2, 3}: rank 0 throws; rank 1 waits in its group, ranks 2 and 3 on the world.
  std::vector<std::string> released(4);
  std::string err = error_of([&] {
    run_thread_ranks(4, [&](Communicator& world) {
      const std::unique_ptr<Communicator> half = world.split(world.rank() / 2, world.rank());
      OwnedTensor t = rank_input(DType::f64, 3, world.rank(), 5);
      if (world.rank() == 0) fail("rank zero's own failure");
      try {
        if (world.rank() == 1) half->all_reduce(t)->wait();
        else world.all_reduce(t)->wait();
      } catch (const Error& e) {
        released[world.rank()] = e.what();
        throw;
      }
    });
  });
  CHECK(contains(err, "rank zero's own failure"));
  for (int r : {1, 2, 3}) {
    CAPTURE(released[r]);
    CHECK(contains(released[r], "rank 0 failed: rank zero's own failure"));
  }
  CHECK(contains(released[1], "group of world ranks 0, 1"));

  // Calls that disagree inside a group, and a member that returns while its group waits.
  err = error_of([] {
    run_thread_ranks(4, [](Communicator& world) {
      const std::unique_ptr<Communicator> half = world.split(world.rank() / 2, world.rank());
      OwnedTensor t(DType::f64, {world.rank() == 3 ? 4 : 3});
      half->all_reduce(t)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "group of world ranks 2, 3: collective #0: rank 0 issued all_reduce f64 [3] but rank 1 issued "
                      "all_reduce f64 [4]"));
  err = error_of([] {
    run_thread_ranks(4, [](Communicator& world) {
      const std::unique_ptr<Communicator> half = world.split(world.rank() % 2, -world.rank());
      if (world.rank() == 1) return;
      OwnedTensor t(DType::f32, {2});
      half->all_reduce(t)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "group of world ranks 3, 1: rank 1 returned after 0 collectives, but rank 0 issued collective #0"));
}
