// Sampler: greedy, temperature, top-k, top-p, min-p, seeds, min_tokens, logprobs.
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

namespace siesta {
namespace {

// Logits whose softmax is exactly `probs`.
std::vector<float> logits_for(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

// Samples token `n` times with seeds 0..n-1 at step 0; returns frequencies.
std::vector<double> frequencies(const std::vector<float>& logits, SamplingParams p, int n = 20000) {
  Sampler sampler({}, RandomGenerator(7));
  std::vector<double> f(logits.size(), 0.0);
  for (int i = 0; i < n; ++i) {
    p.seed = static_cast<uint64_t>(i);
    f[sampler.sample(logits, p, 0).token] += 1.0 / n;
  }
  return f;
}

SamplingParams random_params(double temperature = 1.0) {
  SamplingParams p;
  p.temperature = temperature;
  return p;
}

TEST(Sampler, GreedyTakesTheLargestLogitAndTiesGoToTheLowestId) {
  Sampler sampler({}, RandomGenerator(1));
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(sampler.sample(std::vector<float>{0.1f, 3.0f, -1.0f, 2.0f}, p, 0).token, 1);
  EXPECT_EQ(sampler.sample(std::vector<float>{1.0f, 5.0f, 5.0f, 5.0f}, p, 0).token, 1);
  // A seed changes nothing for greedy requests.
  p.seed = 99;
  EXPECT_EQ(sampler.sample(std::vector<float>{1.0f, 5.0f, 5.0f, 5.0f}, p, 3).token, 1);
}

TEST(Sampler, NanLogitsAreNeverChosen) {
  Sampler sampler({}, RandomGenerator(1));
  const float nan = std::nanf("");
  SamplingParams greedy;
  greedy.temperature = 0;
  EXPECT_EQ(sampler.sample(std::vector<float>{nan, 1.0f, nan, 0.5f}, greedy, 0).token, 1);
  for (uint64_t s = 0; s < 200; ++s) {
    SamplingParams p = random_params();
    p.seed = s;
    const int32_t t = sampler.sample(std::vector<float>{nan, 1.0f, nan, 0.5f}, p, 0).token;
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
}

TEST(Sampler, TemperatureOneFollowsTheSoftmax) {
  const std::vector<double> probs{0.5, 0.3, 0.15, 0.05};
  const auto f = frequencies(logits_for(probs), random_params(1.0));
  for (size_t i = 0; i < probs.size(); ++i) EXPECT_NEAR(f[i], probs[i], 0.015) << i;
}

TEST(Sampler, TemperatureSharpensAndFlattens) {
  const std::vector<double> probs{0.5, 0.3, 0.15, 0.05};
  const auto logits = logits_for(probs);
  for (double t : {0.5, 2.0}) {
    std::vector<double> expect;
    double z = 0;
    for (double p : probs) z += std::pow(p, 1.0 / t);
    for (double p : probs) expect.push_back(std::pow(p, 1.0 / t) / z);
    const auto f = frequencies(logits, random_params(t));
    for (size_t i = 0; i < probs.size(); ++i) EXPECT_NEAR(f[i], expect[i], 0.015) << "T=" << t << " token " << i;
  }
}

TEST(Sampler, TopKKeepsTheKMostLikelyRenormalised) {
  const std::vector<double> probs{0.1, 0.4, 0.2, 0.3};
  SamplingParams p = random_params();
  p.top_k = 2;
  const auto f = frequencies(logits_for(probs), p);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_EQ(f[2], 0.0);
  EXPECT_NEAR(f[1], 0.4 / 0.7, 0.015);
  EXPECT_NEAR(f[3], 0.3 / 0.7, 0.015);
  // -1 and 0 both mean off.
  for (int32_t off : {0, -1}) {
    p.top_k = off;
    const auto g = frequencies(logits_for(probs), p, 5000);
    EXPECT_GT(g[0], 0.05);
  }
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  const std::vector<double> probs{0.05, 0.5, 0.15, 0.3};
  SamplingParams p = random_params();
  p.top_p = 0.45;  // 0.5 alone reaches it
  auto f = frequencies(logits_for(probs), p, 2000);
  EXPECT_NEAR(f[1], 1.0, 1e-9);
  p.top_p = 0.7;  // 0.5 + 0.3
  f = frequencies(logits_for(probs), p);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_EQ(f[2], 0.0);
  EXPECT_NEAR(f[1], 0.5 / 0.8, 0.015);
  EXPECT_NEAR(f[3], 0.3 / 0.8, 0.015);
}

TEST(Sampler, TopPOverALargeVocabularyCutsWhereAFullSortWould) {
  // 3000 slowly decreasing logits: top_p=0.6 keeps hundreds of tokens, more
  // than the first head the sampler sorts.
  std::vector<float> logits(3000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = -0.001f * static_cast<float>(i);
  double total = 0;
  for (float l : logits) total += std::exp(static_cast<double>(l));
  size_t cut = 0;
  double mass = 0;
  while (mass < 0.6 * total) mass += std::exp(static_cast<double>(logits[cut++]));
  ASSERT_GT(cut, 256u);
  SamplingParams p = random_params();
  p.top_p = 0.6;
  Sampler sampler({}, RandomGenerator(1));
  size_t highest = 0;
  for (uint64_t s = 0; s < 4000; ++s) {
    p.seed = s;
    const auto t = static_cast<size_t>(sampler.sample(logits, p, 0).token);
    EXPECT_LT(t, cut);
    highest = std::max(highest, t);
  }
  EXPECT_GT(highest, cut * 95 / 100);
}

TEST(Sampler, TopPAppliesAfterTopK) {
  // top_k=3 leaves {0.4, 0.3, 0.2} (renormalised 4/9, 3/9, 2/9); top_p=0.7
  // then needs 4/9 + 3/9 = 0.78.
  const std::vector<double> probs{0.4, 0.3, 0.2, 0.1};
  SamplingParams p = random_params();
  p.top_k = 3;
  p.top_p = 0.7;
  const auto f = frequencies(logits_for(probs), p);
  EXPECT_EQ(f[2], 0.0);
  EXPECT_EQ(f[3], 0.0);
  EXPECT_NEAR(f[0], 4.0 / 7.0, 0.015);
}

TEST(Sampler, MinPDropsTokensBelowAFractionOfTheMostLikely) {
  const std::vector<double> probs{0.5, 0.3, 0.15, 0.05};
  SamplingParams p = random_params();
  p.min_p = 0.2;  // floor 0.1: drops 0.05
  auto f = frequencies(logits_for(probs), p);
  EXPECT_EQ(f[3], 0.0);
  EXPECT_NEAR(f[2], 0.15 / 0.95, 0.015);
  p.min_p = 0.5;  // floor 0.25
  f = frequencies(logits_for(probs), p);
  EXPECT_EQ(f[2], 0.0);
  EXPECT_NEAR(f[0], 0.5 / 0.8, 0.015);
}

TEST(Sampler, SeededDrawsDependOnlyOnSeedAndStep) {
  const auto logits = logits_for({0.25, 0.25, 0.25, 0.25});
  SamplingParams a = random_params();
  a.seed = 1234;
  SamplingParams other = random_params();
  other.seed = 5;
  // Alone.
  Sampler alone({}, RandomGenerator(1));
  std::vector<int32_t> expect;
  for (uint64_t step = 0; step < 64; ++step) expect.push_back(alone.sample(logits, a, step).token);
  // Interleaved with other seeded and unseeded requests, steps out of order
  // (as after a preemption), on a sampler with another engine seed.
  Sampler busy({}, RandomGenerator(999));
  SamplingParams unseeded = random_params();
  for (uint64_t step = 64; step-- > 0;) {
    busy.sample(logits, other, step * 3);
    busy.sample(logits, unseeded, 0);
    EXPECT_EQ(busy.sample(logits, a, step).token, expect[step]) << step;
  }
  // The stream is not constant: all four tokens appear.
  std::map<int32_t, int> seen;
  for (int32_t t : expect) ++seen[t];
  EXPECT_EQ(seen.size(), 4u);
}

TEST(Sampler, UnseededRequestsFollowTheEngineGenerator) {
  const auto logits = logits_for({0.25, 0.25, 0.25, 0.25});
  SamplingParams p = random_params();
  Sampler s1({}, RandomGenerator(42)), s2({}, RandomGenerator(42)), s3({}, RandomGenerator(43));
  std::vector<int32_t> a, b, c;
  for (int i = 0; i < 64; ++i) {
    a.push_back(s1.sample(logits, p, 0).token);
    b.push_back(s2.sample(logits, p, 0).token);
    c.push_back(s3.sample(logits, p, 0).token);
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(Sampler, FreeFunctionMatchesTheSampler) {
  const auto logits = logits_for({0.1, 0.2, 0.3, 0.4});
  SamplingParams p = random_params(0.8);
  p.seed = 77;
  p.top_k = 3;
  Sampler sampler({}, RandomGenerator(0));
  RandomGenerator rng(0);
  for (uint64_t step = 0; step < 32; ++step)
    EXPECT_EQ(sample(logits, p, step, rng), sampler.sample(logits, p, step).token);
  p.seed.reset();
  RandomGenerator r1(5), r2(5);
  Sampler s2({}, RandomGenerator(5));
  for (int i = 0; i < 32; ++i) EXPECT_EQ(sample(logits, p, 0, r1), s2.sample(logits, p, 0).token);
  (void)r2;
}

TEST(Sampler, MinTokensMasksEosAndStopTokensUntilReached) {
  // Token 3 is eos, token 2 a stop token; both far more likely than the rest.
  const std::vector<float> logits{0.0f, 1.0f, 9.0f, 10.0f};
  Sampler sampler({3}, RandomGenerator(1));
  SamplingParams p;
  p.temperature = 0;
  p.min_tokens = 2;
  p.stop_token_ids = {2};
  EXPECT_EQ(sampler.sample(logits, p, 0).token, 1);
  EXPECT_EQ(sampler.sample(logits, p, 1).token, 1);
  EXPECT_EQ(sampler.sample(logits, p, 2).token, 3);
  // ignore_eos: eos is an ordinary token, so it is not masked.
  p.ignore_eos = true;
  EXPECT_EQ(sampler.sample(logits, p, 0).token, 3);
  // Random sampling never picks a masked token either.
  p.ignore_eos = false;
  p.temperature = 1.0;
  for (uint64_t s = 0; s < 200; ++s) {
    p.seed = s;
    EXPECT_LT(sampler.sample(logits, p, 1).token, 2);
  }
}

TEST(Sampler, LogprobsComeFromTheRawLogits) {
  const std::vector<float> logits{1.0f, 3.0f, 2.0f, 3.0f, -1.0f};
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  auto lp = [&](int i) { return static_cast<double>(logits[i]) - std::log(z); };

  SamplingParams p;
  p.temperature = 0.3;  // does not change logprobs
  p.top_k = 2;
  p.seed = 3;
  p.logprobs = 3;
  Sampler sampler({}, RandomGenerator(1));
  const SampledToken t = sampler.sample(logits, p, 0);
  ASSERT_TRUE(t.logprobs.has_value());
  EXPECT_NEAR(t.logprobs->chosen.logprob, lp(t.token), 1e-12);
  ASSERT_EQ(t.logprobs->top.size(), 3u);
  EXPECT_EQ(t.logprobs->top[0].token, 1);
  EXPECT_EQ(t.logprobs->top[1].token, 3);
  EXPECT_EQ(t.logprobs->top[2].token, 2);
  EXPECT_EQ(t.logprobs->top[0].rank, 1);
  EXPECT_EQ(t.logprobs->top[1].rank, 1);  // tied with token 1
  EXPECT_EQ(t.logprobs->top[2].rank, 3);
  EXPECT_NEAR(t.logprobs->top[2].logprob, lp(2), 1e-12);

  const TokenLogprobs worst = compute_logprobs(logits, 4, 0);
  EXPECT_TRUE(worst.top.empty());
  EXPECT_EQ(worst.chosen.rank, 5);
  EXPECT_NEAR(worst.chosen.logprob, lp(4), 1e-12);

  p.logprobs.reset();
  EXPECT_FALSE(sampler.sample(logits, p, 0).logprobs.has_value());
}

TEST(Sampler, LogprobsStayFiniteForLargeLogits) {
  const std::vector<float> logits{1000.0f, 999.0f, -1000.0f};
  const TokenLogprobs lp = compute_logprobs(logits, 0, 2);
  EXPECT_NEAR(lp.chosen.logprob, -std::log1p(std::exp(-1.0)), 1e-12);
  EXPECT_TRUE(std::isfinite(lp.top[1].logprob));
}

TEST(SamplingParams, DefaultsAreValid) { EXPECT_TRUE(SamplingParams{}.validate()); }

TEST(SamplingParams, OutOfRangeValuesAreRefusedWithTheFieldNamed) {
  struct Case {
    void (*set)(SamplingParams&);
    const char* field;
  };
  const Case cases[] = {
      {[](SamplingParams& p) { p.temperature = -0.5; }, "temperature"},
      {[](SamplingParams& p) { p.temperature = std::nan(""); }, "temperature"},
      {[](SamplingParams& p) { p.top_p = 0.0; }, "top_p"},
      {[](SamplingParams& p) { p.top_p = 1.5; }, "top_p"},
      {[](SamplingParams& p) { p.top_k = -2; }, "top_k"},
      {[](SamplingParams& p) { p.min_p = -0.1; }, "min_p"},
      {[](SamplingParams& p) { p.min_p = 1.1; }, "min_p"},
      {[](SamplingParams& p) { p.max_tokens = 0; }, "max_tokens"},
      {[](SamplingParams& p) { p.min_tokens = -1; }, "min_tokens"},
      {[](SamplingParams& p) { p.min_tokens = 20; }, "min_tokens"},
      {[](SamplingParams& p) { p.logprobs = 21; }, "logprobs"},
      {[](SamplingParams& p) { p.logprobs = -1; }, "logprobs"},
      {[](SamplingParams& p) { p.stop = {"ok", ""}; }, "stop"},
      {[](SamplingParams& p) { p.stop_token_ids = {-3}; }, "stop_token_ids"},
      {[](SamplingParams& p) { p.presence_penalty = 2.5; }, "presence_penalty"},
      {[](SamplingParams& p) { p.frequency_penalty = -3; }, "frequency_penalty"},
      {[](SamplingParams& p) { p.repetition_penalty = 0; }, "repetition_penalty"},
      {[](SamplingParams& p) { p.logit_bias = {{3, 1.0}, {2, 1.0}}; }, "logit_bias"},
      {[](SamplingParams& p) { p.logit_bias = {{3, 101.0}}; }, "logit_bias"},
      {[](SamplingParams& p) { p.allowed_token_ids = {4, 4}; }, "allowed_token_ids"},
      {[](SamplingParams& p) { p.bad_words_token_ids = {{}}; }, "bad_words"},
      {[](SamplingParams& p) { p.prompt_logprobs = 21; }, "prompt_logprobs"},
  };
  for (const Case& c : cases) {
    SamplingParams p;
    c.set(p);
    auto r = p.validate();
    ASSERT_FALSE(r) << c.field;
    EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(r.error().message.find(c.field), std::string::npos) << r.error().message;
  }
  SamplingParams ok;
  ok.top_k = -1;
  ok.max_tokens.reset();
  ok.min_tokens = 100;
  ok.logprobs = 20;
  ok.temperature = 0;
  EXPECT_TRUE(ok.validate());
}

// vLLM's adjustments, each against the formula it defines.
TEST(Sampler, PenaltiesFollowVllmsDefinitions) {
  const std::vector<float> logits{2.0f, -1.0f, 0.5f, 1.0f};
  const std::vector<int32_t> prompt{3};
  const std::vector<int32_t> output{0, 0, 1};
  const TokenHistory h{prompt, output};
  SamplingParams p;
  p.temperature = 0;
  Sampler sampler({}, RandomGenerator(1));
  // No adjustment: token 0 wins.
  EXPECT_EQ(sampler.sample(logits, p, 3, h).token, 0);
  // frequency: 2 - 2 * 0.8 = 0.4 < 1.0 (token 3).
  p.frequency_penalty = 0.8;
  EXPECT_EQ(sampler.sample(logits, p, 3, h).token, 3);
  // presence alone (once per seen token): 2 - 0.9 = 1.1 > 1.0.
  p.frequency_penalty = 0;
  p.presence_penalty = 0.9;
  EXPECT_EQ(sampler.sample(logits, p, 3, h).token, 0);
  p.presence_penalty = 1.1;
  EXPECT_EQ(sampler.sample(logits, p, 3, h).token, 3);
  // repetition covers the prompt too: 2/2.5 = 0.8, 1.0/2.5 = 0.4 (token 3 is in the prompt), 0.5 unseen.
  p.presence_penalty = 0;
  p.repetition_penalty = 2.5;
  EXPECT_EQ(sampler.sample(logits, p, 3, h).token, 0);
  p.repetition_penalty = 5.0;  // 0.4, 0.2, 0.5 unseen -> token 2
  EXPECT_EQ(sampler.sample(logits, p, 3, h).token, 2);
  // A negative logit is multiplied: -1 * 5 = -5, never promoted.
  const std::vector<float> neg{-1.0f, -2.0f};
  const std::vector<int32_t> out0{0};
  EXPECT_EQ(sampler.sample(neg, p, 1, TokenHistory{{}, out0}).token, 1);  // -5 < -2
  // Without a history nothing is penalised (penalties read generated tokens only).
  EXPECT_EQ(sampler.sample(logits, p, 0, TokenHistory{}).token, 0);
}

TEST(Sampler, LogitBiasAllowedAndBadTokens) {
  const std::vector<float> logits{3.0f, 2.0f, 1.0f, 0.0f};
  SamplingParams p;
  p.temperature = 0;
  Sampler sampler({}, RandomGenerator(1));
  p.logit_bias = {{2, 2.5}};
  EXPECT_EQ(sampler.sample(logits, p, 0).token, 2);
  p.logit_bias = {{0, -100.0}};
  EXPECT_EQ(sampler.sample(logits, p, 0).token, 1);
  p.logit_bias.clear();
  p.allowed_token_ids = {1, 3};
  EXPECT_EQ(sampler.sample(logits, p, 0).token, 1);
  for (uint64_t s = 0; s < 100; ++s) {
    SamplingParams r = p;
    r.temperature = 1;
    r.seed = s;
    const int32_t t = sampler.sample(logits, r, 0).token;
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
  p.allowed_token_ids.clear();
  // A one-token bad word is always banned; a longer one only after its prefix.
  p.bad_words_token_ids = {{0}, {2, 1}};
  EXPECT_EQ(sampler.sample(logits, p, 0).token, 1);
  const std::vector<int32_t> after2{2};
  EXPECT_EQ(sampler.sample(logits, p, 1, TokenHistory{{}, after2}).token, 2);  // 1 banned after 2
  // Logprobs stay those of the raw logits.
  p.logprobs = 0;
  const SampledToken t = sampler.sample(logits, p, 0);
  EXPECT_NEAR(t.logprobs->chosen.logprob, compute_logprobs(logits, 1, 0).chosen.logprob, 1e-12);
}

TEST(Sampler, ForcedTokensComeFirstOrAfterTheirTrigger) {
  const std::vector<float> logits{5.0f, 0.0f, 0.0f, 0.0f};
  SamplingParams p;
  p.temperature = 0.7;
  p.seed = 1;
  p.forced_tokens = {2, 3};
  Sampler sampler({}, RandomGenerator(1));
  EXPECT_EQ(sampler.sample(logits, p, 0).token, 2);
  const std::vector<int32_t> one{2};
  EXPECT_EQ(sampler.sample(logits, p, 1, TokenHistory{{}, one}).token, 3);
  p.temperature = 0;
  const std::vector<int32_t> two{2, 3};
  EXPECT_EQ(sampler.sample(logits, p, 2, TokenHistory{{}, two}).token, 0);  // then free again
  p.force_after_token = 1;
  EXPECT_EQ(sampler.sample(logits, p, 0).token, 0);  // the trigger has not come
  const std::vector<int32_t> trig{0, 1};
  EXPECT_EQ(sampler.sample(logits, p, 2, TokenHistory{{}, trig}).token, 2);
  std::vector<int32_t> banned;
  EXPECT_FALSE(sampler.device_choice(p, 2, 0.0, banned, TokenHistory{{}, trig}));
  EXPECT_TRUE(sampler.device_choice(p, 0, 0.0, banned, TokenHistory{}));
}

TEST(Sampler, AdjustedRowsAreLeftToTheHost) {
  Sampler sampler({}, RandomGenerator(1));
  std::vector<int32_t> banned;
  SamplingParams p;
  EXPECT_TRUE(sampler.device_choice(p, 0, 0.5, banned));
  for (auto set :
       {+[](SamplingParams& q) { q.presence_penalty = 0.1; }, +[](SamplingParams& q) { q.frequency_penalty = 0.1; },
        +[](SamplingParams& q) { q.repetition_penalty = 1.1; },
        +[](SamplingParams& q) {
          q.logit_bias = {{1, 1.0}};
        },
        +[](SamplingParams& q) { q.allowed_token_ids = {1}; },
        +[](SamplingParams& q) { q.bad_words_token_ids = {{1}}; }}) {
    SamplingParams q;
    set(q);
    EXPECT_FALSE(sampler.device_choice(q, 0, 0.5, banned));
  }
}

}  // namespace
}  // namespace siesta
