#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace siesta {
namespace {

using Candidate = Sampler::Candidate;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// NaN counts as -inf; +inf is clamped so that differences stay finite.
double clean(float logit) {
  if (std::isnan(logit)) return kNegInf;
  if (logit == std::numeric_limits<float>::infinity()) return std::numeric_limits<float>::max();
  return logit;
}

// Larger score first; equal scores: lower token id first.
bool better(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.token < b.token);
}

// Sets the scores of the tokens that may not end the request yet to -inf,
// unless that would leave nothing to sample.
void mask_stop_tokens(std::vector<Candidate>& work, const SamplingParams& p, std::span<const int32_t> eos) {
  std::vector<int32_t> masked(p.stop_token_ids.begin(), p.stop_token_ids.end());
  if (!p.ignore_eos) masked.insert(masked.end(), eos.begin(), eos.end());
  const auto vocab = static_cast<int32_t>(work.size());
  size_t finite_left = 0;
  for (const Candidate& c : work) finite_left += c.score > kNegInf;
  for (int32_t id : masked) {
    if (id < 0 || id >= vocab || work[id].score == kNegInf) continue;
    if (finite_left == 1) return;  // keep the last samplable token
    work[id].score = kNegInf;
    --finite_left;
  }
}

int32_t argmax(const std::vector<Candidate>& work) {
  int32_t best = 0;
  for (size_t i = 1; i < work.size(); ++i)
    if (work[i].score > work[best].score) best = static_cast<int32_t>(i);
  return best;
}

// The draw of a random step, taken before any early return so that an
// unseeded request always consumes exactly one value of the engine stream per
// random step; greedy requests draw nothing.
double draw_for(const SamplingParams& p, uint64_t step, RandomGenerator& unseeded) {
  if (p.greedy()) return 0.0;
  return to_unit_interval(p.seed ? request_draw(*p.seed, step) : unseeded.next());
}

bool masks_stop_tokens(const SamplingParams& p, uint64_t step) {
  return step < static_cast<uint64_t>(std::max(p.min_tokens, 0));
}

