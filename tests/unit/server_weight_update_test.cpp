// The body of POST /update_weights: every source's form, PyTorch's shared
// handle and the plain cudaIpcMemHandle_t, and the fields refused by name.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "server/weight_update_request.h"

namespace siesta::server {
namespace {

using nlohmann::json;

std::string base64(const std::string& raw) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < raw.size(); i += 3) {
    const uint32_t v = (uint8_t(raw[i]) << 16) | (uint8_t(raw[i + 1]) << 8) | uint8_t(raw[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += k[(v >> s) & 63];
  }
  if (i + 1 == raw.size()) {
    const uint32_t v = uint8_t(raw[i]) << 16;
    out += k[(v >> 18) & 63];
    out += k[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == raw.size()) {
    const uint32_t v = (uint8_t(raw[i]) << 16) | (uint8_t(raw[i + 1]) << 8);
    out += k[(v >> 18) & 63];
    out += k[(v >> 12) & 63];
    out += k[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

std::string handle_bytes() {
  std::string h(64, '\0');
  for (int i = 0; i < 64; ++i) h[i] = static_cast<char>(i * 7 + 1);
  return h;
}

std::string error_of(const json& body) {
  auto r = parse_weight_update(body);
  EXPECT_FALSE(r) << body.dump();
  return r ? std::string() : r.error().message;
}

TEST(ServerWeightUpdate, Base64RoundTripsEveryLength) {
  for (size_t n = 0; n < 70; ++n) {
    std::string raw;
    for (size_t i = 0; i < n; ++i) raw += static_cast<char>(i * 37 + 11);
    auto d = decode_base64(base64(raw));
    ASSERT_TRUE(d) << n;
    EXPECT_EQ(*d, raw) << n;
    std::string unpadded = base64(raw);
    while (!unpadded.empty() && unpadded.back() == '=') unpadded.pop_back();
    EXPECT_EQ(decode_base64(unpadded).value(), raw) << n;
  }
  EXPECT_FALSE(decode_base64("ab$d"));
  EXPECT_FALSE(decode_base64("abcde"));
  EXPECT_FALSE(decode_base64("ab==="));
}

TEST(ServerWeightUpdate, ShmBody) {
  const json body = json::parse(R"({"source": "shm", "path": "/dev/shm/w", "complete": true,
      "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [1024], "offset": 4096},
                  {"name": "lm_head.weight", "dtype": "bfloat16", "shape": [151936, 1024], "offset": 0}]})");
  auto u = parse_weight_update(body);
  ASSERT_TRUE(u) << u.error().message;
  EXPECT_EQ(u->source, WeightSource::kShm);
  EXPECT_EQ(u->path, "/dev/shm/w");
  EXPECT_TRUE(u->complete);
  ASSERT_EQ(u->tensors.size(), 2u);
  EXPECT_EQ(u->tensors[0].name, "model.norm.weight");
  EXPECT_EQ(u->tensors[0].dtype, DType::kF32);
  EXPECT_EQ(u->tensors[0].shape, (std::vector<int64_t>{1024}));
  EXPECT_EQ(u->tensors[0].offset, 4096u);
  EXPECT_EQ(u->tensors[1].dtype, DType::kBF16);
}

TEST(ServerWeightUpdate, CudaIpcBodyTakesPlainAndPyTorchHandles) {
  const std::string h = handle_bytes();
  json body = {{"source", "cuda_ipc"},
               {"buffers",
                {{{"handle", base64(h)}, {"bytes", 1 << 20}},
                 {{"handle", base64(std::string("\x01"
                                                "c",
                                                2) +
                                    h)},
                  {"bytes", 4096},
                  {"offset", 512}}}},
               {"tensors", {{{"name", "a"}, {"dtype", "float16"}, {"shape", {2, 3}}, {"buffer", 1}, {"offset", 8}}}}};
  auto u = parse_weight_update(body);
  ASSERT_TRUE(u) << u.error().message;
  EXPECT_EQ(u->source, WeightSource::kCudaIpc);
  ASSERT_EQ(u->buffers.size(), 2u);
  for (const CudaIpcBuffer& b : u->buffers)
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(b.handle.data()), 64), h);
  EXPECT_EQ(u->buffers[0].bytes, 1u << 20);
  EXPECT_EQ(u->buffers[0].offset, 0u);
  EXPECT_EQ(u->buffers[1].offset, 512u);
  EXPECT_FALSE(u->complete);
  EXPECT_EQ(u->tensors[0].buffer, 1u);
  EXPECT_EQ(u->tensors[0].dtype, DType::kF16);

  body["buffers"][1]["handle"] = base64(std::string("\x01"
                                                    "e",
                                                    2) +
                                        h);
  EXPECT_NE(error_of(body).find("expandable"), std::string::npos);
  body["buffers"][1]["handle"] = base64(h.substr(0, 60));
  EXPECT_NE(error_of(body).find("60 bytes"), std::string::npos);
  body["buffers"][1]["handle"] = "not base64!";
  EXPECT_NE(error_of(body).find("buffers[1].handle"), std::string::npos);
}

TEST(ServerWeightUpdate, DirBodyInEachForm) {
  for (const char* key : {"path", "model", "weights_path"}) {
    json body = {{key, "/models/x"}};
    if (std::string(key) == "path") body["source"] = "dir";
    auto u = parse_weight_update(body);
    ASSERT_TRUE(u) << key << ": " << u.error().message;
    EXPECT_EQ(u->source, WeightSource::kDir);
    EXPECT_EQ(u->path, "/models/x");
    EXPECT_TRUE(u->complete);
  }
  auto own = parse_weight_update(json{{"source", "dir"}});
  ASSERT_TRUE(own);
  EXPECT_TRUE(own->path.empty());  // the checkpoint the weights hold
  EXPECT_NE(error_of(json{{"source", "dir"}, {"path", "/a"}, {"model", "/b"}}).find("once"), std::string::npos);
}

TEST(ServerWeightUpdate, UnknownMissingAndMistypedFieldsAreRefusedByName) {
  const json tensor = {{"name", "model.norm.weight"}, {"dtype", "bfloat16"}, {"shape", {1024}}, {"offset", 0}};
  auto shm = [&](json extra) {
    json b = {{"source", "shm"}, {"path", "/dev/shm/w"}, {"tensors", {tensor}}};
    b.update(extra);
    return b;
  };
  EXPECT_NE(error_of(shm({{"wait", true}})).find("unknown field 'wait'"), std::string::npos);
  json t = tensor;
  t["stride"] = {1};
  EXPECT_NE(error_of(shm({{"tensors", {t}}})).find("tensors[0]: unknown field 'stride'"), std::string::npos);
  t = tensor;
  t["buffer"] = 0;  // no buffers in shared memory
  EXPECT_NE(error_of(shm({{"tensors", {t}}})).find("unknown field 'buffer'"), std::string::npos);
  t = tensor;
  t["dtype"] = "int8";
  EXPECT_NE(error_of(shm({{"tensors", {t}}})).find("int8"), std::string::npos);
  t = tensor;
  t["shape"] = {1024, -1};
  EXPECT_NE(error_of(shm({{"tensors", {t}}})).find("tensors[0].shape[1]"), std::string::npos);
  t = tensor;
  t.erase("offset");
  EXPECT_NE(error_of(shm({{"tensors", {t}}})).find("tensors[0].offset"), std::string::npos);
  // HTTP passes no descriptors: "fd" is refused, pointing at the weight socket and at the /proc path.
  const std::string over_http = error_of(shm({{"fd", 0}}));
  EXPECT_NE(over_http.find("--weight-socket"), std::string::npos) << over_http;
  EXPECT_NE(over_http.find("/proc/<pid>/fd/<n>"), std::string::npos) << over_http;
  EXPECT_NE(error_of(shm({{"tensors", json::array()}})).find("'tensors' is required"), std::string::npos);
  EXPECT_NE(error_of(shm({{"complete", "yes"}})).find("complete"), std::string::npos);
  EXPECT_NE(error_of(json{{"source", "nfs"}}).find("nfs"), std::string::npos);
  EXPECT_NE(error_of(json{{"tensors", {tensor}}}).find("'source' is required"), std::string::npos);
  EXPECT_NE(error_of(json::array()).find("JSON object"), std::string::npos);
  EXPECT_NE(error_of(json{{"source", "cuda_ipc"}, {"tensors", {tensor}}}).find("'buffers' is required"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"source", "dir"}, {"tensors", {tensor}}}).find("unknown field 'tensors'"),
            std::string::npos);
}

