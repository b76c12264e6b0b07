#include "parallel/zero3_layout.h"

#include "engine/error.h"

#include <algorithm>

namespace cw {

ShardLayout::ShardLayout(const std::vector<ParamSpec>& table, int ranks) : table_(table), ranks_(ranks) {
  CW_CHECK(ranks >= 1, "ZeRO 3: {} ranks", ranks);
  int L = 0;
  for (const ParamSpec& s : table) {
    CW_CHECK(!s.is_adapter(), "ZeRO 3 shards a model's own parameters, not LoRA adapters ({})", s.name);
    L = std::max(L, s.layer + 1);
  }
  units_.resize(static_cast<size_t>(L) + 1);
  for (size_t u = 0; u < units_.size(); ++u) units_[u].layer = static_cast<int>(u) - 1;
  for (size_t i = 0; i < table.size(); ++i) {
    ShardUnit& u = units_[static_cast<size_t>(table[i].layer + 1)];
    u.tensors.push_back(i);
    u.numel += table[i].numel();
  }
  for (ShardUnit& u : units_) {
    CW_CHECK(u.numel > 0, "ZeRO 3: unit of layer {} has no parameters", u.layer);
    u.part = (u.numel + ranks - 1) / ranks;
  }
}

int64_t ShardLayout::largest_block_part() const {
  int64_t part = 0;
  for (size_t u = 1; u < units_.size(); ++u) part = std::max(part, units_[u].part);
  return part;
}

int64_t ShardLayout::length(int rank, size_t unit) const {
  const ShardUnit& u = units_[unit];
  return std::clamp<int64_t>(u.numel - static_cast<int64_t>(rank) * u.part, 0, u.part);
}

int64_t ShardLayout::offset(int rank, size_t unit) const {
  int64_t at = 0;
  for (size_t v = 0; v < unit; ++v) at += length(rank, v);
  return at;
}

int64_t ShardLayout::shard_numel(int rank) const { return offset(rank, units_.size()); }

std::vector<ShardPiece> ShardLayout::pieces(int rank) const {
  std::vector<ShardPiece> out;
  for (size_t v = 0; v < units_.size(); ++v) {
    const ShardUnit& u = units_[v];
    const int64_t lo = static_cast<int64_t>(rank) * u.part, hi = lo + length(rank, v);
    int64_t at = 0;  // the tensor's first element in the unit
    for (size_t i : u.tensors) {
      const int64_t n = table_[i].numel(), b = std::max(lo, at), e = std::min(hi, at + n);
      if (b < e) out.push_back({i, b - at, e - b});
      at += n;
    }
  }
  return out;
}

std::vector<ParamSpec> ShardLayout::shard_table(int rank) const {
  std::vector<ParamSpec> out;
  for (const ShardPiece& p : pieces(rank)) {
    ParamSpec s = table_[p.tensor];
    s.shape = {p.length};
    out.push_back(std::move(s));
  }
  return out;
}

namespace {
// Each piece of rank r's shard against its range of the whole set's tensor (both flat).
template <class Fn> void for_each_piece(const ShardLayout& layout, int rank, const ParamSet& whole,
                                        const ParamSet& shard, Fn fn) {
  const std::vector<ShardPiece> pieces = layout.pieces(rank);
  CW_CHECK(same_table(whole.specs(), layout.table()), "ZeRO 3: the whole set does not have the layout's table");
  CW_CHECK(shard.size() == pieces.size(), "ZeRO 3: rank {}'s shard set has {} tensors, its layout {}", rank,
           shard.size(), pieces.size());
  for (size_t k = 0; k < pieces.size(); ++k) {
    const ShardPiece& p = pieces[k];
    CW_CHECK(shard[k].numel() == p.length, "ZeRO 3: rank {}'s piece {} of {} has {} elements, its layout {}", rank, k,
             layout.table()[p.tensor].name, shard[k].numel(), p.length);
    const Tensor& t = whole[p.tensor];
    fn(Tensor(t.data, t.dtype, t.device, {t.numel()}).slice(0, p.begin, p.length), shard[k]);
  }
}
}  // namespace

void assemble_from_shards(const ParamSet& whole, const ShardLayout& layout, const std::vector<const ParamSet*>& shards) {
  CW_CHECK(static_cast<int>(shards.size()) == layout.ranks(), "ZeRO 3: {} shard sets for {} ranks", shards.size(),
           layout.ranks());
  for (int r = 0; r < layout.ranks(); ++r)
    for_each_piece(layout, r, whole, *shards[static_cast<size_t>(r)],
                   [](const Tensor& range, const Tensor& piece) { copy_convert(range, piece); });
}

void shard_from_whole(const ParamSet& shard, const ShardLayout& layout, int rank, const ParamSet& whole) {
  for_each_piece(layout, rank, whole, shard, [](const Tensor& range, const Tensor& piece) { copy_convert(piece, range); });
}

}  // namespace cw
