// Weights pushed into a running engine (Engine::update_weights) over host
// shared memory on the CPU model: the checks that name every tensor at fault
// and change nothing, the shared-memory file by path, by descriptor and by
// /proc/PID/fd, whole and chunked pushes in every dtype, after a pause and
// after a level-2 sleep with a weights-only wake, the prefix cache emptied,
// and the outputs compared with a fresh engine started on the same weights.
#include "model/weight_update.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/random.h"
#include "model/make_model.h"
#include "model/safetensors.h"
#include "temp_dir.h"
#include "test_data.h"

namespace siesta {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using memory::Tag;
using memory::TagSet;
using testing::TempDir;
namespace fs = std::filesystem;

const fs::path kTiny = siesta::testing::tiny_model_dir();

Deadline soon() { return Clock::now() + 60s; }

EngineOptions options(const fs::path& dir = kTiny) {
  EngineOptions o;
  o.model_dir = dir;
  o.threads = 2;
  o.max_model_len = 256;
  o.num_kv_blocks = 64;
  o.seed = 1;
  o.enable_sleep_mode = true;
  return o;
}

std::unique_ptr<Engine> make_engine(EngineOptions o = options()) {
  auto e = Engine::create(o);
  EXPECT_TRUE(e) << e.error().message;
  return e ? std::move(*e) : nullptr;
}

// A fixed greedy prompt set (two share a prefix), tokens of each.
std::vector<std::vector<int32_t>> run_prompts(Engine& e) {
  static int round = 0;
  ++round;
  std::vector<EngineRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    EngineRequest r;
    r.id = "w" + std::to_string(round) + "_" + std::to_string(i);
    for (int j = 0; j < 20 + 7 * i; ++j)
      r.prompt_tokens.push_back(static_cast<int32_t>(request_draw(i % 2 == 0 ? 5 : 6 + i, j) % 4000) + 10);
    r.params.max_tokens = 8;
    r.params.ignore_eos = true;
    r.params.temperature = 0.0;
    reqs.push_back(std::move(r));
  }
  auto s = e.submit(std::move(reqs));
  EXPECT_TRUE(s) << s.error().message;
  if (!s) return {};
  std::vector<std::vector<int32_t>> out(s->size());
  const auto end = Clock::now() + 60s;
  while (!s->finished() && Clock::now() < end)
    for (IndexedDelta& d : s->next(Clock::now() + 100ms))
      out[d.index].insert(out[d.index].end(), d.delta.token_ids.begin(), d.delta.token_ids.end());
  EXPECT_TRUE(s->finished());
  return out;
}

// Another checkpoint of the tiny model's shape (different weights).
class OtherCheckpoint {
 public:
  explicit OtherCheckpoint(uint64_t seed) : dir_("siesta_push") {
    MakeModelOptions mo;
    mo.shape = "tiny";
    mo.out_dir = dir_.path();
    mo.seed = seed;
    mo.tokenizer = kTiny / "tokenizer.json";
    mo.threads = 2;
    auto ok = make_model(mo);
    EXPECT_TRUE(ok) << ok.error().message;
  }
  const fs::path& path() const { return dir_.path(); }

 private:
  TempDir dir_;
};

// A memfd holding tensors of a checkpoint, packed in `dtype` at offsets
// aligned to the element size (each tensor after a gap of one element, so
// that nothing depends on a larger alignment).
class PackedTensors {
 public:
  PackedTensors(const fs::path& checkpoint, DType dtype, const std::vector<std::string>& only = {}) {
    auto store = TensorStore::open(checkpoint);
    EXPECT_TRUE(store) << store.error().message;
    auto cfg = ModelConfig::load(checkpoint);
    EXPECT_TRUE(cfg);
    std::vector<std::byte> bytes;
    for (const TensorSpec& spec : updatable_tensors(*cfg)) {
      if (!only.empty() && std::find(only.begin(), only.end(), spec.name) == only.end()) continue;
      auto f = store->get_f32(spec.name, spec.shape);
      EXPECT_TRUE(f) << f.error().message;
      PushedTensor t{spec.name, dtype, spec.shape, 0, bytes.size() + dtype_size(dtype)};
      bytes.resize(t.offset);
      for (float v : *f) {
        std::byte b[4];
        if (dtype == DType::kF32) {
          std::memcpy(b, &v, 4);
        } else {
          const uint16_t h = dtype == DType::kBF16 ? f32_to_bf16(v) : f32_to_f16(v);
          std::memcpy(b, &h, 2);
        }
        bytes.insert(bytes.end(), b, b + dtype_size(dtype));
      }
      tensors.push_back(std::move(t));
    }
    fd = memfd_create("siesta-test-weights", MFD_CLOEXEC);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    size = bytes.size();
  }
  ~PackedTensors() {
    if (fd >= 0) ::close(fd);
  }
  PackedTensors(const PackedTensors&) = delete;
  PackedTensors& operator=(const PackedTensors&) = delete;

