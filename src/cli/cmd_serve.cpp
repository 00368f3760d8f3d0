// siesta serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key K]
//              [--served-model-name NAME] [--max-model-len N] [--max-num-seqs N]
//              [--max-num-batched-tokens N] [--kv-cache-memory-bytes N | --num-kv-blocks N]
//              [--no-enable-prefix-caching] [--threads N] [--seed S]
//              [--enable-sleep-mode] [--max-held-requests N]
//              [--device cpu|cuda] [--gpu-memory-utilization F] [--batch-invariant]
//              [--kv-transfer-config JSON] [HTTP limits: cli/http_flags.h]
//
// --kv-transfer-config (vLLM's shape, src/pd/pd_config.h) makes the engine a
// P/D prefill (kv_producer), decode (kv_consumer) or both (kv_both) instance
// behind `siesta proxy`; it is checked before the model loads.
//
// Loads the model into an Engine and answers the OpenAI-compatible HTTP API
// (src/server) until SIGINT or SIGTERM. Prints one line on stderr once it
// listens: "siesta serve: listening on http://HOST:PORT (model NAME)", so a
// caller that asked for --port 0 learns the port.
#include <pthread.h>
#include <signal.h>

#include <cctype>
#include <iostream>
#include <thread>

#include "cli/commands.h"
#include "cli/device_flags.h"
#include "cli/http_flags.h"
#include "engine/engine.h"
#include "pd/pd_config.h"
#include "pd/siesta_connector.h"
#include "server/api_server.h"

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
};

Result<void> run_serve(ServeFlags& f) {
  SIESTA_TRY(f.device.apply(f.engine));
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
    pd_config.cuda_device = f.engine.cuda_device;
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
  cmd->add_option("--api-key", f->server.api_key, "Require 'Authorization: Bearer KEY' on every route but /health (P/D: /kv_transfer_info too; a decode "
                  "engine sends its own key to look up a prefill engine)");
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
  cmd->add_option("--max-held-requests", f->engine.max_held_requests,
                  "Requests that wait while the engine is paused or asleep; beyond, 503")
      ->check(CLI::Range(0, INT32_MAX))
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
