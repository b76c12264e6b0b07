#include "model/tokenizer.h"

#include "model/gguf.h"
#include "model/json_fields.h"

#include "engine/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <cctype>
#include <sstream>
#include <unordered_map>

namespace cw {

std::vector<uint32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  encode_into(text, ids);
  return ids;
}

// ---- the byte map ----

namespace {

bool maps_to_itself(unsigned b) {
  return (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
}

struct ByteMap {
  std::array<uint32_t, 256> to_unicode{};
  std::array<int16_t, 0x200> from_unicode{};  // every image lies below U+0200
  ByteMap() {
    from_unicode.fill(-1);
    uint32_t next = 0x100;
    for (unsigned b = 0; b < 256; ++b) {
      to_unicode[b] = maps_to_itself(b) ? b : next++;
      from_unicode[to_unicode[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap map;
  return map;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xc0 | cp >> 6));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xe0 | cp >> 12));
    out.push_back(static_cast<char>(0x80 | (cp >> 6 & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out.push_back(static_cast<char>(0xf0 | cp >> 18));
    out.push_back(static_cast<char>(0x80 | (cp >> 12 & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp >> 6 & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

// The length of the well-formed UTF-8 sequence at s[i], or of the maximal subpart of one that is
// cut short (with *valid false): Unicode's table 3-7 of well-formed byte sequences.
size_t utf8_sequence(std::string_view s, size_t i, bool* valid) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned c = byte(i);
  *valid = true;
  if (c < 0x80) return 1;
  size_t len;
  unsigned lo = 0x80, hi = 0xbf;  // the range of the second byte
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    if (c == 0xe0) lo = 0xa0;  // no overlong forms
    if (c == 0xed) hi = 0x9f;  // no surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;  // nothing above U+10FFFF
  } else {
    *valid = false;
    return 1;
  }
  for (size_t k = 1; k < len; ++k) {
    const unsigned lower = k == 1 ? lo : 0x80, upper = k == 1 ? hi : 0xbf;
    if (i + k >= s.size() || byte(i + k) < lower || byte(i + k) > upper) {
      *valid = false;
      return k;
    }
  }
  return len;
}

// The code point of the well-formed sequence s[i, i+len).
uint32_t decode_utf8(std::string_view s, size_t i, size_t len) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  if (len == 1) return byte(i);
  uint32_t cp = byte(i) & (0x7f >> len);
  for (size_t k = 1; k < len; ++k) cp = cp << 6 | (byte(i + k) & 0x3f);
  return cp;
}

// SentencePiece's stand-in for the space, U+2581 LOWER ONE EIGHTH BLOCK, in UTF-8.
constexpr const char* kMetaspace = "\xE2\x96\x81";

// What a SentencePiece-style token decodes to: a byte token <0xXX> its byte (HF's ByteFallback
// decoder, which reads the two digits in either case), any other token its text with "▁" as the
// space (the Replace decoder).
std::string sentencepiece_token_bytes(const std::string& token) {
  if (token.size() == 6 && token.starts_with("<0x") && token.back() == '>' &&
      std::isxdigit(static_cast<unsigned char>(token[3])) && std::isxdigit(static_cast<unsigned char>(token[4])))
    return std::string(1, static_cast<char>(std::stoi(token.substr(3, 2), nullptr, 16)));
  std::string out;
  for (size_t i = 0; i < token.size();) {
    if (token.compare(i, 3, kMetaspace) == 0) {
      out += ' ';
      i += 3;
    } else {
      out += token[i++];
    }
  }
  return out;
}

}  // namespace

uint32_t byte_to_unicode(uint8_t byte) { return byte_map().to_unicode[byte]; }

int byte_from_unicode(uint32_t code_point) {
  return code_point < byte_map().from_unicode.size() ? byte_map().from_unicode[code_point] : -1;
}

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) append_utf8(out, byte_to_unicode(static_cast<uint8_t>(c)));
  return out;
}

std::optional<std::string> byte_level_to_bytes(std::string_view token) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    bool valid;
    const size_t len = utf8_sequence(token, i, &valid);
    if (!valid) return std::nullopt;
    const int b = byte_from_unicode(decode_utf8(token, i, len));
    if (b < 0) return std::nullopt;
    out.push_back(static_cast<char>(b));
    i += len;
  }
  return out;
}

std::string replace_invalid_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    bool valid;
    const size_t len = utf8_sequence(bytes, i, &valid);
    if (valid)
      out.append(bytes.substr(i, len));
    else
      out.append("\xef\xbf\xbd");  // U+FFFD for the maximal subpart s[i, i+len)
    i += len;
  }
  return out;
}

// ---- NFC ----

namespace {

// Every code point below U+0300 is NFC and combines with nothing before it (canonical combining
// class 0, NFC_Quick_Check Yes), and a UTF-8 string holds one at or above U+0300 only where some
// byte is 0xCC or more: such text (ASCII, Latin-1, most European text) is its own NFC.
bool below_u0300(std::string_view bytes) {
  return std::all_of(bytes.begin(), bytes.end(), [](char c) { return static_cast<unsigned char>(c) < 0xcc; });
}

// NFC of valid UTF-8, appended to out. UTF8PROC_STABLE|UTF8PROC_COMPOSE is utf8proc_NFC without
// NULLTERM: the length is given, so a NUL byte is a character like any other. utf8proc's Unicode
// version may be newer than HF's tables; NFC is stable across versions for every character assigned
// in both, so only characters unassigned in the older one could differ.
void append_nfc(std::string& out, std::string_view valid) {
  if (below_u0300(valid)) {
    out.append(valid);
    return;
  }
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(valid.data()), static_cast<utf8proc_ssize_t>(valid.size()),
                   &result, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0)  // valid UTF-8 fails only when memory runs out
    fail(fmt::format("NFC normalization of {} bytes failed: {}", valid.size(), utf8proc_errmsg(n)));
  out.append(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
  std::free(result);
}

}  // namespace

std::string nfc_normalize(std::string_view bytes) {
  if (below_u0300(bytes)) return std::string(bytes);
  std::string out;
  out.reserve(bytes.size());
  size_t run = 0;  // the start of the current valid stretch
  for (size_t i = 0; i < bytes.size();) {
    bool valid;
    const size_t len = utf8_sequence(bytes, i, &valid);
    if (!valid) {
      append_nfc(out, bytes.substr(run, i - run));
      out.append(bytes.substr(i, len));
      run = i + len;
    }
    i += len;
  }
  append_nfc(out, bytes.substr(run));
  return out;
}

// ---- BpeTokenizer ----

// Bounded: cleared when it reaches kEntries; pieces longer than kMaxPieceBytes (rare: long runs of
// letters or spaces) are not kept. The mutex makes encode safe from several threads.
struct BpeTokenizer::PieceCache {
  static constexpr size_t kEntries = size_t{1} << 16;
  static constexpr size_t kMaxPieceBytes = 64;
  std::mutex mutex;
  std::unordered_map<std::string, std::vector<uint32_t>, StringHash, std::equal_to<>> ids;
};

BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

