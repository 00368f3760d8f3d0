// siesta serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key K]
//              [--served-model-name NAME] [--max-model-len N] [--max-num-seqs N]
//              [--max-num-batched-tokens N] [--kv-cache-memory-bytes N | --num-kv-blocks N]
//              [--no-enable-prefix-caching] [--threads N] [--seed S]
//              [--enable-sleep-mode] [--max-held-requests N]
//              [--device cpu|cuda] [--gpu-memory-utilization F] [--no-batch-invariant]
//              [--tensor-parallel-size N | -tp N]
//              [--kv-transfer-config JSON] [HTTP limits: cli/http_flags.h]
//              [--chat-template FILE|TEMPLATE] [--enable-auto-tool-choice] [--tool-call-parser hermes]
//              [--reasoning-parser qwen3] [--trust-request-chat-template]
//              [--exclude-tools-when-tool-choice-none] [--default-chat-template-kwargs JSON]
//              [--metrics-require-key] [--vllm-metric-names] [--weight-socket PATH]
//
// The chat and metrics flags are vLLM's (docs/vllm-compatibility.md); the API
// key comes from --api-key, else the VLLM_API_KEY environment variable, as
// in vLLM.
//
// --kv-transfer-config (vLLM's shape, src/pd/pd_config.h) makes the engine a
// P/D prefill (kv_producer), decode (kv_consumer) or both (kv_both) instance
// behind `siesta proxy`; it is checked before the model loads.
//
// --weight-socket PATH (with --enable-sleep-mode) also answers /update_weights
// on a Unix socket at PATH, where a trainer passes a memfd as a descriptor
// (docs/weight-socket.md); the file is removed on exit.
//
// Loads the model into an Engine and answers the OpenAI-compatible HTTP API
// (src/server) until SIGINT or SIGTERM. Prints one line on stderr once it
// listens: "siesta serve: listening on http://HOST:PORT (model NAME)", so a
// caller that asked for --port 0 learns the port.
#include <pthread.h>
#include <signal.h>

#include <cctype>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "cli/commands.h"
#include "cli/device_flags.h"
#include "cli/http_flags.h"
#include "engine/engine.h"
#include "pd/pd_config.h"
#include "pd/siesta_connector.h"
#include "server/api_server.h"
#include "server/chat_template.h"