// The weight socket's bodies: "fd" indexes the packet's descriptors, and a
// packet carries exactly the ones its body names.
TEST(ServerWeightUpdate, FdIndexesThePassedDescriptors) {
  const json tensor = {{"name", "model.norm.weight"}, {"dtype", "bfloat16"}, {"shape", {1024}}, {"offset", 0}};
  const json body = {{"source", "shm"}, {"fd", 0}, {"tensors", {tensor}}, {"complete", false}};
  const int one[] = {42};
  auto u = parse_weight_update(body, PassedDescriptors{true, one});
  ASSERT_TRUE(u) << u.error().message;
  EXPECT_EQ(u->source, WeightSource::kShm);
  EXPECT_EQ(u->fd, 42);
  EXPECT_EQ(u->path, "fd 0 of the weight socket");  // what messages and the report call it
  ASSERT_EQ(u->tensors.size(), 1u);

  auto refused = [&](const json& b, std::span<const int> fds) {
    auto r = parse_weight_update(b, PassedDescriptors{true, fds});
    EXPECT_FALSE(r) << b.dump();
    return r ? std::string() : r.error().message;
  };
  // Missing: the body names a descriptor the packet did not carry.
  EXPECT_NE(refused(body, {}).find("carried no descriptor"), std::string::npos);
  // Extra: two sent, one named; or one sent and none named (a path, a directory, CUDA IPC).
  const int two[] = {42, 43};
  EXPECT_NE(refused(body, two).find("carried 2 descriptors, but the body names one"), std::string::npos);
  json by_path = body;
  by_path.erase("fd");
  by_path["path"] = "/dev/shm/w";
  EXPECT_NE(refused(by_path, one).find("carried 1 descriptor, but the body names none"), std::string::npos);
  EXPECT_NE(refused(json{{"source", "dir"}}, one).find("the body names none"), std::string::npos);
  // A bad index, a wrong type, and both ways of naming the memory.
  json bad = body;
  bad["fd"] = 1;
  EXPECT_NE(refused(bad, one).find("'fd' is 1, but the packet carried 1 descriptor"), std::string::npos);
  bad["fd"] = -1;
  EXPECT_NE(refused(bad, one).find("'fd' must be an integer >= 0"), std::string::npos);
  bad["fd"] = "0";
  EXPECT_NE(refused(bad, one).find("'fd' must be an integer >= 0"), std::string::npos);
  bad = body;
  bad["path"] = "/dev/shm/w";
  EXPECT_NE(refused(bad, one).find("'path' or 'fd', not both"), std::string::npos);
  // The rest of the body is checked as over HTTP.
  bad = body;
  bad["wait"] = true;
  EXPECT_NE(refused(bad, one).find("unknown field 'wait'"), std::string::npos);
  bad = body;
  bad.erase("fd");
  EXPECT_NE(refused(bad, {}).find("or 'fd'"), std::string::npos);
  // Without descriptors a body by path parses over the socket as over HTTP.
  auto p = parse_weight_update(by_path, PassedDescriptors{true, {}});
  ASSERT_TRUE(p) << p.error().message;
  EXPECT_EQ(p->fd, -1);
  EXPECT_EQ(p->path, "/dev/shm/w");
}

}  // namespace
}  // namespace siesta::server
