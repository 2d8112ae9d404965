// SPDX-License-Identifier: Apache-2.0
// Fuzz target: the HTTP request parser. The input is the byte stream of one
// connection; it is parsed as pipelined requests (up to kMaxRequests) twice,
// once fed whole and once in small uneven pieces, and both must give the same
// requests and the same final state (the server feeds whatever recv returned,
// so the result must not depend on the split). Accepted requests must be
// consistent: body length = Content-Length, lowercase token header names,
// path and query splitting the target.
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "server/http/request_parser.h"
#include "tests/fuzz/fuzz_target.h"

namespace {

using specula::http::Request;
using specula::http::RequestParser;

// Small limits, so that the fuzzer reaches 413 and 431 with short inputs.
constexpr size_t kMaxHeader = 512, kMaxBody = 256, kMaxRequests = 8;

struct Outcome {
  std::vector<Request> requests;
  std::vector<bool> keep_alive;
  RequestParser::State final_state = RequestParser::State::kNeedMore;
  int error_status = 0;
  std::string error_message;
};

// Parses `input` feeding at most the next piece size each call (0: all).
Outcome parse(std::string_view input, const std::vector<size_t>& pieces) {
  Outcome out;
  RequestParser p(kMaxHeader, kMaxBody);
  size_t at = 0, piece = 0;
  while (out.requests.size() < kMaxRequests) {
    const size_t n = pieces.empty() ? input.size() - at
                                    : std::min(pieces[piece++ % pieces.size()], input.size() - at);
    const size_t used = p.feed(input.substr(at, n));
    SPECULA_FUZZ_ASSERT(used <= n);
    at += used;
    if (p.state() == RequestParser::State::kComplete) {
      SPECULA_FUZZ_ASSERT(p.feed("x") == 0);
      out.keep_alive.push_back(p.keep_alive());
      out.requests.push_back(p.take());
      p.reset();
      continue;
    }
    if (p.state() == RequestParser::State::kError) break;
    SPECULA_FUZZ_ASSERT(used == n);  // more is needed: everything offered is taken
    if (at == input.size()) break;
  }
  out.final_state = p.state();
  out.error_status = p.error_status();
  out.error_message = p.error_message();
  return out;
}

bool is_lower_token(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c >= 'A' && c <= 'Z') return false;
    if (static_cast<unsigned char>(c) <= 0x20 || c == ':' || static_cast<unsigned char>(c) >= 0x7f)
      return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fz = specula::fuzz;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const Outcome whole = parse(input, {});
  const Outcome split = parse(input, {1, 3, 2, 7, 1, 1, 16, 5});
  SPECULA_FUZZ_ASSERT(whole.final_state == split.final_state);
  SPECULA_FUZZ_ASSERT(whole.error_status == split.error_status);
  SPECULA_FUZZ_ASSERT(whole.error_message == split.error_message);
  SPECULA_FUZZ_ASSERT(whole.requests.size() == split.requests.size());
  SPECULA_FUZZ_ASSERT(whole.keep_alive == split.keep_alive);
  uint64_t outcome = fz::mix(static_cast<uint64_t>(whole.final_state), whole.error_status);
  for (size_t i = 0; i < whole.requests.size(); ++i) {
    const Request& a = whole.requests[i];
    const Request& b = split.requests[i];
    SPECULA_FUZZ_ASSERT(a.method == b.method && a.target == b.target && a.body == b.body);
    SPECULA_FUZZ_ASSERT(a.headers == b.headers);
    SPECULA_FUZZ_ASSERT(a.path + (a.target.find('?') != std::string::npos ? "?" + a.query : "") ==
                        a.target);
    SPECULA_FUZZ_ASSERT(a.body.size() <= kMaxBody);
    // The parser accepts only 1-19 digits, so strtoull reads the whole value.
    const auto length = a.header("content-length");
    SPECULA_FUZZ_ASSERT(length ? std::strtoull(std::string(*length).c_str(), nullptr, 10) ==
                                     a.body.size()
                               : a.body.empty());
    for (const auto& [name, value] : a.headers) {
      SPECULA_FUZZ_ASSERT(is_lower_token(name));
      SPECULA_FUZZ_ASSERT(value.find_first_of("\r\n") == std::string::npos);
    }
    outcome = fz::mix(outcome, a.method.size() * 64 + std::min<size_t>(a.headers.size(), 15) * 2 +
                                   !a.body.empty());
  }
  fz::last_accepted = !whole.requests.empty();
  fz::last_outcome = whole.final_state == RequestParser::State::kError
                         ? fz::mix(outcome, fz::error_outcome(whole.error_message))
                         : outcome;
  return 0;
}
