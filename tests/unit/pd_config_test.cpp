// --kv-transfer-config: what `siesta serve` accepts (vLLM's shape, defaults)
// and how it refuses the rest (one line naming the key or the combination).
#include <gtest/gtest.h>

#include <string>

#include "pd/pd_config.h"

namespace siesta::pd {
namespace {

using std::chrono::milliseconds;

// The refusal's message for `json`, or a note that it was accepted.
std::string refusal(const std::string& json) {
  auto c = parse_kv_transfer_config(json);
  if (c) return "(accepted)";
  EXPECT_EQ(c.error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(c.error().message.find('\n'), std::string::npos) << c.error().message;
  EXPECT_EQ(c.error().message.rfind("--kv-transfer-config: ", 0), 0u) << c.error().message;
  return c.error().message;
}

void expect_refused(const std::string& json, const std::string& needle) {
  const std::string m = refusal(json);
  EXPECT_NE(m.find(needle), std::string::npos) << json << " -> " << m;
}

TEST(PdConfig, TheSmallestConfigGetsTheDefaults) {
  auto c = parse_kv_transfer_config(R"({"kv_connector": "SiestaConnector", "kv_role": "kv_producer"})");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->role, KvRole::kProducer);
  EXPECT_TRUE(c->produces());
  EXPECT_FALSE(c->consumes());
  EXPECT_EQ(c->transfer.backend, transfer::BackendKind::kUcx);
  EXPECT_EQ(c->mode, TransferMode::kWrite);
  EXPECT_EQ(c->transfer.side_channel.host, "127.0.0.1");
  EXPECT_EQ(c->transfer.side_channel.port, 0);  // a free port
  EXPECT_TRUE(c->transfer.engine_id.empty());   // a random one
  EXPECT_TRUE(c->transfer.ucx_guarded);
  EXPECT_GT(c->load_timeout, milliseconds(0));
  EXPECT_LE(c->transfer_timeout, c->load_timeout);
  EXPECT_LE(c->message_timeout, c->load_timeout);
}

TEST(PdConfig, EveryKeyIsRead) {
  auto c = parse_kv_transfer_config(R"({
    "kv_connector": "SiestaConnector", "kv_role": "kv_consumer", "engine_id": "decode-0",
    "kv_connector_extra_config": {
      "backend": "ucx", "mode": "read", "side_channel_host": "10.0.0.7", "side_channel_port": 5600,
      "load_timeout_s": 12.5, "hold_timeout_s": 60, "transfer_timeout_s": 2, "message_timeout_s": 0.25,
      "write_grace_s": 1, "worker_threads": 3,
      "ucx_transports": "tcp", "ucx_net_devices": "lo", "ucx_peer_error_handling": false,
      "ucx_guarded": false}})");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->role, KvRole::kConsumer);
  EXPECT_FALSE(c->produces());
  EXPECT_TRUE(c->consumes());
  EXPECT_EQ(c->transfer.engine_id, "decode-0");
  EXPECT_EQ(c->mode, TransferMode::kRead);
  EXPECT_EQ(c->transfer.side_channel.host, "10.0.0.7");
  EXPECT_EQ(c->transfer.side_channel.port, 5600);
  EXPECT_EQ(c->load_timeout, milliseconds(12500));
  EXPECT_EQ(c->hold_timeout, milliseconds(60000));
  EXPECT_EQ(c->transfer_timeout, milliseconds(2000));
  EXPECT_EQ(c->message_timeout, milliseconds(250));
  EXPECT_EQ(c->write_grace, milliseconds(1000));
  EXPECT_EQ(c->worker_threads, 3);
  EXPECT_EQ(c->transfer.ucx_transports, "tcp");
  EXPECT_EQ(c->transfer.ucx_net_devices, "lo");
  EXPECT_FALSE(c->transfer.ucx_peer_error_handling);
  EXPECT_FALSE(c->transfer.ucx_guarded);
}

TEST(PdConfig, KvBothProducesAndConsumesAndIpcIsAccepted) {
  auto c = parse_kv_transfer_config(
      R"({"kv_connector": "SiestaConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"backend": "ipc"}})");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_TRUE(c->produces());
  EXPECT_TRUE(c->consumes());
  EXPECT_EQ(c->transfer.backend, transfer::BackendKind::kIpc);
  EXPECT_EQ(c->transfer.ipc_copy, transfer::IpcCopy::kAuto);
  auto k = parse_kv_transfer_config(R"({"kv_connector": "SiestaConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"backend": "ipc", "ipc_copy": "kernel"}})");
  ASSERT_TRUE(k) << k.error().message;
  EXPECT_EQ(k->transfer.ipc_copy, transfer::IpcCopy::kKernel);
}

