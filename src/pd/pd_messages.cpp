#include "pd/pd_messages.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "common/json_depth.h"

namespace siesta::pd {
namespace {

using nlohmann::json;

json envelope(const char* op) { return json{{"v", kProtocolVersion}, {"op", op}}; }

Status bad(const std::string& op, const std::string& what) {
  return corrupt("P/D message '" + op + "': " + what);
}

Result<std::string> get_string(const json& j, const std::string& op, const char* key, bool allow_empty = false) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return bad(op, std::string("field '") + key + "' must be a string");
  std::string v = it->get<std::string>();
  if (v.empty() && !allow_empty) return bad(op, std::string("field '") + key + "' must not be empty");
  return v;
}

Result<int64_t> get_int(const json& j, const std::string& op, const char* key, int64_t lo, int64_t hi) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) return bad(op, std::string("field '") + key + "' must be an integer");
  const int64_t v = it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
                        ? INT64_MAX
                        : it->get<int64_t>();
  if (v < lo || v > hi)
    return bad(op, std::string("field '") + key + "' is " + std::to_string(v) + ", outside [" + std::to_string(lo) +
                       ", " + std::to_string(hi) + "]");
  return v;
}

Result<uint64_t> get_u64(const json& j, const std::string& op, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned()) {
    if (it != j.end() && it->is_number_integer() && it->get<int64_t>() >= 0) return it->get<uint64_t>();
    return bad(op, std::string("field '") + key + "' must be a non-negative integer");
  }
  return it->get<uint64_t>();
}

// 64-bit values that JSON readers elsewhere may round go as decimal strings.
std::string u64_text(uint64_t v) { return std::to_string(v); }

Result<uint64_t> get_u64_text(const json& j, const std::string& op, const char* key) {
  SIESTA_ASSIGN_OR_RETURN(std::string s, get_string(j, op, key));
  if (s.size() > 20) return bad(op, std::string("field '") + key + "' is not a 64-bit number");
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return bad(op, std::string("field '") + key + "' is not a decimal number");
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (std::numeric_limits<uint64_t>::max() - d) / 10) return bad(op, std::string("field '") + key + "' overflows");
    v = v * 10 + d;
  }
  return v;
}

json prompt_json(const PromptCheck& p) {
  return json{{"num_tokens", p.num_tokens},
              {"hash", u64_text(p.hash)},
              {"layout", p.layout},
              {"block_bytes", p.block_bytes}};
}

Result<PromptCheck> prompt_from(const json& j, const std::string& op) {
  auto it = j.find("prompt");
  if (it == j.end() || !it->is_object()) return bad(op, "field 'prompt' must be an object");
  PromptCheck p;
  SIESTA_ASSIGN_OR_RETURN(int64_t n, get_int(*it, op, "num_tokens", 1, INT32_MAX));
  p.num_tokens = static_cast<int32_t>(n);
  SIESTA_ASSIGN_OR_RETURN(p.hash, get_u64_text(*it, op, "hash"));
  SIESTA_ASSIGN_OR_RETURN(p.layout, get_string(*it, op, "layout"));
  SIESTA_ASSIGN_OR_RETURN(p.block_bytes, get_u64(*it, op, "block_bytes"));
  return p;
}

// A request's logits_top: absent is 0 (the whole row).
Result<int32_t> logits_top_of(const json& j, const std::string& op) {
  if (!j.contains("logits_top")) return 0;
  SIESTA_ASSIGN_OR_RETURN(int64_t n, get_int(j, op, "logits_top", 0, kMaxLogitsTop));
  return static_cast<int32_t>(n);
}

Result<std::vector<int32_t>> blocks_from(const json& j, const std::string& op) {
  auto blocks = j.find("blocks");
  if (blocks == j.end() || !blocks->is_array()) return bad(op, "field 'blocks' must be an array");
  std::vector<int32_t> out;
  out.reserve(blocks->size());
  for (const json& b : *blocks) {
    if (!b.is_number_integer() || b.get<int64_t>() < 0 || b.get<int64_t>() > INT32_MAX)
      return bad(op, "field 'blocks' must hold block ids (non-negative integers)");
    out.push_back(b.get<int32_t>());
  }
  return out;
}

