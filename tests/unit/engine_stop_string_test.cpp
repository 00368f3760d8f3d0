// StopStringChecker: stop strings found in streamed text, held-back text, and
// the final output.
#include "engine/stop_string_checker.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace siesta {
namespace {

struct Streamed {
  std::vector<std::string> sent;  // what each push returned
  std::string all;
  bool stopped = false;
};

Streamed stream(StopStringChecker& c, const std::vector<std::string>& pieces) {
  Streamed s;
  for (const std::string& p : pieces) {
    StopCheck r = c.push(p);
    s.sent.push_back(r.text);
    s.all += r.text;
    if (r.stopped) {
      s.stopped = true;
      return s;
    }
  }
  s.all += c.finish();
  return s;
}

TEST(StopStringChecker, StopInsideOnePieceCutsTheOutputBeforeIt) {
  StopStringChecker c({"STOP"});
  Streamed s = stream(c, {"Hello ", "wor STOP ld", "never"});
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.all, "Hello wor ");
  EXPECT_EQ(c.stop_string(), "STOP");
  EXPECT_EQ(c.sent_text(), "Hello wor ");
}

TEST(StopStringChecker, StopSplitAcrossPiecesIsHeldBackThenDropped) {
  StopStringChecker c({"</end>"});
  Streamed s = stream(c, {"ab", "c</", "en", "d>xyz"});
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.sent, (std::vector<std::string>{"ab", "c", "", ""}));
  EXPECT_EQ(s.all, "abc");
}

TEST(StopStringChecker, HeldTextIsReleasedWhenItStopsLookingLikeAStop) {
  StopStringChecker c({"</end>"});
  Streamed s = stream(c, {"x<", "/", "e", "nx", "y"});
  EXPECT_FALSE(s.stopped);
  EXPECT_EQ(s.sent, (std::vector<std::string>{"x", "", "", "</enx", "y"}));
  EXPECT_EQ(s.all, "x</enxy");
}

TEST(StopStringChecker, HoldsOnlyTheLongestSuffixThatCanStillMatch) {
  StopStringChecker c({"aab"});
  Streamed s = stream(c, {"a", "a", "a", "b"});
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.sent, (std::vector<std::string>{"", "", "a", ""}));
  EXPECT_EQ(s.all, "a");
}

TEST(StopStringChecker, EndOfStreamReleasesHeldText) {
  StopStringChecker c({"###"});
  Streamed s = stream(c, {"total: 5 #", "#"});
  EXPECT_FALSE(s.stopped);
  EXPECT_EQ(s.sent.back(), "");
  EXPECT_EQ(s.all, "total: 5 ##");
}

TEST(StopStringChecker, IncludeStopStringInOutput) {
  StopStringChecker c({"\n\n"}, /*include_stop_in_output=*/true);
  Streamed s = stream(c, {"line\n", "\nnext"});
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.all, "line\n\n");
}

TEST(StopStringChecker, EarliestMatchWinsAcrossStopStrings) {
  StopStringChecker c({"world", "lo w", "o"});
  StopCheck r = c.push("hello world");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "hel");  // "lo w" starts first
  EXPECT_EQ(r.stop_index, 1);
  // Later pushes give nothing.
  StopCheck after = c.push("more");
  EXPECT_TRUE(after.stopped);
  EXPECT_EQ(after.text, "");
  EXPECT_EQ(c.finish(), "");
}

TEST(StopStringChecker, SameStartPrefersTheFirstListed) {
  StopStringChecker c({"ab", "abc"});
  StopCheck r = c.push("xabc");
  EXPECT_EQ(r.stop_index, 0);
  EXPECT_EQ(r.text, "x");
}

TEST(StopStringChecker, TextBeforeMinTokensIsSentWholeAndNeverMatched) {
  StopStringChecker c({"ab"});
  StopCheck r = c.push("xab", /*may_stop=*/false);
  EXPECT_FALSE(r.stopped);
  EXPECT_EQ(r.text, "xab");
  r = c.push("za");
  EXPECT_EQ(r.text, "z");
  r = c.push("b");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(c.sent_text(), "xabz");
}

TEST(StopStringChecker, MultiByteCharactersAreNeverSplit) {
  // "é" is two bytes; the stop string starts with it.
  StopStringChecker c({"\xC3\xA9t\xC3\xA9"});
  Streamed s = stream(c, {"caf\xC3\xA9", " \xC3\xA9t", "\xC3\xA9!"});
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.sent, (std::vector<std::string>{"caf", "\xC3\xA9 ", ""}));
}

TEST(StopStringChecker, NoStopStringsPassesEverythingThrough) {
  StopStringChecker c({});
  Streamed s = stream(c, {"a", "b"});
  EXPECT_EQ(s.sent, (std::vector<std::string>{"a", "b"}));
}

}  // namespace
}  // namespace siesta