BpeTokenizer::BpeTokenizer(BpeDefinition def)
    : source_(def.source),
      pretokenizer_(def.pretokenizer_patterns, def.pretokenizer_name, def.source),
      ignore_merges_(def.ignore_merges),
      cache_(std::make_unique<PieceCache>()) {
  const std::string& src = def.source;
  const std::string damaged = "the tokenizer file is damaged or not a byte-level BPE tokenizer";
  if (def.tokens.empty()) fail(fmt::format("{}: the vocabulary is empty", src), damaged);
  if (def.tokens.size() > (size_t{1} << 31))
    fail(fmt::format("{}: the vocabulary has {} tokens, more than 2^31", src, def.tokens.size()), damaged);
  const auto vocab = static_cast<uint32_t>(def.tokens.size());

  // Added tokens: their content is the token's text (it replaces the vocabulary's spelling at its id).
  special_.assign(vocab, false);
  for (const AddedToken& a : def.added) {
    if (a.id >= vocab)
      fail(fmt::format("{}: added token '{}' has id {}, outside the vocabulary of {}", src, a.content, a.id, vocab),
           damaged);
    if (a.content.empty()) fail(fmt::format("{}: added token {} has empty content", src, a.id), damaged);
    def.tokens[a.id] = a.content;
    special_[a.id] = a.special;
  }

  byte_fallback_ = def.byte_fallback;
  prepend_metaspace_ = def.prepend_metaspace;
  strip_leading_space_ = def.strip_leading_space;
  token_text_ = std::move(def.tokens);
  token_bytes_.resize(vocab);
  id_of_text_.reserve(vocab);
  for (uint32_t id = 0; id < vocab; ++id) {
    const auto [it, inserted] = id_of_text_.emplace(token_text_[id], id);
    if (!inserted)
      fail(fmt::format("{}: token '{}' appears twice, as ids {} and {}", src, token_text_[id], it->second, id),
           damaged);
    // HF's ByteLevel decoder: a token all of whose characters stand for bytes gives those bytes;
    // any other token (only an added one can be such) gives its own text. SentencePiece-style: its
    // byte (ByteFallback), or its text with "▁" as the space (Replace).
    token_bytes_[id] = byte_fallback_ ? sentencepiece_token_bytes(token_text_[id])
                                      : byte_level_to_bytes(token_text_[id]).value_or(token_text_[id]);
  }

  int missing_bytes = 0;
  for (unsigned b = 0; b < 256; ++b) {
    std::string symbol;
    if (byte_fallback_) symbol = fmt::format("<0x{:02X}>", b);
    else append_utf8(symbol, byte_to_unicode(static_cast<uint8_t>(b)));
    const auto it = id_of_text_.find(symbol);
    byte_token_[b] = it == id_of_text_.end() ? kNoToken : it->second;
    missing_bytes += it == id_of_text_.end();
  }
  // Real vocabularies may lack a few (SmolLM2 lacks 21: bytes that never occur in UTF-8 and rare
  // control characters), but one that lacks most is not byte-level. (With byte fallback a missing
  // byte token only sends its characters to the unknown token.)
  if (!byte_fallback_ && missing_bytes > 128)
    fail(fmt::format("{}: the vocabulary has tokens for only {} of the 256 byte characters", src, 256 - missing_bytes),
         "this is not a byte-level BPE vocabulary (GPT-2's byte-to-unicode map)");
  if (def.unk_token) {
    unk_id_ = id_of_text_.count(*def.unk_token) ? std::optional(id_of_text_.at(*def.unk_token)) : std::nullopt;
    if (!unk_id_)
      fail(fmt::format("{}: the unknown token '{}' is not in the vocabulary", src, *def.unk_token), damaged);
  }
  fuse_unk_ = def.fuse_unk;

  if (!def.scores.empty()) {
    if (!def.merges.empty())
      fail(fmt::format("{}: the vocabulary has scores, from which the merges come, and {} merges besides", src,
                       def.merges.size()),
           damaged);
    if (def.scores.size() != vocab)
      fail(fmt::format("{}: {} scores for {} tokens", src, def.scores.size(), vocab), damaged);
    // Ranked by a sort, which a NaN would leave without an order.
    for (uint32_t id = 0; id < vocab; ++id)
      if (!std::isfinite(def.scores[id]))
        fail(fmt::format("{}: the score of token {} ('{}') is {}", src, id, token_text_[id], def.scores[id]), damaged);
    merges_from_scores(def.scores);
  } else {
    merges_.reserve(def.merges.size());
    for (size_t order = 0; order < def.merges.size(); ++order) {
      // Plain references, not a structured binding: clang before 16 cannot capture a binding in a lambda.
      const std::string& left = def.merges[order].first;
      const std::string& right = def.merges[order].second;
      const auto id_of = [&](const std::string& text, const char* what) {
        const auto it = id_of_text_.find(text);
        if (it == id_of_text_.end())
          fail(fmt::format("{}: merge {} ('{} {}'): its {} '{}' is not in the vocabulary", src, order, left, right,
                           what, text),
               damaged);
        return it->second;
      };
      const uint32_t l = id_of(left, "left part"), r = id_of(right, "right part");
      const uint32_t merged = id_of(left + right, "result");
      const auto rank = static_cast<uint32_t>(order);
      if (!merges_.emplace(pair_key(l, r), Merge{rank, merged, rank}).second)
        fail(fmt::format("{}: merge {} ('{} {}') repeats an earlier merge", src, order, left, right), damaged);
    }
    merge_count_ = def.merges.size();
  }

  // HF's two sets of added tokens (tokenizers' AddedVocabulary::refresh_added_tokens): those with
  // `normalized` are looked for in normalized text, so by their normalized content.
  normalizer_ = def.normalizer;
  added_ = std::move(def.added);
  for (const AddedToken& a : added_) {
    AddedMatcher& set = a.normalized ? normalized_added_ : raw_added_;
    std::string storage;
    std::string text(a.normalized ? normalize(a.content, storage) : std::string_view(a.content));
    set.first_byte[static_cast<unsigned char>(text[0])] = true;
    set.texts.emplace_back(std::move(text), a.id);
  }
  for (AddedMatcher* set : {&raw_added_, &normalized_added_})
    std::stable_sort(set->texts.begin(), set->texts.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });

  const auto check_id = [&](const std::optional<uint32_t>& id, const char* what) {
    if (id && *id >= vocab)
      fail(fmt::format("{}: the {} id {} is outside the vocabulary of {}", src, what, *id, vocab), damaged);
  };
  check_id(def.bos_id, "BOS");
  check_id(def.eos_id, "EOS");
  check_id(def.pad_id, "padding");
  bos_id_ = def.bos_id;
  eos_id_ = def.eos_id;
  pad_id_ = def.pad_id;
  if (def.add_bos && !bos_id_)
    fail(fmt::format("{}: a prompt is to start with BOS (add_bos_token) but the tokenizer has no BOS token", src),
         "give the BOS token (bos_token in tokenizer_config.json, tokenizer.ggml.bos_token_id in a GGUF file)");
  add_bos_ = def.add_bos;
  chat_template_ = std::move(def.chat_template);
}