Result<PdMessage> decode_object(const json& j) {
  if (!j.is_object()) return corrupt("P/D message is not a JSON object");
  auto v = j.find("v");
  if (v == j.end() || !v->is_number_integer() || v->get<int64_t>() != kProtocolVersion)
    return corrupt("P/D message of protocol version " + (v == j.end() ? std::string("(none)") : v->dump()) +
                   "; this engine speaks version " + std::to_string(kProtocolVersion));
  SIESTA_ASSIGN_OR_RETURN(std::string op, get_string(j, "?", "op"));
  if (op == "write") {
    WriteRequest m;
    SIESTA_ASSIGN_OR_RETURN(m.x_request_id, get_string(j, op, "x_request_id"));
    SIESTA_ASSIGN_OR_RETURN(int64_t choice, get_int(j, op, "choice", 0, INT32_MAX));
    m.choice = static_cast<int32_t>(choice);
    SIESTA_ASSIGN_OR_RETURN(m.consumer_request, get_string(j, op, "consumer_request"));
    SIESTA_ASSIGN_OR_RETURN(m.consumer_engine, get_string(j, op, "consumer_engine"));
    SIESTA_ASSIGN_OR_RETURN(m.consumer_address, get_string(j, op, "consumer_address"));
    SIESTA_ASSIGN_OR_RETURN(m.region, get_u64_text(j, op, "region"));
    SIESTA_ASSIGN_OR_RETURN(m.epoch, get_u64_text(j, op, "epoch"));
    SIESTA_ASSIGN_OR_RETURN(int64_t first, get_int(j, op, "first_block", 0, INT32_MAX));
    m.first_block = static_cast<int32_t>(first);
    SIESTA_ASSIGN_OR_RETURN(m.blocks, blocks_from(j, op));
    SIESTA_ASSIGN_OR_RETURN(m.prompt, prompt_from(j, op));
    SIESTA_ASSIGN_OR_RETURN(m.deadline_unix_ms, get_int(j, op, "deadline_unix_ms", 0, INT64_MAX));
    SIESTA_ASSIGN_OR_RETURN(m.logits_top, logits_top_of(j, op));
    if (j.contains("producer_engine")) {
      SIESTA_ASSIGN_OR_RETURN(m.producer_engine, get_string(j, op, "producer_engine"));
    }
    return PdMessage{std::move(m)};
  }
  if (op == "cancel") {
    CancelRequest m;
    SIESTA_ASSIGN_OR_RETURN(m.x_request_id, get_string(j, op, "x_request_id", true));
    SIESTA_ASSIGN_OR_RETURN(int64_t choice, get_int(j, op, "choice", 0, INT32_MAX));
    m.choice = static_cast<int32_t>(choice);
    SIESTA_ASSIGN_OR_RETURN(m.producer_request, get_string(j, op, "producer_request", true));
    if (m.x_request_id.empty() && m.producer_request.empty())
      return bad(op, "names no request (x_request_id or producer_request)");
    return PdMessage{std::move(m)};
  }
  if (op == "read_start") {
    ReadStart m;
    SIESTA_ASSIGN_OR_RETURN(m.producer_request, get_string(j, op, "producer_request"));
    SIESTA_ASSIGN_OR_RETURN(int64_t first, get_int(j, op, "first_block", 0, INT32_MAX));
    m.first_block = static_cast<int32_t>(first);
    SIESTA_ASSIGN_OR_RETURN(m.blocks, blocks_from(j, op));
    SIESTA_ASSIGN_OR_RETURN(m.prompt, prompt_from(j, op));
    return PdMessage{std::move(m)};
  }
  if (op == "read_done") {
    ReadDone m;
    SIESTA_ASSIGN_OR_RETURN(m.producer_request, get_string(j, op, "producer_request"));
    SIESTA_ASSIGN_OR_RETURN(m.logits_top, logits_top_of(j, op));
    return PdMessage{std::move(m)};
  }
  if (op == "load_failed") {
    LoadFailed m;
    SIESTA_ASSIGN_OR_RETURN(m.consumer_request, get_string(j, op, "consumer_request"));
    SIESTA_ASSIGN_OR_RETURN(m.reason, get_string(j, op, "reason", true));
    return PdMessage{std::move(m)};
  }
  return corrupt("P/D message with unknown op '" + op + "'");
}