  // The update naming the memfd through /proc/self/fd (as an HTTP client names its memfd).
  WeightUpdate update(bool complete) const {
    WeightUpdate u;
    u.source = WeightSource::kShm;
    u.path = "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(fd);
    u.tensors = tensors;
    u.complete = complete;
    return u;
  }

  int fd = -1;
  size_t size = 0;
  std::vector<PushedTensor> tensors;
};

ModelConfig tiny_config() {
  auto c = ModelConfig::load(kTiny);
  EXPECT_TRUE(c);
  return *c;
}

// ---- the checks ---------------------------------------------------------------------------

TEST(CheckPushedTensors, NamesEveryTensorAtFaultByKind) {
  const ModelConfig cfg = tiny_config();
  const auto specs = updatable_tensors(cfg);
  WeightUpdate u;
  u.source = WeightSource::kShm;
  u.complete = true;
  u.tensors = {
      {"model.layers.0.mlp.up_proj.weight", DType::kBF16, {768, 256}, 0, 0},
      {"model.layers.0.mlp.up_proj.weight", DType::kBF16, {768, 256}, 0, 0},         // twice
      {"model.layers.9.mlp.up_proj.weight", DType::kBF16, {768, 256}, 0, 0},         // unknown
      {"model.norm.weight", DType::kBF16, {255}, 0, 0},                              // mis-shaped
      {"model.layers.1.input_layernorm.weight", DType::kI32, {256}, 0, 0},           // dtype
      {"model.layers.1.post_attention_layernorm.weight", DType::kF32, {256}, 0, 2},  // misaligned
      {"model.layers.2.input_layernorm.weight", DType::kBF16, {256}, 0, 1u << 30},   // past the end
  };
  const uint64_t size = 1 << 20;
  auto r = check_pushed_tensors(cfg, specs, u, std::span<const uint64_t>(&size, 1));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
  const std::string& m = r.error().message;
  for (const char* want :
       {"named twice: model.layers.0.mlp.up_proj.weight", "unknown to this model: model.layers.9.mlp.up_proj.weight",
        "mis-shaped: model.norm.weight ([255] given, [256] expected)", "model.layers.1.input_layernorm.weight (I32)",
        "not a multiple of the element size: model.layers.1.post_attention_layernorm.weight",
        "past the end of their source: model.layers.2.input_layernorm.weight", "missing", "model.embed_tokens.weight",
        "the weights are unchanged"})
    EXPECT_NE(m.find(want), std::string::npos) << "no '" << want << "' in: " << m;
}

TEST(CheckPushedTensors, TiedLmHeadIsSkippedAndTheRestIndexed) {
  const ModelConfig cfg = tiny_config();
  ASSERT_TRUE(cfg.tie_word_embeddings);
  const auto specs = updatable_tensors(cfg);
  WeightUpdate u;
  u.source = WeightSource::kShm;
  u.tensors = {{"lm_head.weight", DType::kBF16, {4096, 256}, 0, 0}, {"model.norm.weight", DType::kF32, {256}, 0, 4}};
  const uint64_t size = 4096 * 256 * 2;
  auto r = check_pushed_tensors(cfg, specs, u, std::span<const uint64_t>(&size, 1));
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0], -1);
  EXPECT_EQ(specs[static_cast<size_t>((*r)[1])].name, "model.norm.weight");

  // A mis-shaped lm_head is still an error, and an untied model needs it.
  u.tensors[0].shape = {4096, 255};
  EXPECT_FALSE(check_pushed_tensors(cfg, specs, u, std::span<const uint64_t>(&size, 1)));
  ModelConfig untied = cfg;
  untied.tie_word_embeddings = false;
  const auto untied_specs = updatable_tensors(untied);
  EXPECT_EQ(untied_specs.size(), specs.size() + 1);
  u.tensors.clear();
  for (const TensorSpec& spec : untied_specs)
    if (spec.name != "lm_head.weight") u.tensors.push_back({spec.name, DType::kBF16, spec.shape, 0, 0});
  u.complete = true;
  auto missing = check_pushed_tensors(untied, untied_specs, u, std::span<const uint64_t>(&size, 1));
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message.find("1 missing (\"complete\": true): lm_head.weight"), std::string::npos)
      << missing.error().message;
}

