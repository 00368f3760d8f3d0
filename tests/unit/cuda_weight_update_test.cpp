// Weights pushed into the CUDA engine (Engine::update_weights): over CUDA IPC
// from another process on the GPU (this binary again, as the exporter: it
// cudaMallocs one buffer, copies a checkpoint's tensors into it in their
// stored dtype and hands out the cudaIpcMemHandle_t), in bfloat16, float32
// and float16 (converted on the GPU), and over host shared memory; each
// gives the outputs of a fresh CUDA engine started on the same checkpoint.
// Bad handles and buffers described larger than their allocation are refused
// with the weights unchanged; the checkpoint read (copy_files) gives the same
// outputs as the load. The uploads out of pinned slots (WeightUpload), by the
// gather kernel and by the copy engines, land byte for byte, and a whole
// engine sleeps, wakes and reloads to the same outputs with either
// (memory::HostToDeviceCopy). Skips without a GPU (or a build without CUDA).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/random.h"
#include "model/make_model.h"
#include "model/safetensors.h"
#include "model/weight_update.h"
#include "temp_dir.h"
#include "test_data.h"

#ifdef SIESTA_HAVE_CUDA
#include <cuda_runtime.h>

#include "memory/host_to_device_copy.h"
#include "model/cuda/qwen3_cuda.h"
#include "model/cuda/weight_upload.h"
#endif

extern char** environ;

namespace siesta {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using memory::Tag;
using memory::TagSet;
using testing::TempDir;
namespace fs = std::filesystem;

const fs::path kTiny = siesta::testing::tiny_model_dir();
constexpr uint64_t kMiB = uint64_t{1} << 20;

Deadline soon() { return Clock::now() + 120s; }

EngineOptions cuda_options(const fs::path& dir = kTiny) {
  EngineOptions o;
  o.model_dir = dir;
  o.device = Device::kCuda;
  o.enable_sleep_mode = true;
  o.max_model_len = 512;
  o.max_num_seqs = 16;
  o.max_num_batched_tokens = 512;
  o.kv_cache_memory_bytes = 64 * kMiB;
  o.enable_prefix_caching = false;
  o.seed = 1;
  return o;
}

std::unique_ptr<Engine> make_engine_or_skip(const EngineOptions& o, std::string& skip) {
  auto e = Engine::create(o);
  if (!e) {
    if (e.error().code == ErrorCode::kUnavailable)
      skip = e.error().message;
    else
      ADD_FAILURE() << e.error().message;
    return nullptr;
  }
  return std::move(*e);
}

std::vector<std::vector<int32_t>> run_prompts(Engine& e) {
  static int round = 0;
  ++round;
  std::vector<EngineRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    EngineRequest r;
    r.id = "u";
    r.id += std::to_string(round);
    r.id += '_';
    r.id += std::to_string(i);
    for (int j = 0; j < 7 + 13 * i; ++j)
      r.prompt_tokens.push_back(static_cast<int32_t>(request_draw(60 + i, j) % 4000) + 10);
    r.params.max_tokens = 12;
    r.params.ignore_eos = true;
    r.params.temperature = 0.0;
    reqs.push_back(std::move(r));
  }
  auto s = e.submit(reqs);
  EXPECT_TRUE(s) << s.error().message;
  if (!s) return {};
  std::vector<std::vector<int32_t>> out(s->size());
  const auto end = Clock::now() + 120s;
  while (!s->finished() && Clock::now() < end)
    for (IndexedDelta& d : s->next(Clock::now() + 100ms))
      out[d.index].insert(out[d.index].end(), d.delta.token_ids.begin(), d.delta.token_ids.end());
  EXPECT_TRUE(s->finished());
  return out;
}

void make_other(const fs::path& dir, uint64_t seed) {
  MakeModelOptions mo;
  mo.shape = "tiny";
  mo.out_dir = dir;
  mo.seed = seed;
  mo.tokenizer = kTiny / "tokenizer.json";
  mo.threads = 2;
  auto ok = make_model(mo);
  ASSERT_TRUE(ok) << ok.error().message;
}