Result<json> parse(std::string_view payload) {
  Result<json> j = parse_json(payload);
  if (!j) return corrupt("P/D message: " + j.error().message);
  return j;
}

static_assert(std::endian::native == std::endian::little, "logits attachments are little-endian float32");

// More than any vocabulary (Qwen3's has 151,936 ids); bounds what a peer
// can make us allocate: a row of 4 MiB for a logits_top message of a few bytes.
constexpr int64_t kMaxLogits = int64_t{1} << 20;

// The engine sampler's view of a logit: NaN is -inf, +inf the largest float.
float sampler_value(float v) {
  if (std::isnan(v)) return -std::numeric_limits<float>::infinity();
  if (v == std::numeric_limits<float>::infinity()) return std::numeric_limits<float>::max();
  return v;
}

struct TopEntry {
  int32_t id;
  float value;
};

// The n best entries by (value descending, id ascending); empty when one of
// them is -inf (the row is degenerate: send it whole).
std::vector<TopEntry> best_entries(const std::vector<float>& row, size_t n) {
  std::vector<TopEntry> top;
  top.reserve(n + 1);
  auto better = [](const TopEntry& a, const TopEntry& b) { return a.value > b.value || (a.value == b.value && a.id < b.id); };
  auto insert = [&](size_t i) {
    const TopEntry e{static_cast<int32_t>(i), sampler_value(row[i])};
    top.insert(std::upper_bound(top.begin(), top.end(), e, better), e);
    if (top.size() > n) top.pop_back();
  };
  size_t i = 0;
  for (; i < row.size() && top.size() < n; ++i) insert(i);
  // Ids ascend, so a later entry beats the n-th best only with a strictly
  // larger value (NaN never does; +inf always does, kept as the sampler sees it).
  // Blocks of 64 whose largest value (a vectorised max; NaN drops out) does
  // not pass the threshold are skipped whole.
  float threshold = top.empty() ? 0.0f : top.back().value;
  constexpr size_t kBlock = 64;
  for (; i < row.size() && i % kBlock != 0; ++i)
    if (row[i] > threshold) {
      insert(i);
      threshold = top.back().value;
    }
  for (; i < row.size(); i += kBlock) {
    const size_t end = std::min(row.size(), i + kBlock);
    float block_max = -std::numeric_limits<float>::infinity();
    for (size_t k = i; k < end; ++k) block_max = row[k] > block_max ? row[k] : block_max;
    if (!(block_max > threshold)) continue;
    for (size_t k = i; k < end; ++k)
      if (row[k] > threshold) {
        insert(k);
        threshold = top.back().value;
      }
  }
  for (const TopEntry& e : top)
    if (e.value == -std::numeric_limits<float>::infinity()) return {};
  return top;
}

// `j` as text with `logits` attached (see pd_messages.h): the whole row, or
// its `top` best entries.
std::string attach(json& j, const LogitsRow& logits, int32_t top = 0) {
  if (!logits) return j.dump();
  std::vector<TopEntry> best;
  if (top > 0 && static_cast<size_t>(top) < logits->size()) best = best_entries(*logits, static_cast<size_t>(top));
  if (best.empty()) {
    j["logits"] = logits->size();
  } else {
    j["logits_top"] = best.size();
    j["vocab"] = logits->size();
  }
  std::string out = j.dump();
  out.push_back('\0');
  const size_t at = out.size();
  if (best.empty()) {
    out.resize(at + logits->size() * sizeof(float));
    std::memcpy(out.data() + at, logits->data(), logits->size() * sizeof(float));
  } else {
    out.resize(at + best.size() * 8);
    for (size_t i = 0; i < best.size(); ++i) {
      std::memcpy(out.data() + at + i * 8, &best[i].id, 4);
      std::memcpy(out.data() + at + i * 8 + 4, &best[i].value, 4);
    }
  }
  return out;
}