TEST(SharedWeightFile, OpensAFileADescriptorAndAMemfdByItsProcPath) {
  TempDir dir("siesta_shm");
  const fs::path file = dir.path() / "w";
  std::ofstream(file) << "0123456789abcdef";
  WeightUpdate u;
  u.source = WeightSource::kShm;
  u.path = file;
  auto f = SharedWeightFile::open(u);
  ASSERT_TRUE(f) << f.error().message;
  EXPECT_EQ(f->bytes(), 16u);
  PushedTensor t{"x", DType::kBF16, {2}, 0, 4};
  EXPECT_EQ(std::memcmp(f->view(t).data, "4567", 4), 0);

  const int fd = memfd_create("siesta-test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, "abcdefgh", 8), 8);
  WeightUpdate by_fd;
  by_fd.source = WeightSource::kShm;
  by_fd.fd = fd;
  auto g = SharedWeightFile::open(by_fd);
  ASSERT_TRUE(g) << g.error().message;
  EXPECT_EQ(g->bytes(), 8u);
  WeightUpdate by_proc;
  by_proc.source = WeightSource::kShm;
  by_proc.path = "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(fd);
  auto h = SharedWeightFile::open(by_proc);
  ASSERT_TRUE(h) << h.error().message;
  EXPECT_EQ(std::memcmp(h->view(t).data, "efgh", 4), 0);
  ::close(fd);
  EXPECT_EQ(std::memcmp(h->view(t).data, "efgh", 4), 0);  // the mapping keeps the memfd

  WeightUpdate none;
  none.source = WeightSource::kShm;
  none.path = dir.path() / "nope";
  EXPECT_FALSE(SharedWeightFile::open(none));
  none.path = dir.path();  // a directory
  EXPECT_FALSE(SharedWeightFile::open(none));
  std::ofstream(dir.path() / "empty");
  none.path = dir.path() / "empty";
  EXPECT_FALSE(SharedWeightFile::open(none));
}

// ---- the engine ---------------------------------------------------------------------------

TEST(EngineUpdateWeights, AShmPushAfterAPauseGivesAFreshEnginesOutputs) {
  OtherCheckpoint other(77);
  std::vector<std::vector<int32_t>> theirs;
  {
    auto fresh = make_engine(options(other.path()));
    ASSERT_TRUE(fresh);
    theirs = run_prompts(*fresh);
  }
  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto ours = run_prompts(*e);
  ASSERT_NE(ours, theirs);
  (void)run_prompts(*e);  // the prefix cache now holds these prompts' blocks
  const uint64_t hits_before = e->metrics().prefix_cache_hits;
  ASSERT_GT(hits_before, 0u);

  PackedTensors packed(other.path(), DType::kBF16);
  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon()));
  auto r = e->update_weights(packed.update(/*complete=*/true), soon());
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_TRUE(r->call.weights_update);
  const WeightUpdateReport& w = *r->call.weights_update;
  EXPECT_EQ(w.tensors, static_cast<int64_t>(updatable_tensors(tiny_config()).size()));
  EXPECT_EQ(w.bytes, packed.size - packed.tensors.size() * 2);  // everything but the one-element gaps
  EXPECT_EQ(r->weights_source, "shm");
  EXPECT_TRUE(r->weights_loaded);
  EXPECT_EQ(r->state, EngineState::kPaused);
  ASSERT_TRUE(e->resume(soon()));
  const uint64_t hits_after_update = e->metrics().prefix_cache_hits;
  EXPECT_EQ(run_prompts(*e), theirs);
  // The first run after the update found nothing cached from the old weights
  // (beyond the prefix its own prompts share).
  const uint64_t hits_first_run = e->metrics().prefix_cache_hits - hits_after_update;
  EXPECT_LT(hits_first_run, hits_before / 2);

  // A directory through the same call: the engine's own checkpoint (the
  // weights' directory, named or not), and back to its outputs.
  ASSERT_TRUE(e->pause(PauseMode::kWait, soon()));
  WeightUpdate dir;
  dir.source = WeightSource::kDir;
  auto back = e->update_weights(dir, soon());
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(back->weights_source, "dir");
  EXPECT_EQ(back->call.weights_update->from, kTiny.string());
  ASSERT_TRUE(e->resume(soon()));
  EXPECT_EQ(run_prompts(*e), ours);
}

