// NCCL loaded at run time (src/comm/nccl_library.h): against the library the
// CUDA toolkit installs (CI machines have it; no GPU is needed for what is
// checked here), and against a name that is not installed.
#include <gtest/gtest.h>

#ifdef SIESTA_HAVE_CUDA

#include <cstdlib>
#include <cstring>
#include <string>

#include "comm/nccl_library.h"

namespace siesta::comm {
namespace {

TEST(NcclLibrary, LoadsTheToolkitsLibraryAndReportsItsVersion) {
  auto nccl = NcclLibrary::load();
  if (!nccl) GTEST_SKIP() << "NCCL is not installed here: " << nccl.error().message;
  const NcclLibrary& n = **nccl;
  EXPECT_EQ(n.version / 10000, NCCL_MAJOR);
  EXPECT_GE(n.version, NCCL_VERSION(2, 18, 0));
  // The text is the version's three parts, as the header spells its own.
  EXPECT_EQ(n.version_text(), std::to_string(n.version / 10000) + "." + std::to_string(n.version / 100 % 100) + "." +
                                  std::to_string(n.version % 100));
  int direct = 0;
  ASSERT_TRUE(n.check(n.ncclGetVersion(&direct), "ncclGetVersion"));
  EXPECT_EQ(direct, n.version);
  // A unique id (a communicator's bootstrap address) needs no GPU; two differ.
  ncclUniqueId a{}, b{};
  ASSERT_TRUE(n.check(n.ncclGetUniqueId(&a), "ncclGetUniqueId"));
  ASSERT_TRUE(n.check(n.ncclGetUniqueId(&b), "ncclGetUniqueId"));
  EXPECT_NE(std::memcmp(a.internal, b.internal, sizeof a.internal), 0);
}

TEST(NcclLibrary, ErrorsNameTheCallAndNcclsText) {
  auto nccl = NcclLibrary::load();
  if (!nccl) GTEST_SKIP() << "NCCL is not installed here: " << nccl.error().message;
  const NcclLibrary& n = **nccl;
  EXPECT_TRUE(n.check(ncclSuccess, "nothing"));
  Ok bad = n.check(ncclInvalidArgument, "ncclAllReduce of the O projection");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("ncclAllReduce of the O projection"), std::string::npos) << bad.error().message;
  EXPECT_NE(bad.error().message.find(n.ncclGetErrorString(ncclInvalidArgument)), std::string::npos)
      << bad.error().message;
  // A call NCCL refuses: a communicator of 0 ranks.
  ncclComm_t comm = nullptr;
  ncclUniqueId id{};
  ASSERT_TRUE(n.check(n.ncclGetUniqueId(&id), "ncclGetUniqueId"));
  Ok refused = n.check(n.ncclCommInitRank(&comm, 0, id, 0), "ncclCommInitRank");
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("ncclCommInitRank"), std::string::npos) << refused.error().message;
}

TEST(NcclLibrary, AMissingLibraryIsAClearError) {
  auto nccl = NcclLibrary::load("libnccl-not-installed.so.2");
  ASSERT_FALSE(nccl);
  EXPECT_EQ(nccl.error().code, ErrorCode::kUnavailable);
  EXPECT_NE(nccl.error().message.find("libnccl-not-installed.so.2"), std::string::npos) << nccl.error().message;
  EXPECT_NE(nccl.error().message.find("tensor parallelism"), std::string::npos) << nccl.error().message;
}

TEST(NcclLibrary, NvlsIsTurnedOffWhateverTheEnvironmentSaid) {
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  EXPECT_EQ(disable_nvls(), "1");
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  EXPECT_EQ(disable_nvls(), "0");
  unsetenv("NCCL_NVLS_ENABLE");
  EXPECT_EQ(disable_nvls(), "");
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
}

}  // namespace
}  // namespace siesta::comm

#else

TEST(NcclLibrary, NeedsABuildWithTheCudaToolkit) { GTEST_SKIP() << "built without the CUDA toolkit"; }

#endif
