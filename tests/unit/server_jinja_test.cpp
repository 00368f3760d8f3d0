// The Jinja renderer of chat templates: Jinja's syntax and whitespace
// control with Hugging Face's settings, and Python's semantics for values,
// as the templates of Qwen and others rely on them.
#include <gtest/gtest.h>

#include "server/jinja/template.h"

namespace siesta::jinja {
namespace {

std::string render(const std::string& src, const nlohmann::ordered_json& ctx = nlohmann::ordered_json::object()) {
  auto t = Template::parse(src);
  if (!t) return "PARSE ERROR: " + t.error().message;
  Dict d;
  for (auto it = ctx.begin(); it != ctx.end(); ++it) d.set(it.key(), Value::from_json(it.value()));
  auto r = t->render(d);
  return r ? *r : "RENDER ERROR: " + r.error().message;
}

TEST(Jinja, WhitespaceControlAsHuggingFaceSetsIt) {
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: the
  // indentation before it; `-` strips all whitespace on its side.
  EXPECT_EQ(render("{% if true %}\n  yes\n{% endif %}\nafter"), "  yes\nafter");
  EXPECT_EQ(render("    {% if true %}x{% endif %}"), "x");
  EXPECT_EQ(render("a  \n  {%- if true -%}  \n b {%- endif %}"), "ab");
  EXPECT_EQ(render("{{ 'a' }}\n{{ 'b' }}"), "a\nb");        // variable tags keep their newline
  EXPECT_EQ(render("x {% if true %}y{% endif %}"), "x y");  // not at a line start: kept
  EXPECT_EQ(render("{# note #}\nz"), "z");
  EXPECT_EQ(render("{%+ if true %}k{% endif +%}\n"), "k");  // + keeps, one trailing newline dropped
  EXPECT_EQ(render("line\n"), "line");                      // keep_trailing_newline off
  EXPECT_EQ(render("{% raw %}{{ not }}{% endraw %}"), "{{ not }}");
}

TEST(Jinja, ValuesPrintAsPythonPrintsThem) {
  EXPECT_EQ(render("{{ none }}|{{ true }}|{{ 3 }}|{{ 0.1 }}|{{ 1e-05 }}|{{ 100.0 }}|{{ 1e16 }}|{{ undefined_name }}"),
            "None|True|3|0.1|1e-05|100.0|1e+16|");
  EXPECT_EQ(render("{{ [1, 'a', none] }}|{{ {'k': 'v'} }}"), "[1, 'a', None]|{'k': 'v'}");
  EXPECT_EQ(render("{{ 7 / 2 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ -7 % 3 }}|{{ 2 ** 10 }}|{{ 'ab' * 2 }}"),
            "3.5|3|-4|2|1024|abab");
}

TEST(Jinja, TojsonIsHuggingFacesJsonDumps) {
  const auto ctx = nlohmann::ordered_json::parse(R"({"t": {"name": "f", "x": 1.5, "u": "é \"q\" \n", "l": [], "o": {},
                                                    "n": null, "b": false, "z": 10}})");
  EXPECT_EQ(render("{{ t | tojson }}", ctx),
            R"({"name": "f", "x": 1.5, "u": "é \"q\" \n", "l": [], "o": {}, "n": null, "b": false, "z": 10})");
  EXPECT_EQ(render("{{ t.l | tojson(indent=2) }}|{{ {'a': [1, 2]} | tojson(indent=2) }}", ctx),
            "[]|{\n  \"a\": [\n    1,\n    2\n  ]\n}");
  EXPECT_EQ(render("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}"), R"({"a": 2, "b": 1})");
}

TEST(Jinja, StringMethodsAndSlicesFollowPython) {
  EXPECT_EQ(
      render("{{ 'a</think>b</think>c'.split('</think>')[-1] }}|{{ '\n\nx\n'.lstrip('\n') }}|{{ ' y '.strip() }}"),
      "c|x\n|y");
  EXPECT_EQ(render("{{ 'a b  c'.split() }}|{{ 'a,b,c'.split(',', 1) }}|{{ 'héllo'[1:3] }}|{{ [1,2,3,4][::-1] }}"),
            "['a', 'b', 'c']|['a', 'b,c']|él|[4, 3, 2, 1]");
  EXPECT_EQ(render("{{ '<tool_response>x'.startswith('<tool_response>') }}|{{ 'abc'.endswith(('x', 'c')) }}"),
            "True|True");
  EXPECT_EQ(render("{{ 'x' in 'axb' }}|{{ 2 in [1, 2] }}|{{ 'k' in {'k': 1} }}|{{ 'z' not in 'abc' }}"),
            "True|True|True|True");
  EXPECT_EQ(render("{{ 'Hello'|upper }}|{{ '  pad '|trim }}|{{ 'abc'|length }}|{{ '日本'|length }}"), "HELLO|pad|3|2");
}