TEST(EngineUpdateWeights, EveryDtypeAfterALevel2SleepAndAWeightsWake) {
  OtherCheckpoint other(78);
  std::vector<std::vector<int32_t>> theirs;
  {
    auto fresh = make_engine(options(other.path()));
    ASSERT_TRUE(fresh);
    theirs = run_prompts(*fresh);
  }
  auto e = make_engine();
  ASSERT_TRUE(e);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PackedTensors packed(other.path(), dtype);
    ASSERT_TRUE(e->sleep(2, PauseMode::kKeep, soon()));
    ASSERT_TRUE(e->wake_up({Tag::kWeights}, soon()));
    auto r = e->update_weights(packed.update(true), soon());
    ASSERT_TRUE(r) << r.error().message;
    EXPECT_EQ(r->state, EngineState::kPartiallyAwake);
    EXPECT_TRUE(r->weights_loaded);
    EXPECT_EQ(r->weights_unwritten, 0);
    ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
    EXPECT_EQ(run_prompts(*e), theirs) << dtype_name(dtype);
  }
  // float16: the same as a checkpoint stored in float16 (both convert the same way).
  TempDir f16_dir("siesta_f16");
  for (const auto& f : fs::directory_iterator(other.path()))
    if (f.path().extension() != ".safetensors") fs::copy(f.path(), f16_dir.path() / f.path().filename());
  {
    auto store = TensorStore::open(other.path());
    ASSERT_TRUE(store);
    std::vector<std::vector<uint16_t>> data;
    std::vector<TensorData> tensors;
    for (const TensorSpec& spec : updatable_tensors(tiny_config())) {
      auto f = store->get_f32(spec.name, spec.shape);
      ASSERT_TRUE(f);
      std::vector<uint16_t> h;
      for (float v : *f) h.push_back(f32_to_f16(v));
      data.push_back(std::move(h));
      tensors.push_back({spec.name, DType::kF16, spec.shape,
                         std::as_bytes(std::span<const uint16_t>(data.back().data(), data.back().size()))});
    }
    ASSERT_TRUE(write_safetensors(f16_dir.path() / "model.safetensors", tensors));
  }
  std::vector<std::vector<int32_t>> f16_outputs;
  {
    auto fresh = make_engine(options(f16_dir.path()));
    ASSERT_TRUE(fresh);
    f16_outputs = run_prompts(*fresh);
  }
  PackedTensors packed(other.path(), DType::kF16);
  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon()));
  ASSERT_TRUE(e->update_weights(packed.update(true), soon()));
  ASSERT_TRUE(e->resume(soon()));
  EXPECT_EQ(run_prompts(*e), f16_outputs);
}

TEST(EngineUpdateWeights, ChunkedPushesCompleteTheWeightsAndAnIncompleteWakeIsRefused) {
  OtherCheckpoint other(79);
  std::vector<std::vector<int32_t>> theirs;
  {
    auto fresh = make_engine(options(other.path()));
    ASSERT_TRUE(fresh);
    theirs = run_prompts(*fresh);
  }
  const auto specs = updatable_tensors(tiny_config());
  std::vector<std::string> first, second;
  for (size_t i = 0; i < specs.size(); ++i) (i % 2 ? second : first).push_back(specs[i].name);
  PackedTensors a(other.path(), DType::kBF16, first), b(other.path(), DType::kBF16, second);

  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto ours = run_prompts(*e);
  ASSERT_TRUE(e->sleep(2, PauseMode::kKeep, soon()));
  ASSERT_TRUE(e->wake_up({Tag::kWeights}, soon()));
  auto half = e->update_weights(a.update(false), soon());
  ASSERT_TRUE(half) << half.error().message;
  EXPECT_FALSE(half->weights_loaded);
  EXPECT_EQ(half->weights_unwritten, static_cast<int32_t>(second.size()));
  // Half the tensors pushed: the wake does not fill the rest from the old checkpoint.
  auto early = e->wake_up(TagSet::all(), soon());
  ASSERT_FALSE(early);
  EXPECT_EQ(early.error().code, ErrorCode::kConflict);
  EXPECT_NE(early.error().message.find(std::to_string(second.size()) + " of " + std::to_string(specs.size())),
            std::string::npos)
      << early.error().message;
  EXPECT_EQ(e->state(), EngineState::kPartiallyAwake);
  // "complete" refuses a push that does not name every tensor.
  auto incomplete = e->update_weights(b.update(true), soon());
  ASSERT_FALSE(incomplete);
  EXPECT_NE(incomplete.error().message.find(first.front()), std::string::npos) << incomplete.error().message;
  auto rest = e->update_weights(b.update(false), soon());
  ASSERT_TRUE(rest) << rest.error().message;
  EXPECT_TRUE(rest->weights_loaded);
  ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
  EXPECT_EQ(run_prompts(*e), theirs);

  // Pushed weights released by a level-2 sleep: the wake does not read the
  // old checkpoint in their place either; reload_weights does, on request.
  ASSERT_TRUE(e->sleep(2, PauseMode::kKeep, soon()));
  auto again = e->wake_up(TagSet::all(), soon());
  ASSERT_FALSE(again);
  EXPECT_NE(again.error().message.find("pushed"), std::string::npos) << again.error().message;
  ASSERT_TRUE(e->reload_weights(kTiny, soon()));
  ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
  EXPECT_EQ(run_prompts(*e), ours);

  // Level 1 keeps pushed weights (offloaded to host) across the sleep.
  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon()));
  ASSERT_TRUE(e->update_weights(a.update(false), soon()));
  ASSERT_TRUE(e->update_weights(b.update(false), soon()));
  ASSERT_TRUE(e->sleep(1, PauseMode::kKeep, soon()));
  ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
  EXPECT_EQ(run_prompts(*e), theirs);
}

