// StopStringChecker: finds a request's stop strings in its output text as the
// text arrives, and says which text is safe to send to the client.
//
//   StopStringChecker stops(params.stop, params.include_stop_str_in_output);
//   for each generated token:
//     StopCheck c = stops.push(detokenizer.push(token));   // newly complete text
//     send(c.text);
//     if (c.stopped) { finish the request (reason: stop string c.stop_string); break; }
//   at the end of a request that did not stop on a string:
//     send(stops.finish());
//
// A stop string may be split across tokens ("</" then "end>"). Text that could
// still be the start of a stop string is held back: exactly the longest suffix
// of the unsent text that is a proper prefix of some stop string, so nothing is
// ever sent and then retracted. On a match the output ends where the stop
// string begins (or where it ends, with include_stop_str_in_output); the
// earliest match in the text wins, and among stop strings that start at the
// same place, the first one listed.
//
// push(text, /*may_stop=*/false) appends text in which no stop may be found
// (the tokens before min_tokens): it is sent whole, nothing is held back.
//
// Works on bytes; stop strings and pushed text are UTF-8, and held-back text
// always starts at a character boundary because a stop string does.
// A value type; not thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace siesta {

struct StopCheck {
  std::string text;          // safe to send now (possibly empty)
  bool stopped = false;      // a stop string matched; later pushes return nothing
  int stop_index = -1;       // which stop string, when stopped
};

class StopStringChecker {
 public:
  explicit StopStringChecker(std::vector<std::string> stop_strings, bool include_stop_in_output = false);

  StopCheck push(std::string_view new_text, bool may_stop = true);
  // The held-back text, at the end of a stream that did not stop (empty after a stop).
  std::string finish();

  bool stopped() const { return stopped_; }
  // The matched stop string; empty if none.
  std::string_view stop_string() const {
    return stop_index_ >= 0 ? std::string_view(stops_[stop_index_]) : std::string_view();
  }
  const std::string& sent_text() const { return sent_; }   // everything returned so far

 private:
  size_t hold_length() const;

  std::vector<std::string> stops_;
  bool include_stop_;
  std::string pending_;   // received, not yet sent
  std::string sent_;
  bool stopped_ = false;
  int stop_index_ = -1;
};

}  // namespace siesta