TEST(Jinja, LoopsNamespacesAndScopes) {
  const auto ctx =
      nlohmann::ordered_json::parse(R"({"m": [{"role": "user"}, {"role": "assistant"}, {"role": "user"}]})");
  EXPECT_EQ(
      render("{% for x in m %}{{ loop.index0 }}{{ x.role[0] }}{% if not loop.last %},{% endif %}{% endfor %}", ctx),
      "0u,1a,2u");
  // set in a loop does not leak out; a namespace does.
  EXPECT_EQ(render("{% set n = 0 %}{% set ns = namespace(k=0) %}{% for x in m %}{% set n = n + 1 %}"
                   "{% set ns.k = ns.k + 1 %}{% endfor %}{{ n }}/{{ ns.k }}",
                   ctx),
            "0/3");
  EXPECT_EQ(render("{% for x in m if x.role == 'user' %}{{ loop.length }}{% endfor %}", ctx), "22");
  EXPECT_EQ(render("{% for x in [] %}a{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(
      render("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{% if i == 1 %}{% continue %}{% endif %}"
             "{{ i }}{% endfor %}"),
      "02");
  EXPECT_EQ(render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"), "a=1;b=2;");
  EXPECT_EQ(render("{% macro tag(name, v='x') %}<{{ name }}>{{ v }}{% endmacro %}{{ tag('a') }}{{ tag('b', v='y') }}"),
            "<a>x<b>y");
  EXPECT_EQ(render("{% set block %}in{{ 1 }}{% endset %}[{{ block }}]"), "[in1]");
}

TEST(Jinja, TestsAndFilters) {
  const auto ctx =
      nlohmann::ordered_json::parse(R"({"d": {"a": null, "s": "x", "l": [1, 2]}, "items": [{"type": "text", "v": 1},
                                                    {"type": "image", "v": 2}]})");
  EXPECT_EQ(render("{{ d.a is none }}|{{ d.missing is defined }}|{{ d.s is string }}|{{ d is mapping }}|"
                   "{{ d.l is iterable }}|{{ false is false }}|{{ d.a is not none }}",
                   ctx),
            "True|False|True|True|True|True|False");
  EXPECT_EQ(render("{{ d.missing | default('dflt') }}|{{ d.l | join('-') }}|{{ d.l | first }}|{{ d.l | last }}|"
                   "{{ items | selectattr('type', 'equalto', 'text') | map(attribute='v') | list }}|{{ d | length }}",
                   ctx),
            "dflt|1-2|1|2|[1]|3");
  EXPECT_EQ(render("{{ 'yes' if d.s else 'no' }}|{{ d.a or 'fallback' }}|{{ 1 < 2 < 3 }}", ctx), "yes|fallback|True");
}

TEST(Jinja, ErrorsNameWhatIsNotSupported) {
  EXPECT_NE(render("{% include 'x' %}").find("{% include %} is not supported"), std::string::npos);
  EXPECT_NE(render("{% if x %}").find("not closed"), std::string::npos);
  EXPECT_NE(render("{{ x | nosuchfilter }}").find("the filter 'nosuchfilter'"), std::string::npos);
  EXPECT_NE(render("{{ x is nosuchtest }}").find("the test 'nosuchtest'"), std::string::npos);
  EXPECT_NE(render("{{ nosuchfn() }}").find("'nosuchfn', which is not defined"), std::string::npos);
  EXPECT_NE(render("\n\n{{ 1 + 'a' }}").find("line 3"), std::string::npos);
  EXPECT_NE(render("{{ undefined_obj.attr }}").find("'undefined_obj' is undefined"), std::string::npos);
  EXPECT_NE(render("{% for i in range(2000000) %}{% endfor %}").find("range()"), std::string::npos);
}

}  // namespace
}  // namespace siesta::jinja