TEST(EngineUpdateWeights, ARefusedUpdateChangesNothing) {
  OtherCheckpoint other(80);
  auto e = make_engine();
  ASSERT_TRUE(e);
  const auto ours = run_prompts(*e);
  PackedTensors packed(other.path(), DType::kBF16);

  // Running: pause first.
  auto running = e->update_weights(packed.update(true), soon());
  ASSERT_FALSE(running);
  EXPECT_EQ(running.error().code, ErrorCode::kConflict);
  EXPECT_NE(running.error().message.find("pause"), std::string::npos) << running.error().message;

  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon()));
  WeightUpdate bad = packed.update(true);
  bad.tensors[3].shape = {1, 2, 3};
  bad.tensors.push_back({"model.layers.4.mlp.up_proj.weight", DType::kBF16, {768, 256}, 0, 0});
  auto refused = e->update_weights(bad, soon());
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.error().message.find(bad.tensors[3].name), std::string::npos) << refused.error().message;
  EXPECT_NE(refused.error().message.find("model.layers.4.mlp.up_proj.weight"), std::string::npos);
  // Past the end of the memfd.
  WeightUpdate past = packed.update(false);
  past.tensors.resize(1);
  past.tensors[0].offset = packed.size;
  EXPECT_FALSE(e->update_weights(past, soon()));
  // CUDA IPC needs the CUDA model; a file that is not there.
  WeightUpdate ipc = packed.update(false);
  ipc.source = WeightSource::kCudaIpc;
  ipc.buffers.push_back({});
  auto on_cpu = e->update_weights(ipc, soon());
  ASSERT_FALSE(on_cpu);
  EXPECT_NE(on_cpu.error().message.find("--device cuda"), std::string::npos) << on_cpu.error().message;
  WeightUpdate gone = packed.update(false);
  gone.path = "/dev/shm/siesta-no-such-file";
  EXPECT_FALSE(e->update_weights(gone, soon()));
  WeightUpdate wrong_dir;
  wrong_dir.source = WeightSource::kDir;
  wrong_dir.path = "/nonexistent";
  EXPECT_FALSE(e->update_weights(wrong_dir, soon()));
  EXPECT_EQ(e->status().weights_source, "dir");
  ASSERT_TRUE(e->resume(soon()));
  EXPECT_EQ(run_prompts(*e), ours);

  // Weights offloaded by a level-1 sleep: wake them first.
  ASSERT_TRUE(e->sleep(1, PauseMode::kKeep, soon()));
  auto asleep = e->update_weights(packed.update(true), soon());
  ASSERT_FALSE(asleep);
  EXPECT_EQ(asleep.error().code, ErrorCode::kConflict);
  EXPECT_NE(asleep.error().message.find("wake_up?tags=weights"), std::string::npos) << asleep.error().message;
  ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
  EXPECT_EQ(run_prompts(*e), ours);
}

}  // namespace
}  // namespace siesta
