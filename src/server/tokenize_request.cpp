#include "server/tokenize_request.h"

#include "server/json_fields.h"
#include "server/openai_request.h"

namespace siesta::server {

Result<std::string> tokenize_text(const nlohmann::json& body) {
  if (!body.is_object()) return invalid_argument("the request body must be a JSON object, got " + json_type_name(body));
  SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> prompt, read_string(body, "prompt"));
  auto m = body.find("messages");
  const bool has_messages = m != body.end() && !m->is_null();
  if (prompt && has_messages) return invalid_argument("give either 'prompt' or 'messages', not both");
  if (prompt) return *prompt;
  if (!has_messages) return invalid_argument("'prompt' (a string) or 'messages' is required");
  return render_chat_body(body, *m);
}

}  // namespace siesta::server