// `from`'s checkpoint with every tensor stored as `dtype` instead.
[[maybe_unused]] void write_as(const fs::path& from, const fs::path& to, DType dtype) {
  fs::create_directories(to);
  for (const auto& f : fs::directory_iterator(from))
    if (f.path().extension() != ".safetensors") fs::copy(f.path(), to / f.path().filename());
  auto store = TensorStore::open(from);
  ASSERT_TRUE(store);
  auto cfg = ModelConfig::load(from);
  ASSERT_TRUE(cfg);
  std::vector<std::vector<std::byte>> data;
  std::vector<TensorData> tensors;
  for (const TensorSpec& spec : updatable_tensors(*cfg)) {
    auto f = store->get_f32(spec.name, spec.shape);
    ASSERT_TRUE(f);
    std::vector<std::byte> b(f->size() * dtype_size(dtype));
    for (size_t i = 0; i < f->size(); ++i) {
      if (dtype == DType::kF32) {
        std::memcpy(&b[4 * i], &(*f)[i], 4);
      } else {
        const uint16_t h = dtype == DType::kF16 ? f32_to_f16((*f)[i]) : f32_to_bf16((*f)[i]);
        std::memcpy(&b[2 * i], &h, 2);
      }
    }
    data.push_back(std::move(b));
    tensors.push_back({spec.name, dtype, spec.shape, std::span<const std::byte>(data.back())});
  }
  ASSERT_TRUE(write_safetensors(to / "model.safetensors", tensors));
}

#ifdef SIESTA_HAVE_CUDA

constexpr uint64_t kBufferOffset = 1024;  // the tensors start this far into the allocation

std::string hex(const void* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    const auto b = static_cast<const unsigned char*>(p)[i];
    out += d[b >> 4];
    out += d[b & 15];
  }
  return out;
}

std::string unhex(const std::string& s) {
  std::string out;
  for (size_t i = 0; i + 1 < s.size(); i += 2) out += static_cast<char>(std::stoi(s.substr(i, 2), nullptr, 16));
  return out;
}

// The exporter: run as a child of the tests below (SIESTA_IPC_EXPORT names
// the checkpoint); prints the handle and the tensors on fd 3, then keeps the
// memory until its stdin closes.
TEST(CudaWeightUpdate, ExporterChild) {
  const char* dir = std::getenv("SIESTA_IPC_EXPORT");
  if (!dir) GTEST_SKIP() << "the exporter process of the CUDA IPC tests";
  auto store = TensorStore::open(dir);
  ASSERT_TRUE(store) << store.error().message;
  auto cfg = ModelConfig::load(dir);
  ASSERT_TRUE(cfg);
  std::vector<std::pair<const TensorView*, uint64_t>> placed;
  uint64_t at = 0;
  for (const TensorSpec& spec : updatable_tensors(*cfg)) {
    const TensorView* v = store->find(spec.name);
    ASSERT_NE(v, nullptr) << spec.name;
    at = (at + 255) / 256 * 256 + 2;  // offsets aligned to 2 bytes only, on purpose
    at = (at + dtype_size(v->dtype) - 1) / dtype_size(v->dtype) * dtype_size(v->dtype);
    placed.push_back({v, at});
    at += v->nbytes;
  }
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, kBufferOffset + at), cudaSuccess);
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& [v, off] : placed) {
    ASSERT_EQ(
        cudaMemcpy(static_cast<std::byte*>(buf) + kBufferOffset + off, v->data, v->nbytes, cudaMemcpyHostToDevice),
        cudaSuccess);
    tensors.push_back({{"name", v->name}, {"dtype", static_cast<int>(v->dtype)}, {"shape", v->shape}, {"offset", off}});
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaIpcMemHandle_t h;
  ASSERT_EQ(cudaIpcGetMemHandle(&h, buf), cudaSuccess);
  const std::string line =
      nlohmann::json{{"handle", hex(&h, sizeof(h))}, {"bytes", at}, {"tensors", tensors}}.dump() + "\n";
  ASSERT_EQ(::write(3, line.data(), line.size()), static_cast<ssize_t>(line.size()));
  ::close(3);
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  cudaFree(buf);
}

