// SPDX-License-Identifier: Apache-2.0
// RequestParser: see request_parser.h. The head (request line and headers) is
// buffered until its blank line and parsed in one go; the body is then copied
// straight into the Request. Every byte is bounded by the limits, so a client
// can make the parser hold at most max_header_bytes + max_body_bytes.
#include "server/http/request_parser.h"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace specula::http {

namespace {

// RFC 9110 tchar: the characters of a method or a header name.
bool is_tchar(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  switch (c) {
    case '!':
    case '#':
    case '$':
    case '%':
    case '&':
    case '\'':
    case '*':
    case '+':
    case '-':
    case '.':
    case '^':
    case '_':
    case '`':
    case '|':
    case '~':
      return true;
    default:
      return false;
  }
}

bool is_token(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), is_tchar);
}

char lower(char c) {
  return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Whether a comma-separated header value (Connection) lists `token`.
bool lists_token(std::string_view value, std::string_view token) {
  while (!value.empty()) {
    const size_t comma = value.find(',');
    if (iequals(trim(value.substr(0, comma)), token)) return true;
    if (comma == std::string_view::npos) break;
    value.remove_prefix(comma + 1);
  }
  return false;
}

// The methods a handler may see; other well-formed methods get 501.
bool known_method(std::string_view m) {
  for (std::string_view k : {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"}) {
    if (m == k) return true;
  }
  return false;
}

}  // namespace

std::optional<std::string_view> Request::header(std::string_view lower_name) const {
  for (const auto& [name, value] : headers) {
    if (name == lower_name) return std::string_view(value);
  }
  return std::nullopt;
}

RequestParser::RequestParser(size_t max_header_bytes, size_t max_body_bytes)
    : max_header_bytes_(max_header_bytes), max_body_bytes_(max_body_bytes) {}

void RequestParser::reset() {
  state_ = State::kNeedMore;
  head_.clear();
  body_expected_ = 0;
  in_body_ = false;
  keep_alive_ = true;
  started_ = false;
  first_line_checked_ = false;
  http10_ = false;
  expect_continue_ = false;
  request_ = Request{};
  error_status_ = 0;
  error_message_.clear();
}

Request RequestParser::take() {
  return std::move(request_);
}

bool RequestParser::fail(int status, std::string message) {
  state_ = State::kError;
  error_status_ = status;
  error_message_ = std::move(message);
  return false;
}

size_t RequestParser::feed(std::string_view bytes) {
  if (state_ != State::kNeedMore) return 0;
  size_t used = 0;
  if (!in_body_) {
    // Empty lines before a request line are skipped (RFC 9112 2.2: some
    // clients send an extra CRLF after a POST body).
    if (head_.empty()) {
      while (used < bytes.size() && (bytes[used] == '\r' || bytes[used] == '\n')) ++used;
      if (used > 0) started_ = true;
      if (used == bytes.size()) return used;
    }
    started_ = true;
    // Look for the blank line ending the head, from a few bytes before the new
    // ones (the terminator may straddle two feeds). Lines may end in CRLF or LF.
    const size_t old_size = head_.size();
    const size_t room = max_header_bytes_ + 4 > old_size ? max_header_bytes_ + 4 - old_size : 0;
    head_.append(bytes.substr(used, room));
    size_t end = std::string::npos;
    for (size_t i = old_size > 3 ? old_size - 3 : 0; i < head_.size(); ++i) {
      if (head_[i] != '\n') continue;
      if (i + 1 < head_.size() && head_[i + 1] == '\n') {
        end = i + 2;
        break;
      }
      if (i + 2 < head_.size() && head_[i + 1] == '\r' && head_[i + 2] == '\n') {
        end = i + 3;
        break;
      }
    }
    // A request line that is already wrong is answered without waiting for
    // the rest of the head. (Only a line end within the limit counts, so that
    // the outcome does not depend on how the bytes were split: fed one at a
    // time, a head over the limit fails before a later line end arrives.)
    if (!first_line_checked_) {
      // (Earlier feeds had no line end: search only the new bytes.)
      const size_t eol = head_.find('\n', old_size);
      if (eol != std::string::npos && eol < max_header_bytes_) {
        first_line_checked_ = true;
        if (!parse_request_line(std::string_view(head_).substr(0, eol))) {
          return used + (head_.size() - old_size);
        }
      }
    }
    if (end == std::string::npos) {
      if (head_.size() > max_header_bytes_) {
        fail(431,
             "request headers are larger than " + std::to_string(max_header_bytes_) + " bytes");
      }
      return used + (head_.size() - old_size);
    }
    if (end > max_header_bytes_) {
      fail(431, "request headers are larger than " + std::to_string(max_header_bytes_) + " bytes");
      return used + (end - old_size);
    }
    used += end - old_size;
    head_.resize(end);
    if (!parse_head()) return used;
    head_.clear();
    head_.shrink_to_fit();
    if (body_expected_ == 0) {
      state_ = State::kComplete;
      return used;
    }
    in_body_ = true;
    request_.body.reserve(body_expected_);
  }
  const size_t take_n = std::min(bytes.size() - used, body_expected_ - request_.body.size());
  request_.body.append(bytes.substr(used, take_n));
  used += take_n;
  if (request_.body.size() == body_expected_) state_ = State::kComplete;
  return used;
}

bool RequestParser::parse_request_line(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos) {
    return fail(400, "malformed request line");
  }
  const std::string_view method = line.substr(0, sp1);
  const std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string_view version = line.substr(sp2 + 1);
  if (!is_token(method)) return fail(400, "malformed request method");
  if (target.empty() || (target[0] != '/' && target != "*")) {
    return fail(400, "request target must be an absolute path");
  }
  for (char c : target) {
    // No controls, spaces or DEL in a target (bytes >= 0x80 are refused too:
    // clients percent-encode them).
    if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
      return fail(400, "invalid character in request target");
    }
  }
  if (version.size() != 8 || version.substr(0, 5) != "HTTP/" || version[6] != '.' ||
      version[5] < '0' || version[5] > '9' || version[7] < '0' || version[7] > '9') {
    return fail(400, "malformed HTTP version");
  }
  if (version != "HTTP/1.1" && version != "HTTP/1.0") {
    return fail(505, "HTTP version not supported (only HTTP/1.0 and HTTP/1.1)");
  }
  if (!known_method(method)) return fail(501, "method not implemented");
  http10_ = version == "HTTP/1.0";
  request_.method = std::string(method);
  request_.target = std::string(target);
  const size_t q = target.find('?');
  request_.path = std::string(target.substr(0, q));
  request_.query = q == std::string_view::npos ? std::string() : std::string(target.substr(q + 1));
  return true;
}

