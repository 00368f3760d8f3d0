#include "server/chat_output.h"

#include <nlohmann/json.hpp>
#include <random>

#include "server/jinja/value.h"

namespace siesta::server {
namespace {

constexpr std::string_view kThink = "<think>";
constexpr std::string_view kEndThink = "</think>";
constexpr std::string_view kToolCall = "<tool_call>";
constexpr std::string_view kEndToolCall = "</tool_call>";

// The length of the longest suffix of `s` that is a proper prefix of `tag`.
size_t partial_tag(const std::string& s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n)
    if (s.compare(s.size() - n, n, tag.substr(0, n)) == 0) return n;
  return 0;
}

std::optional<std::string> non_empty(std::string s) {
  if (s.empty()) return std::nullopt;
  return s;
}

// One tool call body: {"name": ..., "arguments": ...}; nullopt when it is not.
std::optional<ParsedToolCall> tool_call_of(const std::string& body) {
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  auto name = j.find("name");
  auto args = j.find("arguments");
  if (name == j.end() || !name->is_string() || args == j.end()) return std::nullopt;
  ParsedToolCall c;
  c.id = make_tool_call_id();
  c.name = name->get<std::string>();
  try {
    c.arguments = jinja::Value::from_json(*args).to_json();
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return c;
}

std::string trim_ws(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\n\r\f\v");
  if (b == std::string::npos) return std::string();
  return s.substr(b, s.find_last_not_of(" \t\n\r\f\v") - b + 1);
}

}  // namespace

std::string make_tool_call_id() {
  thread_local std::mt19937_64 rng(std::random_device{}());
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id = "chatcmpl-tool-";
  for (int i = 0; i < 2; ++i) {
    uint64_t v = rng();
    for (int k = 0; k < 16; ++k, v >>= 4) id.push_back(kHex[v & 0xF]);
  }
  return id;
}

ParsedChatOutput split_reasoning(const std::string& text, ReasoningMode mode) {
  ParsedChatOutput out;
  if (mode != ReasoningMode::kSplit) {
    out.content = text;
    return out;
  }
  std::string rest = text;
  if (rest.compare(0, kThink.size(), kThink) == 0) rest.erase(0, kThink.size());
  const size_t end = rest.find(kEndThink);
  if (end == std::string::npos) {
    out.reasoning = rest;  // cut short before the reasoning ended
    return out;
  }
  out.reasoning = rest.substr(0, end);
  out.content = non_empty(rest.substr(end + kEndThink.size()));
  return out;
}

ToolCallParse parse_tool_calls(const std::string& text) {
  ToolCallParse r;
  const size_t first = text.find(kToolCall);
  if (first == std::string::npos) {
    r.content = text;
    return r;
  }
  // <tool_call>(.*?)</tool_call>, and a last unclosed <tool_call>(.*).
  size_t pos = first;
  while (pos != std::string::npos) {
    const size_t body = pos + kToolCall.size();
    const size_t close = text.find(kEndToolCall, body);
    const std::string inner = text.substr(body, close == std::string::npos ? std::string::npos : close - body);
    std::optional<ParsedToolCall> c = tool_call_of(trim_ws(inner));
    if (!c) {
      r = ToolCallParse{};
      r.content = text;
      return r;
    }
    r.calls.push_back(std::move(*c));
    if (close == std::string::npos) break;
    pos = text.find(kToolCall, close + kEndToolCall.size());
  }
  r.tools_called = true;
  r.content = non_empty(text.substr(0, first));
  return r;
}

ParsedChatOutput parse_chat_output(const std::string& text, const ChatOutputOptions& o) {
  ParsedChatOutput out = split_reasoning(text, o.reasoning);
  if (!o.include_reasoning) out.reasoning.reset();
  if (o.parse_tools && out.content) {
    ToolCallParse t = parse_tool_calls(*out.content);
    if (t.tools_called) {
      out.content = t.content;
      out.tool_calls = std::move(t.calls);
      if (o.single_tool_call && out.tool_calls.size() > 1) out.tool_calls.resize(1);
    }
  }
  return out;
}

ChatStreamParser::Delta ChatStreamParser::push(const std::string& text) {
  Delta d;
  if (o_.reasoning != ReasoningMode::kSplit) {
    route(text, d, false);
    return d;
  }
  held_ += text;
  if (!started_) {
    // A leading <think> is dropped; wait until it is known not to be one.
    if (held_.size() < kThink.size() && kThink.compare(0, held_.size(), held_) == 0) return d;
    if (held_.compare(0, kThink.size(), kThink) == 0) held_.erase(0, kThink.size());
    started_ = true;
  }
  if (in_reasoning_) {
    const size_t end = held_.find(kEndThink);
    if (end != std::string::npos) {
      if (o_.include_reasoning) d.reasoning = held_.substr(0, end);
      std::string after = held_.substr(end + kEndThink.size());
      held_.clear();
      in_reasoning_ = false;
      route(after, d, false);
      return d;
    }
    const size_t keep = partial_tag(held_, kEndThink);
    if (o_.include_reasoning) d.reasoning = held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return d;
  }
  std::string content;
  content.swap(held_);
  route(content, d, false);
  return d;
}

ChatStreamParser::Delta ChatStreamParser::finish() {
  Delta d;
  if (o_.reasoning == ReasoningMode::kSplit && in_reasoning_) {
    if (o_.include_reasoning) d.reasoning = held_;
    held_.clear();
    route("", d, true);
    return d;
  }
  std::string rest;
  rest.swap(held_);
  route(rest, d, true);
  return d;
}

void ChatStreamParser::route(const std::string& content, Delta& d, bool final) {
  if (!o_.parse_tools) {
    d.content += content;
    return;
  }
  tools(content, d, final);
}

void ChatStreamParser::tools(const std::string& text, Delta& d, bool final) {
  tool_buf_ += text;
  d.first_tool_index = num_tools_;
  for (;;) {
    if (tool_state_ == ToolState::kText || tool_state_ == ToolState::kAfterCalls) {
      const size_t open = tool_buf_.find(kToolCall);
      if (open != std::string::npos) {
        // Text between tool calls is not part of the answer (vLLM keeps the
        // text before the first one only).
        if (tool_state_ == ToolState::kText) d.content += tool_buf_.substr(0, open);
        tool_buf_.erase(0, open + kToolCall.size());
        tool_state_ = ToolState::kInCall;
        continue;
      }
      const size_t keep = final ? 0 : partial_tag(tool_buf_, kToolCall);
      if (tool_state_ == ToolState::kText) d.content += tool_buf_.substr(0, tool_buf_.size() - keep);
      tool_buf_.erase(0, tool_buf_.size() - keep);
      return;
    }
    // In a call: wait for its close (or the end).
    const size_t close = tool_buf_.find(kEndToolCall);
    if (close == std::string::npos && !final) return;
    const std::string body = tool_buf_.substr(0, close);
    std::optional<ParsedToolCall> c = tool_call_of(trim_ws(body));
    const bool take = c && !(o_.single_tool_call && num_tools_ >= 1);
    if (c && take) {
      d.tool_calls.push_back(std::move(*c));
      ++num_tools_;
    } else if (!c && num_tools_ == 0) {
      // Not a tool call after all: the text stays content.
      d.content += std::string(kToolCall) +
                   tool_buf_.substr(0, close == std::string::npos ? std::string::npos : close + kEndToolCall.size());
    }
    if (close == std::string::npos) {
      tool_buf_.clear();
      return;
    }
    tool_buf_.erase(0, close + kEndToolCall.size());
    tool_state_ = num_tools_ > 0 ? ToolState::kAfterCalls : ToolState::kText;
  }
}

}  // namespace siesta::server
