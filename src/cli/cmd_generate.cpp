// siesta generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-tokens N
//                 [--temperature T] [--top-p P] [--top-k K] [--seed S] [--ignore-eos]
//                 [--json] [--dump-logits FILE] [--threads N]
//                 [--device cpu|cuda] [--gpu-memory-utilization F] [--kv-cache-memory-bytes N]
//                 [--no-batch-invariant] [--tensor-parallel-size N | -tp N]
//
// One sequence through the model: the prompt in one forward step, then one
// token per step through the paged KV cache. Text streams to stdout as it is
// generated (whole UTF-8 characters only); --json prints one object at the end.
// The model and its KV cache come from a memory pool on the device
// (engine_model.h); the KV cache holds exactly prompt + max tokens, which must
// fit in what --kv-cache-memory-bytes or (CUDA) --gpu-memory-utilization allows.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <iostream>

#include "cli/commands.h"
#include "cli/device_flags.h"
#include "common/thread_pool.h"
#include "engine/engine_kv_cache.h"
#include "engine/engine_model.h"
#include "engine/sampler.h"
#include "model/safetensors.h"
#include "model/tokenizer.h"

namespace siesta::cli {
namespace {

struct GenerateOptions {
  std::string model;
  std::string prompt;
  std::string prompt_ids;
  int max_tokens = 0;
  double temperature = 0.0;
  double top_p = 1.0;
  int top_k = 0;
  std::optional<uint64_t> seed;
  bool ignore_eos = false;
  bool json = false;
  std::string dump_logits;
  size_t threads = 0;
  DeviceFlags device;
};

Result<std::vector<int32_t>> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  const char* p = text.data();
  const char* end = p + text.size();
  while (p < end) {
    int32_t v = 0;
    auto [next, ec] = std::from_chars(p, end, v);
    if (ec != std::errc() || v < 0)
      return invalid_argument("--prompt-ids: expected comma-separated non-negative integers, got \"" + text + "\"");
    ids.push_back(v);
    p = next;
    if (p < end) {
      if (*p != ',') return invalid_argument("--prompt-ids: expected ',' after " + std::to_string(v) + " in \"" + text + "\"");
      ++p;
    }
  }
  if (ids.empty()) return invalid_argument("--prompt-ids: no token ids given");
  return ids;
}

Result<void> write_prompt_logits(const std::string& path, const ForwardOutput& out, size_t prompt_len) {
  const auto* bytes = reinterpret_cast<const std::byte*>(out.logits.data());
  TensorData t{"logits", DType::kF32, {static_cast<int64_t>(prompt_len), out.vocab_size},
               {bytes, prompt_len * out.vocab_size * sizeof(float)}};
  return write_safetensors(path, {t}, {{"format", "pt"}});
}

Result<void> run_generate(const GenerateOptions& opt) {
  SamplingParams params;
  params.temperature = opt.temperature;
  params.top_p = opt.top_p;
  params.top_k = opt.top_k;
  params.seed = opt.seed;
  params.max_tokens = opt.max_tokens;
  params.ignore_eos = opt.ignore_eos;
  SIESTA_TRY(params.validate());

  EngineOptions eo;
  eo.model_dir = opt.model;
  eo.threads = opt.threads;
  eo.max_num_seqs = 1;
  SIESTA_TRY(opt.device.apply(eo));
  SIESTA_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::load(opt.model));
  SIESTA_ASSIGN_OR_RETURN(const ModelConfig cfg, ModelConfig::load(opt.model));

  std::vector<int32_t> prompt;
  if (!opt.prompt_ids.empty()) {
    SIESTA_ASSIGN_OR_RETURN(prompt, parse_ids(opt.prompt_ids));
    for (int32_t id : prompt)
      if (id >= cfg.vocab_size)
        return invalid_argument("--prompt-ids: token id " + std::to_string(id) + " is outside the model's vocabulary [0, " +
                                std::to_string(cfg.vocab_size) + ")");
  } else {
    prompt = tok.encode(opt.prompt);
    if (prompt.empty()) return invalid_argument("--prompt: the prompt encodes to no tokens");
  }
  const size_t total = prompt.size() + static_cast<size_t>(opt.max_tokens);
  if (cfg.max_position_embeddings > 0 && total > static_cast<size_t>(cfg.max_position_embeddings))
    return invalid_argument("prompt (" + std::to_string(prompt.size()) + " tokens) + --max-tokens (" +
                            std::to_string(opt.max_tokens) + ") exceeds the model's max_position_embeddings (" +
                            std::to_string(cfg.max_position_embeddings) + ")");
  // The CUDA model sizes its RoPE table and decode buffers for this context.
  eo.max_model_len = static_cast<int32_t>(total);

  ThreadPool pool(eo.device == Device::kCpu ? opt.threads : 1);
  SIESTA_ASSIGN_OR_RETURN(EngineModel loaded, load_engine_model(eo, pool));
  Model* model = loaded.model.get();