std::pair<size_t, size_t> BpeTokenizer::AddedMatcher::find(std::string_view text, size_t from) const {
  constexpr size_t npos = std::string_view::npos;
  if (texts.empty()) return {npos, npos};
  for (size_t i = from; i < text.size(); ++i) {
    if (!first_byte[static_cast<unsigned char>(text[i])]) continue;
    // texts is sorted longest first, so the first that matches here is the longest.
    for (size_t k = 0; k < texts.size(); ++k)
      if (text.compare(i, texts[k].first.size(), texts[k].first) == 0) return {i, k};
  }
  return {npos, npos};
}

namespace {

// The text cut at the added tokens `matcher` finds (leftmost, longest there): `between` encodes each
// stretch between them (possibly empty) into `out`, and each token found adds its id.
template <class Matcher, class Between>
void split_at_added(const Matcher& matcher, std::string_view text, std::vector<uint32_t>& out, Between&& between) {
  constexpr size_t npos = std::string_view::npos;
  size_t pos = 0;
  while (pos <= text.size()) {
    const auto [at, which] = matcher.find(text, pos);
    between(text.substr(pos, at == npos ? npos : at - pos));
    if (which == npos) break;
    out.push_back(matcher.texts[which].second);
    pos = at + matcher.texts[which].first.size();
  }
}

}  // namespace

// HF's TokenizerImpl::encode_single_sequence through AddedVocabulary::extract_and_normalize: the
// `normalized: false` added tokens are cut out of the raw text first, then each stretch between them
// is normalized on its own (so nothing composes across such a token, e.g. "e<|im_end|>\u0301"), and
// only then are the `normalized: true` ones looked for, in the normalized stretch.
void BpeTokenizer::encode_into(std::string_view text, std::vector<uint32_t>& out) const {
  split_at_added(raw_added_, text, out, [&](std::string_view stretch) { encode_stretch(stretch, out); });
}

std::string_view BpeTokenizer::normalize(std::string_view text, std::string& storage) const {
  storage.clear();
  if (normalizer_ == Normalizer::nfc) {
    storage = nfc_normalize(text);
    return storage;
  }
  if (!byte_fallback_) return text;
  // HF's Prepend adds to a non-empty string only; Replace then writes "▁" for each space.
  if (prepend_metaspace_ && !text.empty()) storage += kMetaspace;
  for (const char c : text) {
    if (c == ' ') storage += kMetaspace;
    else storage += c;
  }
  return storage;
}

void BpeTokenizer::encode_stretch(std::string_view text, std::vector<uint32_t>& out) const {
  std::string normalized;
  text = normalize(text, normalized);
  split_at_added(normalized_added_, text, out, [&](std::string_view piece) { encode_pieces(piece, out); });
}

void BpeTokenizer::encode_pieces(std::string_view text, std::vector<uint32_t>& out) const {
  thread_local std::vector<std::string_view> pieces;
  pieces.clear();
  pretokenizer_.split_into(text, pieces);
  for (std::string_view piece : pieces) encode_piece(piece, out);
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<uint32_t>& out) const {
  const bool cacheable = piece.size() <= PieceCache::kMaxPieceBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_->mutex);
    const auto it = cache_->ids.find(piece);
    if (it != cache_->ids.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  bpe(piece, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_->mutex);
    if (cache_->ids.size() >= PieceCache::kEntries) cache_->ids.clear();
    cache_->ids.emplace(std::string(piece), std::vector<uint32_t>(out.begin() + first, out.end()));
  }
}

void BpeTokenizer::bpe(std::string_view piece, std::vector<uint32_t>& out) const {
  if (ignore_merges_) {
    const auto it = id_of_text_.find(byte_fallback_ ? std::string(piece) : bytes_to_byte_level(piece));
    if (it != id_of_text_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // The symbols as a doubly linked list over their starting positions; a merged-away symbol is
  // marked dead. Candidate merges wait in a min-heap ordered by (rank, position): the lowest rank
  // first, the leftmost among equal ranks. An entry goes stale when either of its symbols changes;
  // it is then skipped. Checking that the pair at its position still merges into the same token is
  // enough: a symbol only changes by growing, which changes the token the pair would make.
  struct Symbol {
    uint32_t id;
    int32_t prev, next;
    bool alive;
  };
  struct Candidate {
    uint32_t rank, merged_id;
    int32_t pos;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<Symbol> symbols;
  thread_local std::vector<Candidate> heap;
  // Byte-level: one symbol per byte. SentencePiece-style: one per character, a character without a
  // token of its own falling back to its bytes' tokens (all of them, or none: HF's byte_fallback).
  // A symbol without a token becomes the unknown token where there is one (consecutive ones fused
  // into one with fuse_unk) and is dropped otherwise, its neighbours becoming adjacent: what HF's BPE
  // does. (Invalid UTF-8 is a character of one byte here; HF's input is always valid.)
  symbols.clear();
  const auto push = [&](uint32_t id) {
    if (id == kNoToken) {
      if (!unk_id_) return;
      if (fuse_unk_ && !symbols.empty() && symbols.back().id == *unk_id_) return;
      id = *unk_id_;
    }
    const auto i = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, i - 1, -1, true});
    if (i > 0) symbols[static_cast<size_t>(i - 1)].next = i;
  };
  if (!byte_fallback_) {
    for (const char c : piece) push(byte_token_[static_cast<unsigned char>(c)]);
  } else {
    for (size_t i = 0; i < piece.size();) {
      bool valid = true;
      const size_t len = utf8_sequence(piece, i, &valid);
      const std::string_view character = piece.substr(i, len);
      const auto it = valid ? id_of_text_.find(character) : id_of_text_.end();
      if (it != id_of_text_.end()) {
        push(it->second);
      } else if (std::all_of(character.begin(), character.end(),
                             [&](char c) { return byte_token_[static_cast<unsigned char>(c)] != kNoToken; })) {
        for (const char c : character) push(byte_token_[static_cast<unsigned char>(c)]);
      } else {
        push(kNoToken);
      }
      i += len;
    }
  }
  const auto n = static_cast<int32_t>(symbols.size());
  if (n == 0) return;
  heap.clear();
  const auto push_pair = [&](int32_t left) {
    const Symbol& l = symbols[static_cast<size_t>(left)];
    if (l.next < 0) return;
    const auto it = merges_.find(pair_key(l.id, symbols[static_cast<size_t>(l.next)].id));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, it->second.merged_id, left});
    std::push_heap(heap.begin(), heap.end(), std::greater<>{});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[static_cast<size_t>(top.pos)];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[static_cast<size_t>(left.next)];
    const auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.merged_id != top.merged_id) continue;
    left.id = top.merged_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[static_cast<size_t>(i)].next)
    out.push_back(symbols[static_cast<size_t>(i)].id);
}

std::string BpeTokenizer::decode(std::span<const uint32_t> ids, bool skip_special) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint32_t id = ids[i];
    if (id >= token_bytes_.size())
      fail(fmt::format("{}: id {} at position {} is not a token (vocabulary size {})", source_, id, i,
                       token_bytes_.size()),
           "the ids come from another tokenizer, or a model's padded vocabulary rows; mask logits of ids past the "
           "vocabulary before sampling");
    if (skip_special && special_[id]) continue;
    text += token_bytes_[id];
  }
  if (strip_leading_space_ && !text.empty() && text.front() == ' ') text.erase(0, 1);
  return text;
}