// allowed_token_ids, bad_words, min_tokens, logit_bias, penalties: vLLM's
// order. work[i].token == i throughout.
void adjust_logits(std::vector<Candidate>& work, const SamplingParams& p, uint64_t step, std::span<const int32_t> eos,
                   const TokenHistory& h, Sampler::Scratch& scratch) {
  const auto vocab = static_cast<int32_t>(work.size());
  auto in_vocab = [vocab](int32_t id) { return id >= 0 && id < vocab; };
  if (!p.allowed_token_ids.empty()) {
    // Everything else to -inf: mark the allowed ones, then sweep.
    scratch.seen.resize(work.size(), 0);
    for (int32_t id : p.allowed_token_ids)
      if (in_vocab(id)) scratch.seen[id] = 1;
    for (size_t i = 0; i < work.size(); ++i) {
      if (!scratch.seen[i]) work[i].score = kNegInf;
      scratch.seen[i] = 0;
    }
  }
  for (const std::vector<int32_t>& word : p.bad_words_token_ids) {
    if (word.empty() || word.size() > h.output.size() + 1) continue;
    const size_t prefix = word.size() - 1;
    if (std::equal(word.begin(), word.begin() + static_cast<std::ptrdiff_t>(prefix),
                   h.output.end() - static_cast<std::ptrdiff_t>(prefix)) &&
        in_vocab(word.back()))
      work[word.back()].score = kNegInf;
  }
  if (masks_stop_tokens(p, step)) mask_stop_tokens(work, p, eos);
  for (const auto& [id, bias] : p.logit_bias)
    if (in_vocab(id)) work[id].score += bias;

  if (p.repetition_penalty != 1.0) {
    scratch.seen.resize(work.size(), 0);
    const double inv = 1.0 / p.repetition_penalty;
    auto penalise = [&](std::span<const int32_t> ids) {
      for (int32_t id : ids) {
        if (!in_vocab(id) || scratch.seen[id]) continue;
        scratch.seen[id] = 1;
        double& s = work[id].score;
        s = s > 0 ? s * inv : s * p.repetition_penalty;
      }
    };
    penalise(h.prompt);
    penalise(h.output);
    for (int32_t id : h.prompt)
      if (in_vocab(id)) scratch.seen[id] = 0;
    for (int32_t id : h.output)
      if (in_vocab(id)) scratch.seen[id] = 0;
  }
  if (p.frequency_penalty != 0.0 || p.presence_penalty != 0.0) {
    scratch.counts.resize(work.size(), 0);
    for (int32_t id : h.output)
      if (in_vocab(id)) ++scratch.counts[id];
    for (int32_t id : h.output) {
      if (!in_vocab(id) || scratch.counts[id] == 0) continue;
      work[id].score -= p.frequency_penalty * scratch.counts[id] + p.presence_penalty;
      scratch.counts[id] = 0;  // each distinct token once
    }
  }
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& p, uint64_t step, double u,
                     std::span<const int32_t> eos, const TokenHistory& history, Sampler::Scratch& scratch) {
  if (const std::optional<int32_t> forced = forced_token(p, step, history)) return *forced;
  std::vector<Candidate>& work = scratch.work;
  work.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) work[i] = {clean(logits[i]), static_cast<int32_t>(i)};
  adjust_logits(work, p, step, eos, history, scratch);

  const bool greedy = p.greedy();
  const int32_t best = argmax(work);
  if (greedy || work[best].score == kNegInf) return best;

  // Temperature; min-p keeps tokens whose probability is at least min_p times
  // the largest, i.e. scaled logit >= max + log(min_p).
  const double inv_t = 1.0 / p.temperature;
  const double max_scaled = work[best].score * inv_t;
  const double floor = p.min_p > 0.0 ? max_scaled + std::log(p.min_p) : kNegInf;
  size_t n = 0;
  for (const Candidate& c : work) {
    if (c.score == kNegInf) continue;
    const double s = c.score * inv_t;
    if (s < floor) continue;
    work[n++] = {s, c.token};
  }
  work.resize(n);

  const bool top_k = p.top_k > 0 && static_cast<size_t>(p.top_k) < work.size();
  if (top_k) {
    std::nth_element(work.begin(), work.begin() + p.top_k, work.end(), better);
    work.resize(p.top_k);
    std::sort(work.begin(), work.end(), better);
  }

  // Unnormalised probabilities, summed in the candidates' (fixed) order.
  double total = 0.0;
  for (Candidate& c : work) {
    c.score = std::exp(c.score - max_scaled);
    total += c.score;
  }
  if (p.top_p < 1.0) {
    // Keep the most likely tokens until their mass reaches top_p (at least
    // one). Sorting only a growing head of the candidates gives the same head
    // as a full sort: `better` is a total order.
    const double limit = p.top_p * total;
    size_t head = std::min<size_t>(work.size(), 256);
    for (;;) {
      if (head < work.size()) std::nth_element(work.begin(), work.begin() + head, work.end(), better);
      std::sort(work.begin(), work.begin() + head, better);
      double mass = 0.0;
      size_t keep = 0;
      while (keep < head && (keep == 0 || mass < limit)) mass += work[keep++].score;
      if (mass >= limit || head == work.size()) {
        work.resize(keep);
        total = mass;
        break;
      }
      head = std::min(work.size(), head * 4);
    }
  }

  const double target = u * total;
  double cum = 0.0;
  for (const Candidate& c : work) {
    cum += c.score;
    if (target < cum) return c.token;
  }
  return work.back().token;  // rounding: u * total at the very top
}

}  // namespace

Sampler::Sampler(std::vector<int32_t> eos_token_ids, RandomGenerator unseeded)
    : eos_token_ids_(std::move(eos_token_ids)), unseeded_(unseeded) {}

SampledToken Sampler::sample(std::span<const float> logits, const SamplingParams& params, uint64_t step,
                             const TokenHistory& history) {
  return sample_drawn(logits, params, step, draw(params, step), history);
}

double Sampler::draw(const SamplingParams& params, uint64_t step) { return draw_for(params, step, unseeded_); }