// The JSON text of a payload and its attachment (empty when none).
std::pair<std::string_view, std::string_view> split(std::string_view payload) {
  const size_t nul = payload.find('\0');
  if (nul == std::string_view::npos) return {payload, {}};
  return {payload.substr(0, nul), payload.substr(nul + 1)};
}

// The logits `j` announces, read from `attachment`; null when it announces none.
Result<LogitsRow> logits_of(const json& j, std::string_view attachment, const std::string& op) {
  if (j.contains("logits_top")) {
    SIESTA_ASSIGN_OR_RETURN(int64_t n, get_int(j, op, "logits_top", 1, kMaxLogitsTop));
    SIESTA_ASSIGN_OR_RETURN(int64_t vocab, get_int(j, op, "vocab", n, kMaxLogits));
    if (attachment.size() != static_cast<size_t>(n) * 8)
      return bad(op, "'logits_top' announces " + std::to_string(n) + " entries and the attachment holds " +
                         std::to_string(attachment.size()) + " bytes");
    auto values =
        std::make_shared<std::vector<float>>(static_cast<size_t>(vocab), -std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < n; ++i) {
      int32_t id = 0;
      float value = 0.0f;
      std::memcpy(&id, attachment.data() + i * 8, 4);
      std::memcpy(&value, attachment.data() + i * 8 + 4, 4);
      if (id < 0 || id >= vocab) return bad(op, "a logits entry names id " + std::to_string(id) + ", outside the vocabulary");
      (*values)[static_cast<size_t>(id)] = value;
    }
    return LogitsRow(std::move(values));
  }
  if (!j.contains("logits")) {
    if (!attachment.empty()) return bad(op, "an attachment without a 'logits' field");
    return LogitsRow();
  }
  SIESTA_ASSIGN_OR_RETURN(int64_t n, get_int(j, op, "logits", 1, kMaxLogits));
  if (attachment.size() != static_cast<size_t>(n) * sizeof(float))
    return bad(op, "'logits' announces " + std::to_string(n) + " values and the attachment holds " +
                       std::to_string(attachment.size()) + " bytes");
  auto values = std::make_shared<std::vector<float>>(static_cast<size_t>(n));
  std::memcpy(values->data(), attachment.data(), attachment.size());
  return LogitsRow(std::move(values));
}

}  // namespace