// A child exporting `dir`'s tensors; its update, kept valid while the object lives.
class Exporter {
 public:
  explicit Exporter(const fs::path& dir) {
    // Close-on-exec pipes: the child keeps only the copies dup2 makes (fds 0 and 3), so
    // that its closing fd 3 ends the parent's read and the parent's closing its end ends
    // the child's.
    int to_child[2], from_child[2];
    EXPECT_EQ(::pipe2(to_child, O_CLOEXEC), 0);
    EXPECT_EQ(::pipe2(from_child, O_CLOEXEC), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&fa, from_child[1], 3);
    std::vector<std::string> env_s;
    for (char** e = environ; *e; ++e) env_s.push_back(*e);
    env_s.push_back("SIESTA_IPC_EXPORT=" + dir.string());
    std::vector<char*> envp;
    for (std::string& s : env_s) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = fs::read_symlink("/proc/self/exe").string();
    std::string filter = "--gtest_filter=CudaWeightUpdate.ExporterChild";
    char* argv[] = {exe.data(), filter.data(), nullptr};
    EXPECT_EQ(posix_spawn(&pid_, exe.c_str(), &fa, nullptr, argv, envp.data()), 0);
    posix_spawn_file_actions_destroy(&fa);
    ::close(to_child[0]);
    ::close(from_child[1]);
    stdin_ = to_child[1];
    std::string text;
    char buf[65536];
    for (ssize_t n; (n = ::read(from_child[0], buf, sizeof(buf))) > 0;) text.append(buf, static_cast<size_t>(n));
    ::close(from_child[0]);
    EXPECT_FALSE(text.empty()) << "the exporter printed nothing";
    if (text.empty()) return;
    const nlohmann::json j = nlohmann::json::parse(text);
    update.source = WeightSource::kCudaIpc;
    CudaIpcBuffer b;
    const std::string h = unhex(j["handle"].get<std::string>());
    std::memcpy(b.handle.data(), h.data(), b.handle.size());
    b.offset = kBufferOffset;
    b.bytes = j["bytes"].get<uint64_t>();
    update.buffers.push_back(b);
    for (const auto& t : j["tensors"])
      update.tensors.push_back({t["name"].get<std::string>(), static_cast<DType>(t["dtype"].get<int>()),
                                t["shape"].get<std::vector<int64_t>>(), 0, t["offset"].get<uint64_t>()});
    update.complete = true;
  }
  ~Exporter() {
    if (stdin_ >= 0) ::close(stdin_);
    int status = 0;
    if (pid_ > 0) ::waitpid(pid_, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the exporter failed";
  }
  Exporter(const Exporter&) = delete;
  Exporter& operator=(const Exporter&) = delete;

  WeightUpdate update;

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
};

TEST(CudaWeightUpdate, CudaIpcPushesInEveryDtypeGiveAFreshEnginesOutputs) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  TempDir tmp("siesta_cuda_push");
  make_other(tmp.path() / "bf16", 81);
  write_as(tmp.path() / "bf16", tmp.path() / "f32", DType::kF32);
  write_as(tmp.path() / "bf16", tmp.path() / "f16", DType::kF16);
  std::string skip;
  auto e = make_engine_or_skip(cuda_options(), skip);
  if (!e) GTEST_SKIP() << skip;
  const auto ours = run_prompts(*e);
  for (const char* name : {"bf16", "f32", "f16"}) {
    const fs::path dir = tmp.path() / name;
    std::vector<std::vector<int32_t>> theirs;
    {
      auto fresh = make_engine_or_skip(cuda_options(dir), skip);
      ASSERT_TRUE(fresh);
      theirs = run_prompts(*fresh);
    }
    ASSERT_NE(theirs, ours);
    Exporter ex(dir);
    // The RL order: level 2, weights only, push, the rest.
    ASSERT_TRUE(e->sleep(2, PauseMode::kKeep, soon()));
    ASSERT_TRUE(e->wake_up({Tag::kWeights}, soon()));
    auto r = e->update_weights(ex.update, soon());
    ASSERT_TRUE(r) << name << ": " << r.error().message;
    ASSERT_TRUE(r->call.weights_update);
    EXPECT_EQ(r->call.weights_update->tensors, static_cast<int64_t>(ex.update.tensors.size()));
    EXPECT_EQ(r->weights_source, "cuda_ipc");
    ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
    EXPECT_EQ(run_prompts(*e), theirs) << name;
  }
  // Back to our own checkpoint through the directory path (the parallel file reads).
  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon()));
  ASSERT_TRUE(e->reload_weights(kTiny, soon()));
  ASSERT_TRUE(e->resume(soon()));
  EXPECT_EQ(run_prompts(*e), ours);
}