std::optional<uint32_t> BpeTokenizer::token_id(std::string_view text) const {
  const auto it = id_of_text_.find(text);
  if (it == id_of_text_.end()) return std::nullopt;
  return it->second;
}

const std::string& BpeTokenizer::token_text(uint32_t id) const {
  if (id >= token_text_.size())
    fail(fmt::format("{}: id {} is not a token (vocabulary size {})", source_, id, token_text_.size()));
  return token_text_[id];
}

nlohmann::json BpeTokenizer::to_json() const {
  const auto id_or_null = [](const std::optional<uint32_t>& id) { return id ? nlohmann::json(*id) : nlohmann::json(); };
  return {{"name", "bpe"},
          {"vocab_size", vocab_size()},
          {"merges", merge_count_},
          {"added_tokens", added_.size()},
          {"pretokenizer", pretokenizer_.name()},
          {"bos_token_id", id_or_null(bos_id_)},
          {"eos_token_id", id_or_null(eos_id_)},
          {"pad_token_id", id_or_null(pad_id_)},
          {"add_bos", add_bos_},
          {"normalizer", normalizer_ == Normalizer::nfc ? "NFC"
                         : byte_fallback_           ? (prepend_metaspace_ ? "Prepend + Replace" : "Replace")
                                                    : "none"},
          {"source", source_},
          {"description", byte_fallback_ ? "SentencePiece-style BPE (spaces as U+2581, byte fallback, merges by rank, "
                                           "added tokens split out first)"
                                         : "byte-level BPE (GPT-2 byte map, merges by rank, added tokens split out "
                                           "first)"}};
}

