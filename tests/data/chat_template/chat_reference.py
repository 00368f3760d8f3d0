"""Reference rendering of the chat requests in conversations.json, shared by
make_expected.py (Python's jinja2 with Hugging Face's settings, here) and
tests/cuda/hf_chat_template.py (transformers' apply_chat_template, on the GPU
machine).

to_template_inputs() turns an OpenAI chat request into what vLLM passes to the
template, as siesta does (src/server/openai_request.cpp): string contents
(text parts joined with "\\n", null as ""), tool call arguments parsed from
their JSON text, reasoning under both `reasoning` and `reasoning_content`,
`developer` read as `system`, tools as vLLM's model_dump of them
({"type", "function": {"name", "description", "parameters", ...}}), and
reasoning_effort "none" as enable_thinking false.
"""
import json

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _content(c):
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    return "\n".join(p["text"] for p in c)


def to_template_inputs(req):
    messages = []
    for m in req["messages"]:
        role = "system" if m["role"] == "developer" else m["role"]
        out = {"role": role, "content": _content(m.get("content"))}
        if m.get("name") is not None:
            out["name"] = m["name"]
        if m.get("tool_calls") is not None:
            calls = []
            for c in m["tool_calls"]:
                c = json.loads(json.dumps(c))
                args = c["function"].get("arguments")
                c["function"]["arguments"] = json.loads(args) if isinstance(args, str) and args else (args or {})
                calls.append(c)
            out["tool_calls"] = calls
        if m.get("tool_call_id") is not None:
            out["tool_call_id"] = m["tool_call_id"]
        for k in ("reasoning", "reasoning_content"):
            if m.get(k) is not None:
                out["reasoning"] = m[k]
                out["reasoning_content"] = m[k]
        messages.append(out)
    tools = None
    if req.get("tools"):
        tools = []
        for t in req["tools"]:
            f = t["function"]
            fn = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
            for k, v in f.items():
                if k not in fn:
                    fn[k] = v
            tools.append({"type": "function", "function": fn})
    cfm = bool(req.get("continue_final_message", False))
    agp = req.get("add_generation_prompt", not cfm)
    kwargs = dict(req.get("chat_template_kwargs") or {})
    if req.get("reasoning_effort") is not None:
        kwargs["reasoning_effort"] = req["reasoning_effort"]
        kwargs.setdefault("enable_thinking", req["reasoning_effort"] != "none")
    return messages, tools, agp, cfm, kwargs


def hf_environment():
    """A jinja2 environment set up as transformers' _compile_jinja_template sets it up."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def render_jinja2(template_text, req, special_tokens):
    """transformers 5's render_jinja_template, continue_final_message included."""
    messages, tools, agp, cfm, kwargs = to_template_inputs(req)
    template = hf_environment().from_string(template_text)
    if cfm:
        final = messages[-1]["content"]
        messages[-1]["content"] = final + CONTINUE_TAG
    text = template.render(messages=messages, tools=tools, documents=None, add_generation_prompt=agp,
                           **special_tokens, **kwargs)
    if cfm:
        loc = text.rindex(CONTINUE_TAG.strip())
        text = text[:loc] if text[loc:loc + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:loc].rstrip()
    return text