SampledToken Sampler::sample_drawn(std::span<const float> logits, const SamplingParams& params, uint64_t step,
                                   double u, const TokenHistory& history) {
  SampledToken out;
  out.token = sample_token(logits, params, step, u, eos_token_ids_, history, scratch_);
  if (params.logprobs) out.logprobs = compute_logprobs(logits, out.token, *params.logprobs);
  return out;
}

std::optional<TokenChoice> Sampler::device_choice(const SamplingParams& params, uint64_t step, double u,
                                                  std::vector<int32_t>& banned, const TokenHistory& history) const {
  if (params.logprobs) return std::nullopt;  // log-probabilities need the logits here
  // Penalties, bias, allowed and bad tokens adjust the row here; a forced
  // token needs no device at all, but the host path gives it the same way.
  if (params.adjusts_logits() || forced_token(params, step, history)) return std::nullopt;
  banned.clear();
  if (masks_stop_tokens(params, step)) {
    banned.assign(params.stop_token_ids.begin(), params.stop_token_ids.end());
    if (!params.ignore_eos) banned.insert(banned.end(), eos_token_ids_.begin(), eos_token_ids_.end());
    std::sort(banned.begin(), banned.end());
    banned.erase(std::unique(banned.begin(), banned.end()), banned.end());
    if (banned.size() > static_cast<size_t>(kMaxChoiceBannedTokens)) return std::nullopt;
  }
  TokenChoice c;
  c.temperature = params.greedy() ? 0.0 : params.temperature;
  c.top_p = params.top_p;
  c.top_k = params.top_k;
  c.min_p = params.min_p;
  c.uniform = u;
  c.banned = banned;
  return c;
}

int32_t sample(std::span<const float> logits, const SamplingParams& params, uint64_t step,
               RandomGenerator& unseeded, std::span<const int32_t> eos_token_ids, const TokenHistory& history) {
  Sampler::Scratch scratch;
  return sample_token(logits, params, step, draw_for(params, step, unseeded), eos_token_ids, history, scratch);
}

std::optional<int32_t> forced_token(const SamplingParams& p, uint64_t step, const TokenHistory& h) {
  if (p.forced_tokens.empty()) return std::nullopt;
  uint64_t start = 0;
  if (p.force_after_token) {
    const auto it = std::find(h.output.begin(), h.output.end(), *p.force_after_token);
    if (it == h.output.end()) return std::nullopt;
    start = static_cast<uint64_t>(it - h.output.begin()) + 1;
  }
  if (step < start || step - start >= p.forced_tokens.size()) return std::nullopt;
  return p.forced_tokens[step - start];
}

TokenLogprobs compute_logprobs(std::span<const float> logits, int32_t chosen, int32_t n) {
  double max = kNegInf;
  for (float l : logits) max = std::max(max, clean(l));
  double sum = 0.0;
  if (max > kNegInf)
    for (float l : logits) sum += std::exp(clean(l) - max);
  const double lse = max > kNegInf ? max + std::log(sum) : 0.0;

  TokenLogprobs out;
  const double chosen_logit = clean(logits[chosen]);
  int32_t rank = 1;
  for (float l : logits) rank += clean(l) > chosen_logit;
  out.chosen = {chosen, chosen_logit - lse, rank};

  // Top n by insertion into a short sorted list (n <= 20).
  const size_t want = std::min(static_cast<size_t>(std::max(n, 0)), logits.size());
  std::vector<Candidate> top;
  top.reserve(want + 1);
  for (size_t i = 0; i < logits.size() && want > 0; ++i) {
    const Candidate c{clean(logits[i]), static_cast<int32_t>(i)};
    if (top.size() == want && !better(c, top.back())) continue;
    top.insert(std::upper_bound(top.begin(), top.end(), c, better), c);
    if (top.size() > want) top.pop_back();
  }
  out.top.reserve(top.size());
  for (size_t i = 0; i < top.size(); ++i) {
    // Equal logits share a rank, as vLLM counts strictly larger ones.
    int32_t r = static_cast<int32_t>(i) + 1;
    while (r > 1 && top[r - 2].score == top[i].score) --r;
    out.top.push_back({top[i].token, top[i].score - lse, r});
  }
  return out;
}

}  // namespace siesta