nlohmann::json BpeTokenizer::hf_tokenizer_json() const {
  nlohmann::json vocab = nlohmann::json::object();
  for (uint32_t id = 0; id < token_text_.size(); ++id) vocab[token_text_[id]] = id;
  // merges_ holds each merge once (the constructor refuses repeats): lay them out in their order, which
  // is by rank. Merges of one rank (a SentencePiece vocabulary's equal scores) get HF's ranks in that
  // order: HF then applies them by that order where chunkwise and llama.cpp take the leftmost.
  std::vector<nlohmann::json> by_rank(merge_count_);
  for (const auto& [key, merge] : merges_)
    by_rank[merge.order] = nlohmann::json::array(
        {token_text_[static_cast<uint32_t>(key >> 32)], token_text_[static_cast<uint32_t>(key & 0xffffffffu)]});
  std::vector<AddedToken> added = added_;
  std::sort(added.begin(), added.end(), [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
  nlohmann::json added_tokens = nlohmann::json::array();
  for (const AddedToken& a : added)
    added_tokens.push_back({{"id", a.id}, {"content", a.content}, {"single_word", false}, {"lstrip", false},
                            {"rstrip", false}, {"normalized", a.normalized}, {"special", a.special}});
  // Each pattern is an Isolated split, which is what ByteLevel's own regex and Digits are in HF too;
  // the ByteLevel step then only maps bytes.
  nlohmann::json steps = nlohmann::json::array();
  for (const std::string& pattern : pretokenizer_.patterns())
    steps.push_back({{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}});
  steps.push_back({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}});
  nlohmann::json normalizer = normalizer_ == Normalizer::nfc ? nlohmann::json{{"type", "NFC"}} : nlohmann::json();
  nlohmann::json pre_tokenizer = {{"type", "Sequence"}, {"pretokenizers", std::move(steps)}};
  nlohmann::json decoder = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  if (byte_fallback_) {  // the SentencePiece pipeline of Gemma's and Llama 2's files
    const nlohmann::json replace = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMetaspace}};
    normalizer = prepend_metaspace_ ? nlohmann::json{{"type", "Sequence"},
                                                     {"normalizers", {{{"type", "Prepend"}, {"prepend", kMetaspace}},
                                                                      replace}}}
                                    : replace;
    pre_tokenizer = nullptr;
    nlohmann::json decoders = {{{"type", "Replace"}, {"pattern", {{"String", kMetaspace}}}, {"content", " "}},
                               {{"type", "ByteFallback"}},
                               {{"type", "Fuse"}}};
    if (strip_leading_space_) decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
    decoder = {{"type", "Sequence"}, {"decoders", std::move(decoders)}};
  }
  nlohmann::json post_processor = nullptr;
  if (add_bos_) {
    const std::string& bos = token_text_[*bos_id_];
    const nlohmann::json bos_item = {{"SpecialToken", {{"id", bos}, {"type_id", 0}}}};
    post_processor = {{"type", "TemplateProcessing"},
                      {"single", {bos_item, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                      {"pair",
                       {bos_item, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, bos_item,
                        {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
                      {"special_tokens", {{bos, {{"id", bos}, {"ids", {*bos_id_}}, {"tokens", {bos}}}}}}};
  }
  nlohmann::json model = {{"type", "BPE"},
                          {"dropout", nullptr},
                          {"unk_token", unk_id_ ? nlohmann::json(token_text_[*unk_id_]) : nlohmann::json()},
                          {"continuing_subword_prefix", nullptr},
                          {"end_of_word_suffix", nullptr},
                          {"fuse_unk", fuse_unk_},
                          {"byte_fallback", byte_fallback_},
                          {"ignore_merges", ignore_merges_},
                          {"vocab", std::move(vocab)},
                          {"merges", std::move(by_rank)}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", std::move(added_tokens)},
          {"normalizer", std::move(normalizer)},
          {"pre_tokenizer", std::move(pre_tokenizer)},
          {"post_processor", std::move(post_processor)},
          {"decoder", std::move(decoder)},
          {"model", std::move(model)}};
}

nlohmann::json BpeTokenizer::hf_tokenizer_config_json() const {
  const auto token_or_null = [&](const std::optional<uint32_t>& id) {
    return id ? nlohmann::json(token_text_[*id]) : nlohmann::json();
  };
  nlohmann::json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                           {"bos_token", token_or_null(bos_id_)},
                           {"eos_token", token_or_null(eos_id_)},
                           {"pad_token", token_or_null(pad_id_)},
                           {"unk_token", token_or_null(unk_id_)},
                           {"add_bos_token", add_bos_},
                           {"add_eos_token", false},
                           {"clean_up_tokenization_spaces", false}};
  if (!chat_template_.empty()) config["chat_template"] = chat_template_;
  return config;
}

// ---- loaders ----

namespace {

const char* const kDamagedJson = "the tokenizer.json is damaged or not a byte-level BPE tokenizer";

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(fmt::format("tokenizer file '{}': cannot open: {}", path, std::strerror(errno)), "check the path");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail(fmt::format("tokenizer file '{}': read failed", path), "check that it is a readable file");
  return text.str();
}

nlohmann::json parse_json(const std::string& text, const std::string& source) {
  return json_parse(text, source, "the file is damaged; download it again");
}

bool is_null_or_absent(const nlohmann::json& j, const char* key) {
  return !j.is_object() || !j.contains(key) || j.at(key).is_null();
}

// The typed reads of model/json_fields.h, for the object `j` at key path `where` of `source`.
bool bool_or(const nlohmann::json& j, const char* key, bool fallback, const std::string& source,
             const std::string& where) {
  return JsonObject(j, source, where, kDamagedJson).boolean_or(key, fallback);
}

std::string string_at(const nlohmann::json& j, const char* key, const std::string& source, const std::string& where) {
  return JsonObject(j, source, where, kDamagedJson).string(key);
}

// A literal string as a PCRE2 pattern: every character outside [A-Za-z0-9_] and the non-ASCII
// bytes escaped (PCRE2 takes "\x{..}"-free escapes of any ASCII punctuation).
std::string escape_regex(std::string_view literal) {
  std::string out;
  for (char c : literal) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u) && c != '_') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// Appends the split patterns of an HF pre_tokenizer node; `byte_level` is set by its ByteLevel.
void parse_pretokenizer(const nlohmann::json& node, std::vector<std::string>& patterns, bool& byte_level,
                        const std::string& source, const std::string& where) {
  const std::string type = string_at(node, "type", source, where);
  if (byte_level)
    fail(fmt::format("{}: {} ('{}') comes after ByteLevel", source, where, type),
         "a split after the byte mapping would see mapped characters; this build supports ByteLevel last only");
  if (type == "Sequence") {
    if (!node.contains("pretokenizers") || !node.at("pretokenizers").is_array())
      fail(fmt::format("{}: {}.pretokenizers is missing or not a list", source, where), kDamagedJson);
    const auto& steps = node.at("pretokenizers");
    for (size_t i = 0; i < steps.size(); ++i)
      parse_pretokenizer(steps[i], patterns, byte_level, source, fmt::format("{}.pretokenizers[{}]", where, i));
  } else if (type == "ByteLevel") {
    if (bool_or(node, "add_prefix_space", false, source, where))
      fail(fmt::format("{}: {}.add_prefix_space is true; this build supports false only", source, where),
           "the GPT-2 / Llama 3 / SmolLM tokenizers have it false; another model's tokenizer is not supported yet");
    if (bool_or(node, "use_regex", true, source, where)) patterns.emplace_back(kGpt2SplitRegex);
    byte_level = true;
  } else if (type == "Split") {
    if (!node.contains("pattern") || !node.at("pattern").is_object())
      fail(fmt::format("{}: {}.pattern is missing or not an object", source, where), kDamagedJson);
    const auto& pattern = node.at("pattern");
    if (pattern.contains("Regex"))
      patterns.push_back(string_at(pattern, "Regex", source, where + ".pattern"));
    else
      patterns.push_back(escape_regex(string_at(pattern, "String", source, where + ".pattern")));
    const std::string behavior = string_at(node, "behavior", source, where);
    if (behavior != "Isolated")
      fail(fmt::format("{}: {}.behavior is '{}'; this build supports 'Isolated' only", source, where, behavior),
           "byte-level BPE tokenizers (GPT-2, Llama 3) split with Isolated");
    if (bool_or(node, "invert", false, source, where))
      fail(fmt::format("{}: {}.invert is true; this build supports false only", source, where), kDamagedJson);
  } else if (type == "Digits") {
    // HF's Digits cuts at every numeric character, one piece per digit or per run of digits.
    patterns.emplace_back(bool_or(node, "individual_digits", false, source, where) ? kDigitsSplitRegex
                                                                                   : R"(\p{N}+)");
  } else {
    fail(fmt::format("{}: {} is a '{}' pre-tokenizer, which this build does not support", source, where, type),
         "supported: ByteLevel, Split (Isolated), Digits and a Sequence of them");
  }
}

// The "normalizer" of a tokenizer.json: none, NFC, or a Sequence of NFC only (NFC of NFC is NFC; an
// empty Sequence changes nothing). Any other normalizer is refused, naming its type.
Normalizer parse_normalizer(const nlohmann::json& root, const std::string& source) {
  if (is_null_or_absent(root, "normalizer")) return Normalizer::none;
  const char* hint =
      "this build applies no normalizer (GPT-2, Llama 3, SmolLM) or NFC (Qwen2, Qwen2.5, Qwen3) only; encode this "
      "model's text with HF tokenizers";
  const nlohmann::json& node = root.at("normalizer");
  if (!node.is_object() || !node.contains("type") || !node.at("type").is_string())
    fail(fmt::format("{}: it has a normalizer ({}), which this build does not support", source, json_found(node)), hint);
  const std::string type = node.at("type").get<std::string>();
  if (type == "NFC") return Normalizer::nfc;
  if (type != "Sequence")
    fail(fmt::format("{}: normalizer.type is '{}', a normalizer this build does not apply", source, type), hint);
  if (!node.contains("normalizers") || !node.at("normalizers").is_array())
    fail(fmt::format("{}: normalizer.normalizers is missing or not a list", source), kDamagedJson);
  const auto& members = node.at("normalizers");
  std::vector<std::string> types;
  for (size_t i = 0; i < members.size(); ++i)
    types.push_back(string_at(members[i], "type", source, fmt::format("normalizer.normalizers[{}]", i)));
  for (size_t i = 0; i < types.size(); ++i)
    if (types[i] != "NFC")
      fail(fmt::format("{}: normalizer is a Sequence of [{}]; normalizer.normalizers[{}].type '{}' is a normalizer "
                       "this build does not apply",
                       source, fmt::join(types, ", "), i, types[i]),
           hint);
  return types.empty() ? Normalizer::none : Normalizer::nfc;
}

// SentencePiece-style tokenizer.json (model.byte_fallback): the normalizer must be Replace(" ", "▁"),
// alone (Gemma) or after Prepend("▁") (Llama 2, Mistral 7B v0.1); returns whether the Prepend is there.
bool parse_sentencepiece_normalizer(const nlohmann::json& root, const std::string& source) {
  const char* hint =
      "this build reads the SentencePiece pipeline of Gemma's and Llama 2's tokenizer.json: the normalizer "
      "Replace(\" \", \"\u2581\") after an optional Prepend(\"\u2581\"); encode this model's text with HF tokenizers";
  if (is_null_or_absent(root, "normalizer"))
    fail(fmt::format("{}: model.byte_fallback without a normalizer: the spaces would not become U+2581", source), hint);
  const nlohmann::json& node = root.at("normalizer");
  const auto is_replace = [&](const nlohmann::json& n, const std::string& where) {
    return string_at(n, "type", source, where) == "Replace" && n.contains("pattern") && n.at("pattern").is_object() &&
           n.at("pattern").contains("String") && n.at("pattern").at("String") == " " && n.contains("content") &&
           n.at("content") == kMetaspace;
  };
  if (is_replace(node, "normalizer")) return false;
  if (string_at(node, "type", source, "normalizer") == "Sequence" && node.contains("normalizers") &&
      node.at("normalizers").is_array() && node.at("normalizers").size() == 2) {
    const auto& first = node.at("normalizers")[0];
    if (string_at(first, "type", source, "normalizer.normalizers[0]") == "Prepend" && first.contains("prepend") &&
        first.at("prepend") == kMetaspace && is_replace(node.at("normalizers")[1], "normalizer.normalizers[1]"))
      return true;
  }
  fail(fmt::format("{}: with model.byte_fallback the normalizer is {}, not the SentencePiece one", source,
                   node.dump().substr(0, 200)),
       hint);
}

// SentencePiece-style tokenizer.json: the decoder must be Replace("▁", " "), ByteFallback, Fuse and
// an optional Strip(" ", 1, 0), in that order; returns whether the Strip is there.
bool parse_sentencepiece_decoder(const nlohmann::json& root, const std::string& source) {
  const char* hint = "this build decodes as Gemma's and Llama 2's tokenizer.json do: Replace(\"\u2581\", \" \"), "
                     "ByteFallback, Fuse, and optionally Strip(\" \", 1, 0)";
  if (is_null_or_absent(root, "decoder"))
    fail(fmt::format("{}: model.byte_fallback without a decoder", source), hint);
  const nlohmann::json& node = root.at("decoder");
  const std::vector<nlohmann::json> expected = {
      {{"type", "Replace"}, {"pattern", {{"String", kMetaspace}}}, {"content", " "}},
      {{"type", "ByteFallback"}},
      {{"type", "Fuse"}},
      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}};
  if (node.is_object() && node.value("type", "") == "Sequence" && node.contains("decoders") &&
      node.at("decoders").is_array()) {
    const auto& steps = node.at("decoders");
    if ((steps.size() == 3 || steps.size() == 4) &&
        std::equal(steps.begin(), steps.end(), expected.begin()))
      return steps.size() == 4;
  }
  fail(fmt::format("{}: with model.byte_fallback the decoder is {}, not the SentencePiece one", source,
                   node.dump().substr(0, 200)),
       hint);
}

// The name of a known pre-tokenizer with exactly these patterns, else "tokenizer.json".
std::string name_of_patterns(const std::vector<std::string>& patterns, const std::string& source) {
  for (const std::string& name : Pretokenizer::known_names())
    if (Pretokenizer::named(name, source).patterns() == patterns) return name;
  return "tokenizer.json";
}

std::pair<std::string, std::string> split_merge(const std::string& merge, size_t rank, const std::string& source,
                                                const std::string& where) {
  const size_t space = merge.find(' ');
  if (space == std::string::npos || space == 0 || space + 1 == merge.size() ||
      merge.find(' ', space + 1) != std::string::npos)
    fail(fmt::format("{}: {}[{}] is '{}', not two tokens separated by one space", source, where, rank, merge),
         "the file is damaged; download it again");
  return {merge.substr(0, space), merge.substr(space + 1)};
}

// The special token a TemplateProcessing post-processor (alone, or in a Sequence) puts before a
// single sequence, if it puts one there.
std::optional<std::string> template_first_special(const nlohmann::json& node) {
  if (!node.is_object() || !node.contains("type") || !node.at("type").is_string()) return std::nullopt;
  const std::string& type = node.at("type").get_ref<const std::string&>();
  if (type == "Sequence" && node.contains("processors") && node.at("processors").is_array()) {
    for (const auto& p : node.at("processors"))
      if (auto first = template_first_special(p)) return first;
    return std::nullopt;
  }
  if (type != "TemplateProcessing" || !node.contains("single") || !node.at("single").is_array() ||
      node.at("single").empty())
    return std::nullopt;
  const auto& item = node.at("single")[0];
  if (!item.is_object() || !item.contains("SpecialToken") || !item.at("SpecialToken").is_object()) return std::nullopt;
  const auto& special = item.at("SpecialToken");
  if (!special.contains("id") || !special.at("id").is_string()) return std::nullopt;
  return special.at("id").get<std::string>();
}

// tokenizer_config.json's bos_token / eos_token: a string, {"content": string}, or null.
std::optional<std::string> config_token(const nlohmann::json& config, const char* key) {
  if (!config.is_object() || is_null_or_absent(config, key)) return std::nullopt;
  const auto& v = config.at(key);
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v.at("content").is_string()) return v.at("content").get<std::string>();
  return std::nullopt;
}

}  // namespace

