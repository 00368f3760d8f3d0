#include "server/jinja/lexer.h"

#include <cctype>
#include <cstdint>

#include "server/jinja/value.h"

namespace siesta::jinja {
namespace {

std::string at_line(int line) { return " (line " + std::to_string(line) + ")"; }

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// A raw tag piece before whitespace control.
struct RawTag {
  Piece::Kind kind;  // kVar, kBlock, or kText for a comment (dropped later)
  bool comment = false;
  char left = 0;  // '-', '+' or 0
  char right = 0;
  std::string body;
  int line = 1;
};

// Tokens of a tag body. Strings decode Python-style escapes, as Jinja does.
std::vector<Token> tokenize(const std::string& s, int line) {
  std::vector<Token> out;
  size_t i = 0;
  auto push = [&](Token::Kind k, std::string text) { out.push_back(Token{k, std::move(text), line}); };
  while (i < s.size()) {
    const char c = s[i];
    if (c == '\n') {
      ++line;
      ++i;
      continue;
    }
    if (is_space(c)) {
      ++i;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      push(Token::Kind::kName, s.substr(i, j - i));
      i = j;
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool is_float = false;
      while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      if (j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]))) {
        is_float = true;
        ++j;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      }
      if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
        size_t k = j + 1;
        if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
        if (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) {
          is_float = true;
          j = k;
          while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
        }
      }
      std::string digits;
      for (size_t k = i; k < j; ++k)
        if (s[k] != '_') digits += s[k];
      push(is_float ? Token::Kind::kFloat : Token::Kind::kInt, digits);
      i = j;
      continue;
    }
    if (c == '\'' || c == '"') {
      const int start_line = line;
      std::string text;
      size_t j = i + 1;
      for (;; ++j) {
        if (j >= s.size()) throw Error("unterminated string literal" + at_line(start_line));
        const char d = s[j];
        if (d == c) break;
        if (d == '\n') ++line;
        if (d != '\\') {
          text += d;
          continue;
        }
        if (++j >= s.size()) throw Error("unterminated string literal" + at_line(start_line));
        const char e = s[j];
        switch (e) {
          case 'n':
            text += '\n';
            break;
          case 't':
            text += '\t';
            break;
          case 'r':
            text += '\r';
            break;
          case '0':
            text += '\0';
            break;
          case 'a':
            text += '\a';
            break;
          case 'b':
            text += '\b';
            break;
          case 'f':
            text += '\f';
            break;
          case 'v':
            text += '\v';
            break;
          case '\\':
            text += '\\';
            break;
          case '\'':
            text += '\'';
            break;
          case '"':
            text += '"';
            break;
          case '\n':
            ++line;
            break;  // line continuation
          case 'x':
          case 'u':
          case 'U': {
            const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            if (j + n >= s.size())
              throw Error("truncated \\" + std::string(1, e) + " escape in a string literal" + at_line(line));
            uint32_t cp = 0;
            for (size_t k = 1; k <= n; ++k) {
              const char h = j + k < s.size() ? s[j + k] : '\0';
              if (!std::isxdigit(static_cast<unsigned char>(h)))
                throw Error("bad \\" + std::string(1, e) + " escape in a string literal" + at_line(line));
              cp = cp * 16 + static_cast<uint32_t>(
                                 std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
            }
            append_utf8(text, cp);
            j += n;
            break;
          }
          default:  // unknown escapes stay as written, as in Python
            text += '\\';
            text += e;
        }
      }
      push(Token::Kind::kString, std::move(text));
      i = j + 1;
      continue;
    }
    static const char* kOps[] = {"==", "!=", "<=", ">=", "//", "**", "<", ">", "+", "-", "*", "/", "%",
                                 "~",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};
    bool matched = false;
    for (const char* op : kOps) {
      const std::string_view o(op);
      if (s.compare(i, o.size(), o) == 0) {
        push(Token::Kind::kOp, std::string(o));
        i += o.size();
        matched = true;
        break;
      }
    }
    if (!matched) throw Error(std::string("unexpected character '") + c + "' in a tag" + at_line(line));
  }
  out.push_back(Token{Token::Kind::kEnd, "", line});
  return out;
}

size_t count_lines(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

}  // namespace

