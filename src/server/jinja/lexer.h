// The Jinja lexer: template source into text pieces and tags, with
// Hugging Face's whitespace settings applied (trim_blocks, lstrip_blocks,
// the `-`/`+` markers of every tag, and no trailing newline kept), and the
// expression tokens inside each tag.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace siesta::jinja {

struct Token {
  enum class Kind { kName, kString, kInt, kFloat, kOp, kEnd };
  Kind kind = Kind::kEnd;
  std::string text;  // the name, the decoded string, the number's digits, the operator
  int line = 0;
};

struct Piece {
  enum class Kind { kText, kVar, kBlock };  // comments are dropped
  Kind kind = Kind::kText;
  std::string text;           // kText
  std::vector<Token> tokens;  // kVar, kBlock (ending with kEnd)
  int line = 1;
};

// Throws jinja::Error naming the line of an unterminated tag, string or comment.
std::vector<Piece> lex(std::string_view source);

}  // namespace siesta::jinja