BpeTokenizer BpeTokenizer::from_tokenizer_json(const std::string& path) {
  const std::string text = read_text_file(path);
  const std::filesystem::path config_path = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  if (std::filesystem::exists(config_path)) {
    const nlohmann::json config = parse_json(read_text_file(config_path.string()), config_path.string());
    return from_tokenizer_json_text(text, path, &config);
  }
  return from_tokenizer_json_text(text, path);
}

BpeTokenizer BpeTokenizer::from_tokenizer_json_text(const std::string& text, const std::string& source,
                                                    const nlohmann::json* tokenizer_config) {
  const nlohmann::json root = parse_json(text, source);
  if (!root.is_object()) fail(fmt::format("{}: not a JSON object", source), kDamagedJson);
  if (!root.contains("model") || !root.at("model").is_object())
    fail(fmt::format("{}: key 'model' is missing or not an object", source), kDamagedJson);
  const nlohmann::json& model = root.at("model");
  if (model.contains("type") && string_at(model, "type", source, "model") != "BPE")
    fail(fmt::format("{}: model.type is '{}', not 'BPE'", source, model.at("type").get<std::string>()),
         "only byte-level BPE tokenizers are supported (not WordPiece, Unigram or WordLevel)");
  // SentencePiece-style BPE (Gemma, Llama 2, Mistral 7B v0.1): its own normalizer and decoder, no
  // pre-tokenizer (model/tokenizer.h).
  const bool sentencepiece = bool_or(model, "byte_fallback", false, source, "model");
  const bool no_dropout = is_null_or_absent(model, "dropout") ||
                          (model.at("dropout").is_number() && model.at("dropout").get<double>() == 0);
  if (!no_dropout)
    fail(fmt::format("{}: model.dropout is set; BPE dropout is for training tokenizers", source),
         "set it to null in the file");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!is_null_or_absent(model, key) && !(model.at(key).is_string() && model.at(key).get<std::string>().empty()))
      fail(fmt::format("{}: model.{} is set, which byte-level BPE does not use", source, key), kDamagedJson);
  if (!sentencepiece && !is_null_or_absent(root, "decoder") &&
      string_at(root.at("decoder"), "type", source, "decoder") != "ByteLevel")
    fail(fmt::format("{}: decoder is '{}', not ByteLevel", source, root.at("decoder").at("type").get<std::string>()),
         kDamagedJson);

  BpeDefinition def;
  def.source = source;
  if (sentencepiece) {
    def.byte_fallback = true;
    def.prepend_metaspace = parse_sentencepiece_normalizer(root, source);
    def.strip_leading_space = parse_sentencepiece_decoder(root, source);
  } else {
    def.normalizer = parse_normalizer(root, source);
  }
  def.ignore_merges = bool_or(model, "ignore_merges", false, source, "model");
  if (!is_null_or_absent(model, "unk_token")) def.unk_token = string_at(model, "unk_token", source, "model");
  def.fuse_unk = bool_or(model, "fuse_unk", false, source, "model");

  if (!model.contains("vocab") || !model.at("vocab").is_object())
    fail(fmt::format("{}: model.vocab is missing or not an object", source), kDamagedJson);
  const auto& vocab = model.at("vocab");
  // The tokens by id, in a map: its size is the number of entries the file holds, whatever ids they
  // claim, so an id like 2^31 - 1 costs no more than any other. The ids must then run 0..N-1.
  std::unordered_map<uint32_t, std::string> by_id;
  uint32_t max_id = 0;
  const auto place = [&](uint32_t id, const std::string& token) {
    by_id[id] = token;
    max_id = std::max(max_id, id);
  };
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= (int64_t{1} << 31))
      fail(fmt::format("{}: model.vocab['{}'] is not an id (an integer in [0, 2^31))", source, token), kDamagedJson);
    const auto i = static_cast<uint32_t>(id.get<int64_t>());
    if (const auto it = by_id.find(i); it != by_id.end())
      fail(fmt::format("{}: model.vocab gives id {} to both '{}' and '{}'", source, i, it->second, token), kDamagedJson);
    place(i, token);
  }

  if (root.contains("added_tokens") && !root.at("added_tokens").is_null()) {
    const auto& added = root.at("added_tokens");
    if (!added.is_array()) fail(fmt::format("{}: added_tokens is not a list", source), kDamagedJson);
    for (size_t i = 0; i < added.size(); ++i) {
      const std::string where = fmt::format("added_tokens[{}]", i);
      const auto& a = added[i];
      if (!a.is_object() || !a.contains("id") || !a.at("id").is_number_integer() || a.at("id").get<int64_t>() < 0 ||
          a.at("id").get<int64_t>() >= (int64_t{1} << 31))
        fail(fmt::format("{}: {}.id is missing or not an id", source, where), kDamagedJson);
      for (const char* option : {"single_word", "lstrip", "rstrip"})
        if (bool_or(a, option, false, source, where))
          fail(fmt::format("{}: {}.{} is true; this build supports added tokens matched exactly only", source, where,
                           option),
               "the GPT-2 / Llama 3 / SmolLM tokenizers do not use it");
      AddedToken token{string_at(a, "content", source, where), static_cast<uint32_t>(a.at("id").get<int64_t>()),
                       bool_or(a, "special", false, source, where)};
      // Absent, HF's default: special tokens are not normalized, other added tokens are.
      token.normalized = bool_or(a, "normalized", !token.special, source, where);
      // An added token may lie outside model.vocab (ids past it); it then defines that id.
      if (!by_id.count(token.id)) place(token.id, token.content);
      def.added.push_back(std::move(token));
    }
  }

  for (uint32_t id = 0; id < by_id.size(); ++id)
    if (!by_id.count(id))
      fail(fmt::format("{}: no token has id {} (the ids go up to {})", source, id, max_id),
           "the vocabulary's ids must be 0..N-1 without gaps");
  def.tokens.reserve(by_id.size());
  for (uint32_t id = 0; id < by_id.size(); ++id) def.tokens.push_back(std::move(by_id.at(id)));

  if (!model.contains("merges") || !model.at("merges").is_array())
    fail(fmt::format("{}: model.merges is missing or not a list", source), kDamagedJson);
  const auto& merges = model.at("merges");
  def.merges.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& m = merges[rank];
    if (m.is_string()) {
      def.merges.push_back(split_merge(m.get<std::string>(), rank, source, "model.merges"));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      def.merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      fail(fmt::format("{}: model.merges[{}] is neither \"left right\" nor [left, right]", source, rank), kDamagedJson);
    }
  }

  bool byte_level = false;
  if (sentencepiece) {
    // Each stretch between added tokens is one piece (Metaspace's splitting is not read).
    if (!is_null_or_absent(root, "pre_tokenizer"))
      fail(fmt::format("{}: with model.byte_fallback the pre_tokenizer is '{}'; this build reads the SentencePiece "
                       "pipeline without one (Gemma's, Llama 2's)",
                       source, root.at("pre_tokenizer").is_object() ? root.at("pre_tokenizer").value("type", "?") : "?"),
           "encode this model's text with HF tokenizers");
    def.pretokenizer_name = "none";
  } else {
    if (is_null_or_absent(root, "pre_tokenizer"))
      fail(fmt::format("{}: key 'pre_tokenizer' is missing", source),
           "byte-level BPE needs a ByteLevel pre-tokenizer; this is not such a tokenizer");
    parse_pretokenizer(root.at("pre_tokenizer"), def.pretokenizer_patterns, byte_level, source, "pre_tokenizer");
    if (!byte_level)
      fail(fmt::format("{}: the pre-tokenizer has no ByteLevel step", source),
           "byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen) needs one; SentencePiece-style BPE sets model.byte_fallback");
    def.pretokenizer_name = name_of_patterns(def.pretokenizer_patterns, source);
  }
  const std::optional<std::string> first_special = is_null_or_absent(root, "post_processor")
                                                       ? std::nullopt
                                                       : template_first_special(root.at("post_processor"));

  if (tokenizer_config) {
    const std::string config_source = fmt::format("tokenizer_config.json beside {}", source);
    const auto lookup = [&](const char* key) -> std::optional<uint32_t> {
      const auto text = config_token(*tokenizer_config, key);
      if (!text) return std::nullopt;
      for (const AddedToken& a : def.added)
        if (a.content == *text) return a.id;
      for (size_t id = 0; id < def.tokens.size(); ++id)
        if (def.tokens[id] == *text) return static_cast<uint32_t>(id);
      fail(fmt::format("{}: {} '{}' is not a token of the vocabulary", config_source, key, *text),
           "the two files do not belong together");
    };
    def.bos_id = lookup("bos_token");
    def.eos_id = lookup("eos_token");
    def.pad_id = lookup("pad_token");
    if (tokenizer_config->contains("add_bos_token") && tokenizer_config->at("add_bos_token").is_boolean())
      def.add_bos = tokenizer_config->at("add_bos_token").get<bool>();
    if (tokenizer_config->contains("chat_template") && tokenizer_config->at("chat_template").is_string())
      def.chat_template = tokenizer_config->at("chat_template").get<std::string>();
  }
  // Llama 3's tokenizer.json puts <|begin_of_text|> first through its post-processor.
  if (first_special && def.bos_id && def.tokens[*def.bos_id] == *first_special) def.add_bos = true;
  return BpeTokenizer(std::move(def));
}