namespace siesta::cli {
namespace {

struct ServeFlags {
  EngineOptions engine;
  server::ServerOptions server;
  DeviceFlags device;
  HttpFlags http;
  int64_t max_model_len = 0;
  int64_t num_kv_blocks = 0;
  int64_t seed = -1;
  bool no_prefix_caching = false;
  std::string kv_transfer_config;
  std::string default_chat_template_kwargs;
};

Result<void> apply_chat_flags(ServeFlags& f) {
  server::ChatConfig& c = f.server.chat;
  if (!c.tool_call_parser.empty() && c.tool_call_parser != "hermes")
    return invalid_argument("--tool-call-parser " + c.tool_call_parser +
                            ": this server parses Qwen's <tool_call> JSON format only; use --tool-call-parser hermes");
  if (c.enable_auto_tool_choice && c.tool_call_parser.empty())
    return invalid_argument("--enable-auto-tool-choice needs --tool-call-parser (hermes for Qwen models)");
  if (!c.reasoning_parser.empty() && c.reasoning_parser != "qwen3")
    return invalid_argument("--reasoning-parser " + c.reasoning_parser +
                            ": this server implements the qwen3 reasoning parser only; use --reasoning-parser qwen3");
  if (!f.default_chat_template_kwargs.empty()) {
    c.default_chat_template_kwargs =
        nlohmann::ordered_json::parse(f.default_chat_template_kwargs, nullptr, /*allow_exceptions=*/false);
    if (!c.default_chat_template_kwargs.is_object())
      return invalid_argument("--default-chat-template-kwargs must be a JSON object, got " +
                              f.default_chat_template_kwargs);
  }
  if (f.server.api_key.empty())
    if (const char* env = std::getenv("VLLM_API_KEY"); env && *env) f.server.api_key = env;
  f.server.server_info = {{"api_key_required", !f.server.api_key.empty()},
                          {"metrics_require_key", f.server.metrics_require_key},
                          {"vllm_metric_names", f.server.vllm_metric_names},
                          {"kv_transfer_config", f.kv_transfer_config}};
  return {};
}

Result<void> run_serve(ServeFlags& f) {
  SIESTA_TRY(f.device.apply(f.engine));
  SIESTA_TRY(apply_chat_flags(f));
  // Before the model loads (ApiServer::bind checks it too, and listens).
  if (!f.server.weight_socket.empty() && !f.engine.enable_sleep_mode)
    return invalid_argument("--weight-socket answers /update_weights, an admin call of sleep mode; add "
                            "--enable-sleep-mode");
  // A chat template that cannot be used fails before the model loads.
  if (auto t = server::ChatTemplate::load(f.engine.model_dir, f.server.chat_template); !t)
    return t.error().with_context("the chat template cannot be used");
  SIESTA_ASSIGN_OR_RETURN(f.server.http, f.http.options());
  raise_open_file_limit();
  if (f.max_model_len > 0) f.engine.max_model_len = static_cast<int32_t>(f.max_model_len);
  if (f.num_kv_blocks > 0) f.engine.num_kv_blocks = static_cast<int32_t>(f.num_kv_blocks);
  if (f.seed >= 0) f.engine.seed = static_cast<uint64_t>(f.seed);
  f.engine.enable_prefix_caching = !f.no_prefix_caching;
  if (f.server.served_model_name.empty()) f.server.served_model_name = f.engine.model_dir.string();

  // SIGINT/SIGTERM go to one waiting thread (every thread started below
  // inherits the blocked mask); writes to a closed socket must not kill us.
  signal(SIGPIPE, SIG_IGN);
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  // P/D: the connector's transfer engine listens before the model loads, so
  // a bad --kv-transfer-config fails fast.
  std::unique_ptr<KvConnector> connector;
  if (!f.kv_transfer_config.empty()) {
    SIESTA_ASSIGN_OR_RETURN(pd::PdConfig pd_config, pd::parse_kv_transfer_config(f.kv_transfer_config));
    pd_config.transfer.cuda_device = f.engine.cuda_device;
    pd_config.http_api_key = f.server.api_key;
    SIESTA_TRY(pd::load_auth_key(pd_config));
    SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<pd::SiestaConnector> c,
                            pd::SiestaConnector::create(pd_config, f.engine.enable_sleep_mode));
    f.server.kv_transfer_info = c->info();
    connector = std::move(c);
  }
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::create(f.engine, std::move(connector)));
  server::ApiServer api(*engine, f.server);
  SIESTA_ASSIGN_OR_RETURN(int port, api.bind());
  std::cerr << "siesta serve: listening on http://" << f.server.host << ":" << port << " (model "
            << f.server.served_model_name << ", max_model_len " << engine->limits().max_model_len << ", "
            << engine->limits().num_kv_blocks << " KV blocks)" << std::endl;