TEST(PdConfig, UnknownKeysAreRefusedByName) {
  expect_refused(R"({"kv_connector": "SiestaConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda"})",
                 "unknown key 'kv_buffer_device'");
  expect_refused(R"({"kv_connector": "SiestaConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"backend": "ipc", "timeout": 3}})",
                 "unknown key 'timeout' in kv_connector_extra_config");
}

TEST(PdConfig, WrongValuesAreRefusedByName) {
  expect_refused("not json", "not valid JSON");
  expect_refused("[1, 2]", "must be a JSON object");
  expect_refused(R"({"kv_role": "kv_both"})", "kv_connector is required");
  expect_refused(R"({"kv_connector": "NixlConnector", "kv_role": "kv_both"})", "'NixlConnector' is not known");
  expect_refused(R"({"kv_connector": "SiestaConnector"})", "kv_role is required");
  expect_refused(R"({"kv_connector": "SiestaConnector", "kv_role": "prefill"})", "kv_role 'prefill'");
  expect_refused(R"({"kv_connector": "SiestaConnector", "kv_role": 3})", "kv_role must be a string");
  expect_refused(R"({"kv_connector": "SiestaConnector", "kv_role": "kv_both", "engine_id": ""})", "engine_id");
  const std::string head = R"({"kv_connector": "SiestaConnector", "kv_role": "kv_both", "kv_connector_extra_config": )";
  expect_refused(head + "[]}", "kv_connector_extra_config must be an object");
  expect_refused(head + R"({"backend": "nixl"}})", "backend 'nixl'");
  expect_refused(head + R"({"mode": "push"}})", "mode 'push'");
  expect_refused(head + R"({"side_channel_port": 70000}})", "side_channel_port");
  expect_refused(head + R"({"side_channel_port": "5600"}})", "side_channel_port");
  expect_refused(head + R"({"side_channel_host": ""}})", "side_channel_host");
  expect_refused(head + R"({"load_timeout_s": 0}})", "load_timeout_s must be in (0, 86400]");
  expect_refused(head + R"({"hold_timeout_s": -1}})", "hold_timeout_s");
  expect_refused(head + R"({"message_timeout_s": "5"}})", "message_timeout_s must be a number");
  expect_refused(head + R"({"worker_threads": 0}})", "worker_threads");
  expect_refused(head + R"({"backend": "ucx", "ucx_peer_error_handling": "yes"}})", "ucx_peer_error_handling");
  expect_refused(head + R"({"backend": "ucx", "ucx_guarded": 1}})", "ucx_guarded must be a boolean");
}

TEST(PdConfig, ImpossibleCombinationsAreRefusedNamingBothSides) {
  const std::string head = R"({"kv_connector": "SiestaConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": )";
  expect_refused(head + R"({"backend": "ipc", "ucx_transports": "tcp"}})",
                 "ucx_transports applies to the ucx backend, and backend is 'ipc'");
  expect_refused(head + R"({"backend": "ipc", "ucx_guarded": false}})",
                 "ucx_guarded applies to the ucx backend, and backend is 'ipc'");
  expect_refused(head + R"({"backend": "ucx", "ipc_copy": "kernel"}})",
                 "ipc_copy applies to the ipc backend, and backend is 'ucx'");
  expect_refused(head + R"({"backend": "ipc", "ipc_copy": "dma"}})",
                 "ipc_copy 'dma' is not one of auto, kernel, copy_engine");
  const std::string m = refusal(head + R"({"load_timeout_s": 5, "transfer_timeout_s": 10}})");
  EXPECT_NE(m.find("transfer_timeout_s (10)"), std::string::npos) << m;
  EXPECT_NE(m.find("load_timeout_s (5)"), std::string::npos) << m;
  expect_refused(head + R"({"load_timeout_s": 1, "transfer_timeout_s": 1, "message_timeout_s": 2}})",
                 "message_timeout_s (2) is longer than load_timeout_s (1)");
  // A producer never waits for loads: its load deadline does not bound the others.
  EXPECT_EQ(refusal(R"({"kv_connector": "SiestaConnector", "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"load_timeout_s": 1, "transfer_timeout_s": 5}})"),
            "(accepted)");
}

}  // namespace
}  // namespace siesta::pd
