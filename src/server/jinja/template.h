// Template: a Jinja template, parsed once, rendered many times, with the
// settings Hugging Face's apply_chat_template uses (trim_blocks,
// lstrip_blocks, loop controls, the generation block, its tojson and its
// globals raise_exception and strftime_now), on Python's semantics for the
// values (value.h).
//
//   SIESTA_ASSIGN_OR_RETURN(jinja::Template t, jinja::Template::parse(source));
//   jinja::Dict ctx;
//   ctx.set("messages", jinja::Value::from_json(messages));
//   SIESTA_ASSIGN_OR_RETURN(std::string text, t.render(ctx));
//
// The subset covers the chat templates of the Qwen2, Qwen2.5 and Qwen3
// families and most others: if / elif / else, for (else, loop filters,
// tuple targets, loop.*, break, continue), set (namespaces, blocks), macros,
// filters (length, tojson, trim, join, default, items, map, selectattr, ...),
// tests (defined, none, string, mapping, ...), slices, string and dict
// methods. Anything else is kInvalidArgument naming the construct and its
// line ("the filter 'wordcount' is not supported ... (line 12)").
//
// A Template is immutable after parse; render is safe from several threads.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"
#include "server/jinja/value.h"

namespace siesta::jinja {

struct Stmt;

class Template {
 public:
  static Result<Template> parse(std::string_view source);
  // `context` holds the template's variables.
  Result<std::string> render(const Dict& context) const;

 private:
  explicit Template(std::shared_ptr<const std::vector<std::unique_ptr<Stmt>>> body) : body_(std::move(body)) {}
  std::shared_ptr<const std::vector<std::unique_ptr<Stmt>>> body_;
};

}  // namespace siesta::jinja