  std::thread waiter([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    api.stop();
  });
  Result<void> served = api.serve();
  pthread_kill(waiter.native_handle(), SIGTERM);  // wakes the waiter if serve() ended on its own
  waiter.join();
  return served;
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "Serve a model over the OpenAI-compatible HTTP API");
  auto f = std::make_shared<ServeFlags>();
  cmd->add_option("--model", f->engine.model_dir, "Model directory (config.json, safetensors, tokenizer.json)")
      ->required();
  cmd->add_option("--host", f->server.host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", f->server.port, "Port to listen on (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  cmd->add_option("--api-key", f->server.api_key,
                  "Require 'Authorization: Bearer KEY' on every route but /health, /ping, /version and /metrics "
                  "(default: $VLLM_API_KEY); P/D: a decode engine sends its own key to look up a prefill engine's "
                  "/kv_transfer_info");
  cmd->add_flag("--metrics-require-key", f->server.metrics_require_key, "/metrics needs the API key too");
  cmd->add_flag("--vllm-metric-names", f->server.vllm_metric_names,
                "/metrics adds vllm:-named copies of the metrics vLLM's dashboards chart");
  cmd->add_option("--chat-template", f->server.chat_template,
                  "Chat template: a Jinja file, or the template itself (default: the model's tokenizer_config.json)");
  cmd->add_flag("--enable-auto-tool-choice", f->server.chat.enable_auto_tool_choice,
                "tool_choice \"auto\": parse the model's tool calls into tool_calls");
  cmd->add_option("--tool-call-parser", f->server.chat.tool_call_parser,
                  "How tool calls are read from the output: hermes (Qwen's <tool_call> JSON)");
  cmd->add_option("--reasoning-parser", f->server.chat.reasoning_parser,
                  "Split reasoning_content from the answer: qwen3 (<think>...</think>)");
  cmd->add_flag("--trust-request-chat-template", f->server.chat.trust_request_chat_template,
                "Accept a request's own chat_template");
  cmd->add_flag("--exclude-tools-when-tool-choice-none", f->server.chat.exclude_tools_when_tool_choice_none,
                "tool_choice \"none\" leaves the tools out of the prompt");
  cmd->add_option(
      "--default-chat-template-kwargs", f->default_chat_template_kwargs,
      "JSON object of chat_template_kwargs every chat request starts from, e.g. '{\"enable_thinking\": false}'");
  cmd->add_option("--served-model-name", f->server.served_model_name, "Model name in the API (default: --model)");
  cmd->add_option("--max-model-len", f->max_model_len,
                  "Prompt + output tokens per request (default: the model's max_position_embeddings, "
                  "lowered to what the KV cache holds)")
      ->check(CLI::Range(int64_t{2}, int64_t{INT32_MAX}));
  cmd->add_option("--max-num-seqs", f->engine.max_num_seqs, "Requests running at once")
      ->check(CLI::Range(1, INT32_MAX))
      ->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", f->engine.max_num_batched_tokens, "Tokens per engine step")
      ->check(CLI::Range(1, INT32_MAX))
      ->capture_default_str();
  f->device.add_to(*cmd);
  auto* blocks = cmd->add_option("--num-kv-blocks", f->num_kv_blocks, "KV cache size in blocks of 16 tokens")
                     ->check(CLI::Range(int64_t{1}, int64_t{INT32_MAX}));
  f->device.kv_bytes_option->excludes(blocks);
  cmd->add_flag("--no-enable-prefix-caching", f->no_prefix_caching, "Turn the prefix cache off");
  cmd->add_option("--kv-transfer-config", f->kv_transfer_config,
                  "P/D disaggregation, vLLM's JSON: {\"kv_connector\": \"SiestaConnector\", \"kv_role\": "
                  "\"kv_producer|kv_consumer|kv_both\", \"kv_connector_extra_config\": {\"backend\": \"ucx|ipc\", "
                  "\"mode\": \"write|read\", ...}}");
  cmd->add_flag("--enable-sleep-mode", f->engine.enable_sleep_mode,
                "Admin API of sleep mode: /sleep, /wake_up, /release_kv_cache_memory, /reload_weights, ...");
  cmd->add_option("--weight-socket", f->server.weight_socket,
                  "Also answer /update_weights on a Unix SOCK_SEQPACKET socket at PATH (mode 0600), where a trainer "
                  "passes its shared memory as a descriptor: {\"source\": \"shm\", \"fd\": 0, ...} "
                  "(docs/weight-socket.md; needs --enable-sleep-mode)")
      ->type_name("PATH");
  cmd->add_option("--max-held-requests", f->engine.max_held_requests,
                  "Requests that wait while the engine is paused or asleep; beyond, 503")
      ->check(CLI::Range(0, INT32_MAX))
      ->capture_default_str();
  cmd->add_option("--max-held-seconds", f->engine.max_held_seconds,
                  "How long such a request waits at most; then it ends with a 503 naming the engine's state")
      ->check(CLI::Range(0.001, 604800.0))
      ->capture_default_str();
  cmd->add_option("--threads", f->engine.threads, "CPU threads for the model (0: all cores)")->capture_default_str();
  cmd->add_option("--seed", f->seed, "Seed of the sampler for requests without their own seed (default: random)")
      ->check(CLI::Range(int64_t{0}, INT64_MAX));
  f->http.add_to(*cmd);
  cmd->add_option("--http-threads", f->server.http_threads,
                  "HTTP worker threads (0: max-num-seqs + 64; a request holds one while it runs)")
      ->capture_default_str();
  cmd->callback([f] {
    auto r = run_serve(*f);
    if (!r) {
      std::cerr << "siesta serve: " << r.error().message << "\n";
      throw CLI::RuntimeError(kExitFailure);
    }
  });
}

}  // namespace siesta::cli