std::vector<Piece> lex(std::string_view raw) {
  // Newlines normalised to \n and one trailing newline dropped, as Jinja's
  // lexer does (keep_trailing_newline is off).
  std::string src;
  src.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] == '\r') {
      src += '\n';
      if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
    } else {
      src += raw[i];
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();

  // Text and tags, in order.
  struct Item {
    bool is_tag;
    std::string text;  // text
    RawTag tag;
  };
  std::vector<Item> items;
  size_t i = 0;
  int line = 1;
  std::string text;
  auto flush_text = [&] {
    items.push_back(Item{false, std::move(text), {}});
    text.clear();
  };
  while (i < src.size()) {
    if (src[i] != '{' || i + 1 >= src.size() || (src[i + 1] != '{' && src[i + 1] != '%' && src[i + 1] != '#')) {
      if (src[i] == '\n') ++line;
      text += src[i++];
      continue;
    }
    const char open = src[i + 1];
    flush_text();
    RawTag tag;
    tag.line = line;
    tag.kind = open == '{' ? Piece::Kind::kVar : Piece::Kind::kBlock;
    tag.comment = open == '#';
    size_t j = i + 2;
    if (j < src.size() && (src[j] == '-' || src[j] == '+')) tag.left = src[j++];
    const std::string close = open == '{' ? "}}" : open == '%' ? "%}" : "#}";
    // Find the close, skipping string literals (not in comments).
    size_t k = j;
    char quote = 0;
    for (;; ++k) {
      if (k >= src.size())
        throw Error(std::string(tag.comment ? "unterminated comment" : "unterminated tag") + at_line(tag.line));
      const char c = src[k];
      if (!tag.comment) {
        if (quote) {
          if (c == '\\') {
            ++k;
            continue;
          }
          if (c == quote) quote = 0;
          continue;
        }
        if (c == '\'' || c == '"') {
          quote = c;
          continue;
        }
      }
      if (src.compare(k, 2, close) == 0) break;
    }
    size_t body_end = k;
    if (body_end > j && (src[body_end - 1] == '-' || src[body_end - 1] == '+')) {
      // "-%}" / "+%}": a marker only when it is not the tag's last operand
      // (Jinja reads `{{ a -}}` as a marker too).
      tag.right = src[body_end - 1];
      --body_end;
    }
    tag.body = src.substr(j, body_end - j);
    line += static_cast<int>(count_lines(src.substr(i, k + 2 - i)));
    i = k + 2;
    // {% raw %} ... {% endraw %}: the text between stays as written.
    if (tag.kind == Piece::Kind::kBlock && !tag.comment) {
      std::vector<Token> t = tokenize(tag.body, tag.line);
      if (t.size() == 2 && t[0].kind == Token::Kind::kName && t[0].text == "raw") {
        size_t search = i;
        for (;;) {
          const size_t p = src.find("{%", search);
          if (p == std::string::npos) throw Error("{% raw %} without {% endraw %}" + at_line(tag.line));
          size_t q = p + 2;
          if (q < src.size() && (src[q] == '-' || src[q] == '+')) ++q;
          while (q < src.size() && is_space(src[q])) ++q;
          if (src.compare(q, 6, "endraw") != 0) {
            search = p + 2;
            continue;
          }
          q += 6;
          while (q < src.size() && is_space(src[q])) ++q;
          if (q < src.size() && (src[q] == '-' || src[q] == '+')) ++q;
          if (src.compare(q, 2, "%}") != 0) {
            search = p + 2;
            continue;
          }
          items.push_back(Item{true, {}, tag});
          std::string raw_text = src.substr(i, p - i);
          line += static_cast<int>(count_lines(src.substr(i, q + 2 - i)));
          RawTag end_tag;
          end_tag.kind = Piece::Kind::kBlock;
          end_tag.comment = true;  // dropped, but its markers apply
          end_tag.left = src[p + 2] == '-' || src[p + 2] == '+' ? src[p + 2] : 0;
          end_tag.right = src[q - 1] == '-' || src[q - 1] == '+' ? src[q - 1] : 0;
          end_tag.line = line;
          items.back().tag.comment = true;  // the raw tag itself renders nothing
          items.push_back(Item{false, std::move(raw_text), {}});
          items.push_back(Item{true, {}, end_tag});
          i = q + 2;
          break;
        }
        continue;
      }
    }
    items.push_back(Item{true, {}, std::move(tag)});
  }
  flush_text();

  // Whitespace control: `-` strips all whitespace on that side; block and
  // comment tags also take lstrip_blocks (spaces and tabs before the tag on
  // its line) and trim_blocks (one newline after it), unless marked `+`.
  // Decided on the text as written, then applied.
  struct TextCut {
    size_t front = 0;  // characters removed at the start
    bool strip_back_all = false;
    bool strip_back_line = false;  // lstrip_blocks: spaces and tabs after the last newline
  };
  std::vector<TextCut> cuts(items.size());
  for (size_t n = 0; n < items.size(); ++n) {
    if (!items[n].is_tag) continue;
    const RawTag& t = items[n].tag;
    const bool block_like = t.kind == Piece::Kind::kBlock;
    if (n > 0 && !items[n - 1].is_tag) {
      const std::string& before = items[n - 1].text;
      if (t.left == '-') {
        cuts[n - 1].strip_back_all = true;
      } else if (block_like && t.left != '+') {
        size_t e = before.size();
        while (e > 0 && (before[e - 1] == ' ' || before[e - 1] == '\t')) --e;
        // As written, only whitespace since the last newline (or the
        // template's start) precedes the tag.
        const bool line_start = e == 0 ? n == 1 : before[e - 1] == '\n';
        if (line_start) cuts[n - 1].strip_back_line = true;
      }
    }
    if (n + 1 < items.size() && !items[n + 1].is_tag) {
      const std::string& after = items[n + 1].text;
      if (t.right == '-') {
        size_t b = 0;
        while (b < after.size() && is_space(after[b])) ++b;
        cuts[n + 1].front = b;
      } else if (block_like && t.right != '+' && !after.empty() && after[0] == '\n') {
        cuts[n + 1].front = 1;
      }
    }
  }
  for (size_t n = 0; n < items.size(); ++n) {
    if (items[n].is_tag) continue;
    std::string& s = items[n].text;
    const TextCut& c = cuts[n];
    size_t e = s.size();
    if (c.strip_back_all) {
      while (e > c.front && is_space(s[e - 1])) --e;
    } else if (c.strip_back_line) {
      while (e > c.front && (s[e - 1] == ' ' || s[e - 1] == '\t')) --e;
    }
    s = e > c.front ? s.substr(c.front, e - c.front) : std::string();
  }

  std::vector<Piece> out;
  int text_line = 1;
  for (Item& it : items) {
    if (!it.is_tag) {
      if (!it.text.empty()) {
        Piece p;
        p.kind = Piece::Kind::kText;
        p.text = std::move(it.text);
        p.line = text_line;
        out.push_back(std::move(p));
      }
      continue;
    }
    text_line = it.tag.line;
    if (it.tag.comment) continue;
    Piece p;
    p.kind = it.tag.kind;
    p.line = it.tag.line;
    p.tokens = tokenize(it.tag.body, it.tag.line);
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace siesta::jinja