  const KvCacheLayout layout = model->kv_layout();
  const int num_blocks = static_cast<int>((total + layout.block_size - 1) / layout.block_size);
  const uint64_t needed = static_cast<uint64_t>(num_blocks) * layout.block_bytes();
  if (eo.kv_cache_memory_bytes || eo.device == Device::kCuda) {
    SIESTA_ASSIGN_OR_RETURN(uint64_t budget, kv_cache_budget(eo, loaded));
    if (needed > budget)
      return out_of_memory("prompt + --max-tokens (" + std::to_string(total) + " tokens) need " +
                           std::to_string(needed) + " bytes of KV cache, more than the " + std::to_string(budget) +
                           " bytes " +
                           (eo.kv_cache_memory_bytes ? "--kv-cache-memory-bytes allows"
                                                     : "--gpu-memory-utilization leaves after the weights") +
                           "; generate fewer tokens or allow more");
  }
  // Destroyed before `loaded` (declared after it): the pool outlives it.
  SIESTA_ASSIGN_OR_RETURN(KvCacheMemory cache, KvCacheMemory::allocate(*loaded.memory, layout, num_blocks));
  std::vector<int32_t> block_table(num_blocks);
  for (int i = 0; i < num_blocks; ++i) block_table[i] = i;
  const KvCacheView kv = cache.view();

  Sampler sampler(cfg.eos_token_ids, RandomGenerator::from_entropy());
  IncrementalDetokenizer detok(tok, /*skip_special_tokens=*/true);
  std::vector<int32_t> generated;
  std::vector<int32_t> step_tokens = prompt;
  int32_t pos = 0;
  ForwardOutput out;
  const auto t0 = std::chrono::steady_clock::now();
  auto t_first = t0;
  while (static_cast<int>(generated.size()) < opt.max_tokens) {
    const bool first = generated.empty();
    SequenceChunk seq{step_tokens, pos, block_table, first && !opt.dump_logits.empty()};
    SIESTA_TRY(model->forward({&seq, 1}, kv, out));
    if (first && !opt.dump_logits.empty()) SIESTA_TRY(write_prompt_logits(opt.dump_logits, out, prompt.size()));
    const SampledToken s = sampler.sample(out.last(0), params, generated.size());
    if (first) t_first = std::chrono::steady_clock::now();
    generated.push_back(s.token);
    if (!opt.json) std::cout << detok.push(s.token) << std::flush;
    pos += static_cast<int32_t>(step_tokens.size());
    step_tokens = {s.token};
    const bool eos = std::find(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end(), s.token) != cfg.eos_token_ids.end();
    if (eos && !opt.ignore_eos) break;
  }
  const auto t_end = std::chrono::steady_clock::now();
  if (opt.json) {
    nlohmann::json j{{"prompt_ids", prompt}, {"token_ids", generated}, {"text", tok.decode(generated, true)}};
    std::cout << j.dump() << "\n";
  } else {
    std::cout << detok.finish() << "\n";
    const double prefill_ms = std::chrono::duration<double, std::milli>(t_first - t0).count();
    const double decode_s = std::chrono::duration<double>(t_end - t_first).count();
    std::cerr << "prompt " << prompt.size() << " tokens in " << prefill_ms << " ms; " << generated.size()
              << " tokens generated";
    if (generated.size() > 1 && decode_s > 0)
      std::cerr << ", " << static_cast<double>(generated.size() - 1) / decode_s << " tokens/s decode";
    std::cerr << "\n";
  }
  return {};
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Generate a continuation of one prompt");
  auto opt = std::make_shared<GenerateOptions>();
  cmd->add_option("--model", opt->model, "Model directory (config.json, safetensors, tokenizer.json)")->required();
  auto* prompt = cmd->add_option("--prompt", opt->prompt, "Prompt text");
  auto* ids = cmd->add_option("--prompt-ids", opt->prompt_ids, "Prompt as token ids: 1,2,3");
  prompt->excludes(ids);
  cmd->add_option("--max-tokens", opt->max_tokens, "Tokens to generate")->required()->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", opt->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", opt->top_p)->capture_default_str();
  cmd->add_option("--top-k", opt->top_k, "0 = off")->capture_default_str();
  cmd->add_option("--seed", opt->seed, "Seed for reproducible sampling");
  cmd->add_flag("--ignore-eos", opt->ignore_eos, "Do not stop at the end-of-sequence token");
  cmd->add_flag("--json", opt->json, "Print {\"prompt_ids\", \"token_ids\", \"text\"}");
  cmd->add_option("--dump-logits", opt->dump_logits, "Write the prompt's logits [prompt_len, vocab] as safetensors");
  cmd->add_option("--threads", opt->threads, "CPU threads (0 = all cores)")->capture_default_str();
  opt->device.add_to(*cmd);
  cmd->callback([opt] {
    if (opt->prompt.empty() && opt->prompt_ids.empty()) {
      std::cerr << "siesta generate: give --prompt TEXT or --prompt-ids 1,2,3\n";
      throw CLI::RuntimeError(kExitUsage);
    }
    auto r = run_generate(*opt);
    if (!r) {
      std::cerr << "siesta generate: " << r.error().message << "\n";
      throw CLI::RuntimeError(kExitFailure);
    }
  });
}

}  // namespace siesta::cli
