// ZeRO 3's shard layout: which elements of every parameter each of n ranks holds.
//
// The parameters are cut into units, each gathered whole when it is used: the tensors outside the
// blocks (embedding, final norm, an untied LM head) are unit 0, block l is unit 1 + l. A unit's
// tensors, in table order, form one vector of `numel` elements; it is split into n equal parts of
// part = ceil(numel / n) (the last rank's part padded with zeros past numel), rank r holding
// elements [r part, (r+1) part). A rank's shard is its parts of every unit, unit after unit.
// Why per unit and not ZeRO 1/2's contiguous ranges of the whole flat vector: a unit then lies across
// every rank in equal parts, so gathering it is ONE all-gather of equal parts (and its gradient one
// reduce-scatter) in which every rank sends and receives the same bytes; cut from the flat vector, a
// block lies in one or two ranks' ranges and its gather would be a broadcast from them, their links
// carrying n-1 copies while the others' idle, and of unequal sizes that all-gather cannot take.
// A rank's shard as a table (shard_table): one 1-D piece per tensor its parts touch, named and
// roled as the tensor, so AdamW (its weight decay by role), the gradient norm and the checkpoint IO
// work on a shard as on a whole set. Tested in tests/parallel/test_zero3.cpp.
#pragma once

#include "model/params.h"

#include <cstdint>
#include <vector>

namespace cw {

struct ShardUnit {
  int layer = -1;               // -1: the tensors outside the blocks
  std::vector<size_t> tensors;  // indices into the table, in table order
  int64_t numel = 0;            // the unit's elements
  int64_t part = 0;             // each rank's share: ceil(numel / ranks), the last padded
};

// A piece of a rank's shard: elements [begin, begin + length) of table tensor `tensor`.
struct ShardPiece {
  size_t tensor = 0;
  int64_t begin = 0, length = 0;
};

class ShardLayout {
 public:
  ShardLayout(const std::vector<ParamSpec>& table, int ranks);

  int ranks() const { return ranks_; }
  const std::vector<ParamSpec>& table() const { return table_; }
  const std::vector<ShardUnit>& units() const { return units_; }
  const ShardUnit& outside() const { return units_[0]; }
  const ShardUnit& block(int l) const { return units_[static_cast<size_t>(l) + 1]; }
  int layers() const { return static_cast<int>(units_.size()) - 1; }
  int64_t largest_block_part() const;  // the block buffers' share per rank

  // Rank r's real elements of unit u (its part less the padding) and where they start in its shard.
  int64_t length(int rank, size_t unit) const;
  int64_t offset(int rank, size_t unit) const;
  int64_t shard_numel(int rank) const;  // every unit's length, summed
  // Rank r's pieces, unit after unit (its shard's flat vector in this order), and as a table of
  // 1-D tensors (names and roles of the table's).
  std::vector<ShardPiece> pieces(int rank) const;
  std::vector<ParamSpec> shard_table(int rank) const;

 private:
  std::vector<ParamSpec> table_;
  int ranks_;
  std::vector<ShardUnit> units_;
};

// Collects a whole set (the table's) from every rank's shard set, and the other way: what the
// checkpoints' consolidation and the checks use. shards[r] must have shard_table(r).
void assemble_from_shards(const ParamSet& whole, const ShardLayout& layout, const std::vector<const ParamSet*>& shards);
void shard_from_whole(const ParamSet& shard, const ShardLayout& layout, int rank, const ParamSet& whole);

}  // namespace cw