// A SentencePiece vocabulary's scores as merges (model/tokenizer.h): every split of a token, at a
// character boundary, into two tokens is a merge into it (llama.cpp looks the joined text up among all
// tokens, whatever their type); merges ranked by the token's score, highest first, equal scores
// sharing a rank, which the BPE loop applies leftmost first. A token's splits are listed by where they
// cut.
void BpeTokenizer::merges_from_scores(const std::vector<double>& scores) {
  size_t longest = 0;
  for (const std::string& t : token_text_) longest = std::max(longest, t.size());
  // The byte lengths some token has: a cut is only looked up where both parts could be tokens.
  std::vector<bool> is_length(longest + 1, false);
  for (const std::string& t : token_text_) is_length[t.size()] = true;
  std::vector<uint32_t> formed;  // the tokens of two or more bytes, by score
  for (uint32_t id = 0; id < token_text_.size(); ++id)
    if (token_text_[id].size() > 1) formed.push_back(id);
  // Highest score first; among equal scores by id, so that the order (and a tokenizer.json written
  // from it) does not depend on the sort.
  std::stable_sort(formed.begin(), formed.end(), [&](uint32_t a, uint32_t b) { return scores[a] > scores[b]; });
  uint32_t rank = 0, order = 0;
  for (size_t i = 0; i < formed.size(); ++i) {
    if (i > 0 && scores[formed[i]] != scores[formed[i - 1]]) ++rank;
    const std::string& text = token_text_[formed[i]];
    for (size_t cut = 1; cut < text.size(); ++cut) {
      if (!is_length[cut] || !is_length[text.size() - cut]) continue;
      if ((static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) continue;  // inside a character
      const auto left = id_of_text_.find(std::string_view(text.data(), cut));
      const auto right = id_of_text_.find(std::string_view(text.data() + cut, text.size() - cut));
      if (left == id_of_text_.end() || right == id_of_text_.end()) continue;
      // The joined text names one token, so no pair is listed twice.
      merges_.emplace(pair_key(left->second, right->second), Merge{rank, formed[i], order++});
    }
  }
  merge_count_ = order;
}

BpeTokenizer BpeTokenizer::from_gguf(const GgufTokenizerMetadata& meta) {
  const std::string& src = meta.source;
  const char* damaged = "the GGUF file's tokenizer metadata is damaged";
  const bool sentencepiece = meta.model == "llama";
  if (meta.model != "gpt2" && !sentencepiece)
    fail(fmt::format("{}: tokenizer.ggml.model is '{}'; this build reads byte-level BPE ('gpt2') and SentencePiece "
                     "('llama') vocabularies",
                     src, meta.model),
         "use a model with a GPT-2 / Llama 3 / SmolLM / Qwen or a Llama 2 / Mistral / Gemma style tokenizer");
  if (!sentencepiece && meta.pre.empty())
    fail(fmt::format("{}: tokenizer.ggml.pre is missing, so the pre-tokenizer is unknown", src),
         "convert the model with a recent llama.cpp, which records it");
  if (meta.tokens.empty()) fail(fmt::format("{}: tokenizer.ggml.tokens is missing or empty", src), damaged);
  if (!meta.token_type.empty() && meta.token_type.size() != meta.tokens.size())
    fail(fmt::format("{}: tokenizer.ggml.token_type has {} entries for {} tokens", src, meta.token_type.size(),
                     meta.tokens.size()),
         damaged);
  if (sentencepiece && meta.scores.size() != meta.tokens.size())
    fail(fmt::format("{}: tokenizer.ggml.scores has {} entries for {} tokens", src, meta.scores.size(),
                     meta.tokens.size()),
         meta.scores.empty() ? "a SentencePiece vocabulary ('llama') needs its scores; convert the model with llama.cpp"
                             : damaged);

  BpeDefinition def;
  def.source = src;
  def.tokens = meta.tokens;
  // Added tokens (matched in the text first, llama.cpp's special-token cache): the unknown, control
  // and user-defined ones, the first two special.
  constexpr int32_t kUnknown = 2, kControl = 3, kUserDefined = 4;
  for (size_t id = 0; id < meta.token_type.size(); ++id) {
    const int32_t type = meta.token_type[id];
    if (type == kUnknown || type == kControl || type == kUserDefined)
      def.added.push_back({meta.tokens[id], static_cast<uint32_t>(id), type != kUserDefined});
  }
  if (sentencepiece) {
    if (!meta.merges.empty())
      fail(fmt::format("{}: tokenizer.ggml.model is 'llama' (SentencePiece, merges from scores) but the file also "
                       "has {} tokenizer.ggml.merges",
                       src, meta.merges.size()),
           damaged);
    for (size_t id = 0; id < meta.scores.size(); ++id)
      if (!std::isfinite(meta.scores[id]))
        fail(fmt::format("{}: tokenizer.ggml.scores[{}] (token '{}') is {}", src, id, meta.tokens[id], meta.scores[id]),
             "the GGUF file's tokenizer metadata is damaged; every score must be a finite number");
    def.scores = meta.scores;
    def.pretokenizer_name = "none";
    def.byte_fallback = true;
    def.prepend_metaspace = def.strip_leading_space = meta.add_space_prefix.value_or(true);
    if (meta.unknown_token_id) {
      if (*meta.unknown_token_id >= meta.tokens.size())
        fail(fmt::format("{}: tokenizer.ggml.unknown_token_id = {} is outside the vocabulary of {}", src,
                         *meta.unknown_token_id, meta.tokens.size()),
             damaged);
      def.unk_token = meta.tokens[*meta.unknown_token_id];
    }
  } else {
    def.merges.reserve(meta.merges.size());
    for (size_t rank = 0; rank < meta.merges.size(); ++rank)
      def.merges.push_back(split_merge(meta.merges[rank], rank, src, "tokenizer.ggml.merges"));
    Pretokenizer named = Pretokenizer::named(meta.pre, src + " (tokenizer.ggml.pre)");
    def.pretokenizer_patterns = named.patterns();
    def.pretokenizer_name = meta.pre;
    // Llama 3's tokenizer.json sets ignore_merges; GGUF does not record it, llama.cpp applies it by name.
    def.ignore_merges = Pretokenizer::named_ignores_merges(meta.pre);
  }
  def.bos_id = meta.bos_token_id;
  def.eos_id = meta.eos_token_id;
  def.pad_id = meta.padding_token_id;
  // llama.cpp puts BOS first by default for a SentencePiece vocabulary (which has one).
  def.add_bos = meta.add_bos_token.value_or(sentencepiece && meta.bos_token_id.has_value());
  def.chat_template = meta.chat_template;
  return BpeTokenizer(std::move(def));
}

BpeTokenizer BpeTokenizer::from_gguf_file(const std::string& path) {
  const GgufReader gguf(path);
  GgufTokenizerMetadata meta;
  meta.source = path;
  meta.model = gguf.get_string("tokenizer.ggml.model");
  meta.pre = gguf.get_string("tokenizer.ggml.pre", "");
  meta.tokens = gguf.get_strings("tokenizer.ggml.tokens");
  if (gguf.has("tokenizer.ggml.merges")) meta.merges = gguf.get_strings("tokenizer.ggml.merges");
  if (gguf.has("tokenizer.ggml.token_type"))
    for (int64_t t : gguf.get_ints("tokenizer.ggml.token_type")) meta.token_type.push_back(static_cast<int32_t>(t));
  const auto id = [&](const char* key) -> std::optional<uint32_t> {
    if (!gguf.has(key)) return std::nullopt;
    const int64_t v = gguf.get_int(key);
    CW_CHECK(v >= 0 && v <= int64_t{UINT32_MAX}, "{}: {} = {} is not a token id", path, key, v);
    return static_cast<uint32_t>(v);
  };
  meta.bos_token_id = id("tokenizer.ggml.bos_token_id");
  meta.eos_token_id = id("tokenizer.ggml.eos_token_id");
  meta.padding_token_id = id("tokenizer.ggml.padding_token_id");
  if (gguf.has("tokenizer.ggml.add_bos_token")) meta.add_bos_token = gguf.get_bool("tokenizer.ggml.add_bos_token");
  if (gguf.has("tokenizer.ggml.add_space_prefix"))
    meta.add_space_prefix = gguf.get_bool("tokenizer.ggml.add_space_prefix");
  if (gguf.has("tokenizer.ggml.scores")) meta.scores = gguf.get_floats("tokenizer.ggml.scores");
  meta.unknown_token_id = id("tokenizer.ggml.unknown_token_id");
  meta.chat_template = gguf.get_string("tokenizer.chat_template", "");
  return from_gguf(meta);
}

}  // namespace cw