TEST(CudaWeightUpdate, BadHandlesAndOversizedBuffersChangeNothing) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  TempDir tmp("siesta_cuda_push_bad");
  make_other(tmp.path() / "other", 82);
  std::string skip;
  auto e = make_engine_or_skip(cuda_options(), skip);
  if (!e) GTEST_SKIP() << skip;
  const auto ours = run_prompts(*e);
  Exporter ex(tmp.path() / "other");
  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon()));

  WeightUpdate garbage = ex.update;
  garbage.buffers[0].handle.fill(std::byte{0x5a});
  auto g = e->update_weights(garbage, soon());
  ASSERT_FALSE(g);
  EXPECT_EQ(g.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(g.error().message.find("cudaIpcOpenMemHandle"), std::string::npos) << g.error().message;

  WeightUpdate oversized = ex.update;
  oversized.buffers[0].bytes += 64 * kMiB;
  auto o = e->update_weights(oversized, soon());
  ASSERT_FALSE(o);
  EXPECT_NE(o.error().message.find("of its allocation"), std::string::npos) << o.error().message;

  WeightUpdate past = ex.update;
  past.tensors[5].offset = past.buffers[0].bytes - 2;
  auto p = e->update_weights(past, soon());
  ASSERT_FALSE(p);
  EXPECT_NE(p.error().message.find(past.tensors[5].name), std::string::npos) << p.error().message;

  ASSERT_TRUE(e->resume(soon()));
  EXPECT_EQ(run_prompts(*e), ours);
}

// WeightUpload's copies out of its pinned slots, byte for byte, with each
// HostToDeviceCopy: a checkpoint file read as many pieces (small ones that
// share a read, more of them than one kernel launch carries; odd sizes, odd
// file and device offsets; pieces larger than a read), and staged copies of
// ordinary memory. Slots of 1 MiB, so that every path turns over many times.
TEST(CudaWeightUpload, SlotCopiesLandByteForByteWithTheKernelAndTheCopyEngines) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  TempDir tmp("siesta_cuda_upload");
  const size_t file_bytes = 24 * kMiB + 13;
  std::vector<char> file(file_bytes);
  std::mt19937_64 rng(5);
  for (char& c : file) c = static_cast<char>(rng());
  const fs::path path = tmp.path() / "blob.bin";
  std::ofstream(path, std::ios::binary).write(file.data(), static_cast<std::streamsize>(file.size()));
  ASSERT_EQ(fs::file_size(path), file_bytes);

  const size_t device_bytes = 32 * kMiB;
  char* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, device_bytes), cudaSuccess);
  for (memory::HostToDeviceCopy how : {memory::HostToDeviceCopy::kKernel, memory::HostToDeviceCopy::kCopyEngine}) {
    SCOPED_TRACE(memory::host_to_device_copy_name(how));
    ASSERT_EQ(cudaMemset(device, 0, device_bytes), cudaSuccess);
    std::vector<char> expect(device_bytes, 0);
    auto up = cuda::WeightUpload::create(3, size_t{1} << 20, 2, 0, size_t{1} << 20, how);
    ASSERT_TRUE(up) << up.error().message;
    EXPECT_EQ((*up)->host_to_device(), how);

    std::vector<cuda::WeightUpload::FilePiece> pieces;
    size_t at = 1, to = 3;  // file and device offsets
    auto piece = [&](size_t bytes, size_t file_gap, size_t device_gap) {
      at += file_gap;
      to += device_gap;
      ASSERT_LE(at + bytes, file_bytes);
      ASSERT_LE(to + bytes, device_bytes);
      pieces.push_back({path.string(), at, device + to, bytes});
      std::memcpy(expect.data() + to, file.data() + at, bytes);
      at += bytes;
      to += bytes;
    };
    // 300 small pieces, a few KiB apart in the file: about 150 to a 1 MiB read.
    for (int i = 0; i < 300; ++i) piece(1 + rng() % 5000, rng() % 2000, 1 + rng() % 64);
    // Pieces larger than a read, at offsets that are odd in the file and on the device.
    piece(5 * kMiB + 7, 3, 5);
    piece(2 * kMiB, 1, 16);
    piece(3 * kMiB + 1, 70 << 10, 1);  // past the merge gap: a read of its own
    std::shuffle(pieces.begin(), pieces.end(), rng);
    auto ok = (*up)->copy_files(pieces);
    ASSERT_TRUE(ok) << ok.error().message;

    // Staged copies of ordinary memory, through the ring.
    const size_t staged_at = to + 100;
    ASSERT_TRUE((*up)->copy(device + staged_at, file.data() + 5, 3 * kMiB + 3));
    std::memcpy(expect.data() + staged_at, file.data() + 5, 3 * kMiB + 3);
    ASSERT_TRUE((*up)->copy(device + 7, file.data() + 2, 100));
    std::memcpy(expect.data() + 7, file.data() + 2, 100);

    std::vector<char> back(device_bytes);
    ASSERT_EQ(cudaMemcpy(back.data(), device, device_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    size_t first = device_bytes;
    for (size_t i = 0; i < device_bytes && first == device_bytes; ++i)
      if (back[i] != expect[i]) first = i;
    EXPECT_EQ(first, device_bytes) << "the first device byte that differs";
  }
  cudaFree(device);
}

// A whole engine with each HostToDeviceCopy (chosen through the environment,
// as engine_sleep_bench does): level-1 sleeps (the second restores from the
// kept, pinned buffer) and a level-2 sleep with reload_weights give the
// outputs of before.
TEST(CudaWeightUpdate, SleepWakeAndReloadGiveTheSameOutputsWithEitherHostToDeviceCopy) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  // SIESTA_HOST_TO_DEVICE_COPY as it was, whatever way the test ends.
  struct RestoreEnv {
    const char* before = std::getenv(memory::kHostToDeviceCopyEnv);
    std::string saved = before ? before : "";
    ~RestoreEnv() {
      if (before) {
        ::setenv(memory::kHostToDeviceCopyEnv, saved.c_str(), 1);
      } else {
        ::unsetenv(memory::kHostToDeviceCopyEnv);
      }
    }
  } restore_env;
  for (memory::HostToDeviceCopy how : {memory::HostToDeviceCopy::kKernel, memory::HostToDeviceCopy::kCopyEngine}) {
    SCOPED_TRACE(memory::host_to_device_copy_name(how));
    ::setenv(memory::kHostToDeviceCopyEnv, memory::host_to_device_copy_name(how), 1);
    std::string skip;
    auto e = make_engine_or_skip(cuda_options(), skip);
    if (!e) GTEST_SKIP() << skip;
    const std::string backend = e->memory_report(soon()).backend_description;
    const char* restored_by =
        how == memory::HostToDeviceCopy::kKernel ? "restored by the SMs" : "restored by the copy engines";
    EXPECT_NE(backend.find(restored_by), std::string::npos) << backend;
    const auto ours = run_prompts(*e);
    for (int cycle = 0; cycle < 3; ++cycle) {
      ASSERT_TRUE(e->sleep(1, PauseMode::kKeep, soon()));
      ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
      EXPECT_EQ(run_prompts(*e), ours) << "level 1, cycle " << cycle;
      // Give the backend time to pin the kept buffer (a few MiB) for the next wake.
      std::this_thread::sleep_for(200ms);
    }
    ASSERT_TRUE(e->sleep(2, PauseMode::kKeep, soon()));
    ASSERT_TRUE(e->wake_up({Tag::kWeights}, soon()));
    ASSERT_TRUE(e->reload_weights(std::nullopt, soon()));
    ASSERT_TRUE(e->wake_up(TagSet::all(), soon()));
    EXPECT_EQ(run_prompts(*e), ours) << "level 2";
  }
}

