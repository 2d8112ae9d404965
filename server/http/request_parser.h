// SPDX-License-Identifier: Apache-2.0
// RequestParser: an incremental HTTP/1.1 request parser (request line,
// headers, Content-Length body). Pure: bytes in, a Request or an error out;
// fuzzed by tests/fuzz/http_request_fuzz.cpp.
//
// What it accepts: methods GET HEAD POST PUT DELETE OPTIONS PATCH (another
// well-formed method: 501), origin-form targets ("/path?query") or "*",
// HTTP/1.0 and HTTP/1.1 (HTTP/x.y otherwise: 505), CRLF or bare LF line ends,
// empty lines before a request line (skipped). Refused with 400: a malformed
// request line or header line, obsolete line folding, control characters,
// an invalid or conflicting Content-Length. A body needs Content-Length: a
// POST/PUT/PATCH without one and any chunked body get 411, another
// Transfer-Encoding 501. Host is not required. The result does not depend on
// how the bytes are split across feed() calls (the fuzz target checks it).
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
  // Whether the head is complete, asked "Expect: 100-continue" and the body
  // is still to come (the server then sends "100 Continue", as curl waits a
  // second for it before sending a body over 1 KiB).
  bool expects_continue() const {
    return state_ == State::kNeedMore && in_body_ && expect_continue_;
  }
  // Whether the request line said HTTP/1.0 (no chunked responses then).
  bool http10() const { return http10_; }
  // Whether any byte of a request has arrived (for the request timeout).
  bool started() const { return started_; }
  // Readies the parser for the next request on the connection.
  void reset();

 private:
  // Enters kError with that status and message; returns false.
  bool fail(int status, std::string message);
  // The request line (without its line end) into request_; false on error.
  bool parse_request_line(std::string_view line);
  // The headers of the complete head_ into request_ and the body's length.
  bool parse_head();

  State state_ = State::kNeedMore;
  size_t max_header_bytes_, max_body_bytes_;
  std::string head_;  // bytes of the request line and headers so far
  size_t body_expected_ = 0;
  bool in_body_ = false;
  bool keep_alive_ = true;
  bool started_ = false;
  bool first_line_checked_ = false;
  bool http10_ = false;
  bool expect_continue_ = false;
  Request request_;
  int error_status_ = 0;
  std::string error_message_;
};

}  // namespace specula::http
