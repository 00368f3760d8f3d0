// The Jinja parser: lexer pieces into statements. Knows the tags if / elif /
// else / endif, for / else / endfor (with loop filters and tuple targets),
// set (a name, a tuple of names, a namespace attribute, or a block),
// macro / endmacro, break, continue, and generation / endgeneration (the
// block Hugging Face's assistant-mask extension adds); any other tag is an
// error naming it and its line.
#pragma once

#include <vector>

#include "server/jinja/ast.h"
#include "server/jinja/lexer.h"

namespace siesta::jinja {

// Throws jinja::Error.
Body parse(std::vector<Piece> pieces);

}  // namespace siesta::jinja
