// SPDX-License-Identifier: Apache-2.0
// RequestParser: an incremental HTTP/1.1 request parser (request line,
// headers, Content-Length body). Pure: bytes in, a Request or an error out;
// fuzzed by tests/fuzz/http_request_fuzz.cpp.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "server/http/http_server.h"

namespace specula::http {

class RequestParser {
 public:
  enum class State { kNeedMore, kComplete, kError };

  RequestParser(size_t max_header_bytes, size_t max_body_bytes);

  // Consumes bytes; returns how many were used (bytes past a complete request
  // belong to the next one and are not consumed). After kComplete or kError,
  // feed consumes nothing until reset().
  size_t feed(std::string_view bytes);
  State state() const { return state_; }
  // kComplete: the request (moved out by take()).
  Request take();
  // kError: the HTTP status to answer (400, 411, 413, 431, 501, 505) and why.
  int error_status() const { return error_status_; }
  const std::string& error_message() const { return error_message_; }
  // Whether the client asked to keep the connection (HTTP/1.1 default, unless
  // "Connection: close"; HTTP/1.0 only with "Connection: keep-alive").
  bool keep_alive() const { return keep_alive_; }
  // Whether any byte of a request has arrived (for the request timeout).
  bool started() const { return started_; }
  // Readies the parser for the next request on the connection.
  void reset();

 private:
  State state_ = State::kNeedMore;
  size_t max_header_bytes_, max_body_bytes_;
  std::string head_;  // bytes of the request line and headers so far
  size_t body_expected_ = 0;
  bool in_body_ = false;
  bool keep_alive_ = true;
  bool started_ = false;
  Request request_;
  int error_status_ = 0;
  std::string error_message_;
};

}  // namespace specula::http