#endif  // SIESTA_HAVE_CUDA

TEST(CudaWeightUpdate, AShmPushGivesAFreshEnginesOutputs) {
  TempDir tmp("siesta_cuda_shm");
  make_other(tmp.path() / "other", 83);
  std::string skip;
  auto e = make_engine_or_skip(cuda_options(), skip);
  if (!e) GTEST_SKIP() << skip;
  std::vector<std::vector<int32_t>> theirs;
  {
    auto fresh = make_engine_or_skip(cuda_options(tmp.path() / "other"), skip);
    ASSERT_TRUE(fresh);
    theirs = run_prompts(*fresh);
  }
  const auto ours = run_prompts(*e);
  ASSERT_NE(ours, theirs);
  // Every tensor of the checkpoint, packed into a memfd in float32.
  auto store = TensorStore::open(tmp.path() / "other");
  ASSERT_TRUE(store);
  const int fd = memfd_create("siesta-cuda-test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  WeightUpdate u;
  u.source = WeightSource::kShm;
  u.fd = fd;
  u.complete = true;
  uint64_t at = 0;
  for (const TensorSpec& spec : updatable_tensors(e->model_config())) {
    auto f = store->get_f32(spec.name, spec.shape);
    ASSERT_TRUE(f);
    ASSERT_EQ(::pwrite(fd, f->data(), f->size() * 4, static_cast<off_t>(at)), static_cast<ssize_t>(f->size() * 4));
    u.tensors.push_back({spec.name, DType::kF32, spec.shape, 0, at});
    at += f->size() * 4 + 4;
  }
  ASSERT_TRUE(e->pause(PauseMode::kKeep, soon()));
  auto r = e->update_weights(u, soon());
  ::close(fd);
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_TRUE(e->resume(soon()));
  EXPECT_EQ(run_prompts(*e), theirs);
}

}  // namespace
}  // namespace siesta