uint64_t prompt_hash(const std::vector<int32_t>& tokens) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : tokens) {
    auto u = static_cast<uint32_t>(t);
    for (int i = 0; i < 4; ++i) {
      h ^= (u >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  return h;
}

std::string encode(const WriteRequest& m) {
  json j = envelope("write");
  j["x_request_id"] = m.x_request_id;
  j["choice"] = m.choice;
  j["consumer_request"] = m.consumer_request;
  j["consumer_engine"] = m.consumer_engine;
  j["consumer_address"] = m.consumer_address;
  j["region"] = u64_text(m.region);
  j["epoch"] = u64_text(m.epoch);
  j["first_block"] = m.first_block;
  j["blocks"] = m.blocks;
  j["prompt"] = prompt_json(m.prompt);
  j["deadline_unix_ms"] = m.deadline_unix_ms;
  if (m.logits_top > 0) j["logits_top"] = m.logits_top;
  if (!m.producer_engine.empty()) j["producer_engine"] = m.producer_engine;
  return j.dump();
}

std::string encode(const CancelRequest& m) {
  json j = envelope("cancel");
  j["x_request_id"] = m.x_request_id;
  j["choice"] = m.choice;
  j["producer_request"] = m.producer_request;
  return j.dump();
}

std::string encode(const ReadStart& m) {
  json j = envelope("read_start");
  j["producer_request"] = m.producer_request;
  j["first_block"] = m.first_block;
  j["blocks"] = m.blocks;
  j["prompt"] = prompt_json(m.prompt);
  return j.dump();
}

std::string encode(const ReadDone& m) {
  json j = envelope("read_done");
  j["producer_request"] = m.producer_request;
  if (m.logits_top > 0) j["logits_top"] = m.logits_top;
  return j.dump();
}

std::string encode(const LoadFailed& m) {
  json j = envelope("load_failed");
  j["consumer_request"] = m.consumer_request;
  j["reason"] = m.reason;
  return j.dump();
}

std::string encode(const Written& m) {
  json j = envelope("written");
  j["consumer_request"] = m.consumer_request;
  j["bytes"] = m.bytes;
  return attach(j, m.logits, m.logits_top);
}

Result<PdMessage> decode_message(std::string_view payload) {
  SIESTA_ASSIGN_OR_RETURN(json j, parse(payload));
  try {
    return decode_object(j);
  } catch (const std::exception& e) {
    return corrupt(std::string("P/D message could not be read: ") + e.what());
  }
}

Result<Written> decode_written(std::string_view payload) {
  const auto [text, attachment] = split(payload);
  SIESTA_ASSIGN_OR_RETURN(json j, parse(text));
  try {
    if (!j.is_object()) return corrupt("P/D notification is not a JSON object");
    auto v = j.find("v");
    if (v == j.end() || !v->is_number_integer() || v->get<int64_t>() != kProtocolVersion)
      return corrupt("P/D notification of another protocol version");
    SIESTA_ASSIGN_OR_RETURN(std::string op, get_string(j, "?", "op"));
    if (op != "written") return corrupt("P/D notification with op '" + op + "', expected 'written'");
    Written m;
    SIESTA_ASSIGN_OR_RETURN(m.consumer_request, get_string(j, op, "consumer_request"));
    SIESTA_ASSIGN_OR_RETURN(m.bytes, get_u64(j, op, "bytes"));
    SIESTA_ASSIGN_OR_RETURN(m.logits, logits_of(j, attachment, op));
    return m;
  } catch (const std::exception& e) {
    return corrupt(std::string("P/D notification could not be read: ") + e.what());
  }
}

std::string encode_ok(json fields, const LogitsRow& logits, int32_t logits_top) {
  json j = fields.is_object() ? std::move(fields) : json::object();
  j["v"] = kProtocolVersion;
  j["ok"] = true;
  return attach(j, logits, logits_top);
}

std::string encode_refusal(const std::string& reason, json fields) {
  json j = fields.is_object() ? std::move(fields) : json::object();
  j["v"] = kProtocolVersion;
  j["ok"] = false;
  j["reason"] = reason;
  return j.dump();
}

Result<Reply> decode_reply(std::string_view payload) {
  const auto [text, attachment] = split(payload);
  SIESTA_ASSIGN_OR_RETURN(json j, parse(text));
  if (!j.is_object()) return corrupt("P/D reply is not a JSON object");
  auto ok = j.find("ok");
  if (ok == j.end() || !ok->is_boolean()) return corrupt("P/D reply has no boolean 'ok'");
  Reply r;
  r.ok = ok->get<bool>();
  auto reason = j.find("reason");
  if (reason != j.end() && reason->is_string()) r.reason = reason->get<std::string>();
  if (!r.ok && r.reason.empty()) r.reason = "refused without a reason";
  try {
    SIESTA_ASSIGN_OR_RETURN(r.logits, logits_of(j, attachment, "reply"));
  } catch (const std::exception& e) {
    return corrupt(std::string("P/D reply could not be read: ") + e.what());
  }
  r.body = std::move(j);
  return r;
}

Result<bool> reply_bool(const Reply& r, const char* key) {
  auto it = r.body.find(key);
  if (it == r.body.end() || !it->is_boolean()) return corrupt(std::string("P/D reply lacks boolean '") + key + "'");
  return it->get<bool>();
}

Result<uint64_t> reply_u64(const Reply& r, const char* key) {
  auto it = r.body.find(key);
  if (it == r.body.end()) return corrupt(std::string("P/D reply lacks '") + key + "'");
  if (it->is_string()) return get_u64_text(r.body, "reply", key);
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  return corrupt(std::string("P/D reply field '") + key + "' is not a non-negative integer");
}

Result<int64_t> reply_i64(const Reply& r, const char* key) {
  auto it = r.body.find(key);
  if (it == r.body.end() || !it->is_number_integer()) return corrupt(std::string("P/D reply lacks integer '") + key + "'");
  return it->get<int64_t>();
}

}  // namespace siesta::pd