bool RequestParser::parse_head() {
  std::string_view rest(head_);
  const size_t eol = rest.find('\n');
  rest.remove_prefix(eol + 1);  // the request line, parsed as soon as it arrived
  std::optional<std::string_view> content_length;
  bool has_transfer_encoding = false, chunked = false, conn_close = false, conn_keep = false;
  while (true) {
    const size_t e = rest.find('\n');
    std::string_view line = rest.substr(0, e);
    rest.remove_prefix(e + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) break;  // the blank line ending the head
    if (line[0] == ' ' || line[0] == '\t') return fail(400, "obsolete header line folding");
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) return fail(400, "malformed header line (no colon)");
    const std::string_view name = line.substr(0, colon);
    if (!is_token(name)) return fail(400, "malformed header name");
    const std::string_view value = trim(line.substr(colon + 1));
    for (char c : value) {
      const auto u = static_cast<unsigned char>(c);
      if ((u < 0x20 && c != '\t') || u == 0x7f) return fail(400, "invalid character in header");
    }
    std::string lname(name);
    for (char& c : lname) c = lower(c);
    if (lname == "content-length") {
      // Repeats are allowed only with one value (RFC 9112 6.3: otherwise the
      // framing is ambiguous, a request-smuggling vector).
      if (content_length && *content_length != value) {
        return fail(400, "conflicting Content-Length headers");
      }
      content_length = value;
    } else if (lname == "transfer-encoding") {
      has_transfer_encoding = true;
      if (lists_token(value, "chunked")) chunked = true;
    } else if (lname == "connection") {
      conn_close = conn_close || lists_token(value, "close");
      conn_keep = conn_keep || lists_token(value, "keep-alive");
    } else if (lname == "expect") {
      expect_continue_ = !http10_ && iequals(value, "100-continue");
    }
    request_.headers.emplace_back(std::move(lname), std::string(value));
  }
  keep_alive_ = http10_ ? (conn_keep && !conn_close) : !conn_close;
  // A body's framing: Content-Length only (a Transfer-Encoding with it would
  // be the smuggling case RFC 9112 6.1 tells servers to refuse).
  if (has_transfer_encoding) {
    if (chunked) return fail(411, "chunked request bodies are not supported; send Content-Length");
    return fail(501, "Transfer-Encoding not implemented");
  }
  if (content_length) {
    const std::string_view v = *content_length;
    if (v.empty() || v.size() > 19 ||
        !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return fail(400, "invalid Content-Length");
    }
    uint64_t n = 0;
    for (char c : v) n = n * 10 + static_cast<uint64_t>(c - '0');
    if (n > max_body_bytes_) {
      return fail(413, "request body of " + std::to_string(n) + " bytes is over the limit of " +
                           std::to_string(max_body_bytes_) + " bytes");
    }
    body_expected_ = static_cast<size_t>(n);
  } else if (request_.method == "POST" || request_.method == "PUT" || request_.method == "PATCH") {
    // Without a length the body's end is unknowable on a kept-alive connection.
    return fail(411, "a " + request_.method + " request needs Content-Length");
  }
  return true;
}

}  // namespace specula::http
