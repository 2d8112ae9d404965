// SPDX-License-Identifier: Apache-2.0
#include "apps/cli/http_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>

namespace specula::cli::http {
namespace {

constexpr size_t kMaxHead = 64 * 1024;    // status line + headers
constexpr size_t kMaxSseLine = 16 << 20;  // one event-stream line
constexpr uint64_t kMaxChunk = uint64_t{1} << 40;

std::string fmt_timeout(const char* what) {
  return std::string("timed out ") + what;
}

[[noreturn]] void protocol_error(const std::string& message) {
  throw HttpError(HttpErrorKind::kProtocol, message);
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; };
           return lower(x) == lower(y);
         });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

// Milliseconds left until `deadline` (rounded up, so that poll never returns
// before it), or -1 when it has passed.
int ms_left(Clock::time_point deadline) {
  const auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return -1;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

// Waits until `fd` is ready for `events`; throws kTimeout past the deadline.
void wait_for(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    const int ms = ms_left(deadline);
    if (ms < 0) throw HttpError(HttpErrorKind::kTimeout, fmt_timeout(what));
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, ms);
    if (r > 0) return;
    if (r < 0 && errno != EINTR)
      throw HttpError(HttpErrorKind::kProtocol, std::string("poll: ") + std::strerror(errno));
  }
}

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

std::optional<Address> loopback_address(const std::string& host_in, int port) {
  if (port < 1 || port > 65535) return std::nullopt;
  std::string host = host_in;
  if (iequals(host, "localhost")) host = "127.0.0.1";
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  Address a;
  in_addr v4{};
  in6_addr v6{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    if ((ntohl(v4.s_addr) >> 24) != 127) return std::nullopt;
    auto* sin = reinterpret_cast<sockaddr_in*>(&a.storage);
    sin->sin_family = AF_INET;
    sin->sin_port = htons(static_cast<uint16_t>(port));
    sin->sin_addr = v4;
    a.length = sizeof(sockaddr_in);
    a.host_header = host + ":" + std::to_string(port);
    return a;
  }
  if (::inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (!IN6_IS_ADDR_LOOPBACK(&v6)) return std::nullopt;
    auto* sin6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
    sin6->sin6_family = AF_INET6;
    sin6->sin6_port = htons(static_cast<uint16_t>(port));
    sin6->sin6_addr = v6;
    a.length = sizeof(sockaddr_in6);
    a.host_header = "[::1]:" + std::to_string(port);
    return a;
  }
  return std::nullopt;
}

void ChunkedDecoder::feed(std::string_view in, std::string& out) {
  size_t i = 0;
  while (i < in.size() && state_ != State::kDone) {
    const char c = in[i];
    switch (state_) {
      case State::kSize: {
        int digit = -1;
        if (c >= '0' && c <= '9') digit = c - '0';
        if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
        if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
        if (digit >= 0) {
          size_ = size_ * 16 + static_cast<uint64_t>(digit);
          if (++digits_ > 16 || size_ > kMaxChunk) protocol_error("chunk size too large");
        } else if (digits_ == 0) {
          protocol_error("chunked body: expected a chunk size");
        } else if (c == ';' || c == ' ' || c == '\t') {
          state_ = State::kExtension;
        } else if (c == '\r') {
          state_ = State::kSizeLf;
        } else if (c == '\n') {
          state_ = size_ == 0 ? State::kTrailerLine : State::kData;
        } else {
          protocol_error("chunked body: bad character in a chunk size");
        }
        ++i;
        break;
      }
      case State::kExtension:
        if (c == '\r') state_ = State::kSizeLf;
        if (c == '\n') state_ = size_ == 0 ? State::kTrailerLine : State::kData;
        ++i;
        break;
      case State::kSizeLf:
        if (c != '\n') protocol_error("chunked body: CR without LF after a chunk size");
        state_ = size_ == 0 ? State::kTrailerLine : State::kData;
        ++i;
        break;
      case State::kData: {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(size_, in.size() - i));
        out.append(in.substr(i, n));
        i += n;
        size_ -= n;
        if (size_ == 0) state_ = State::kDataCr;
        break;
      }
      case State::kDataCr:
        if (c == '\r') {
          state_ = State::kDataLf;
        } else if (c == '\n') {
          state_ = State::kSize;
          digits_ = 0;
        } else {
          protocol_error("chunked body: chunk longer than its size");
        }
        ++i;
        break;
      case State::kDataLf:
        if (c != '\n') protocol_error("chunked body: CR without LF after chunk data");
        state_ = State::kSize;
        digits_ = 0;
        ++i;
        break;
      case State::kTrailerLine:
        state_ = c == '\r' ? State::kTrailerLf : c == '\n' ? State::kDone : State::kTrailerSkip;
        ++i;
        break;
      case State::kTrailerSkip:
        if (c == '\n') state_ = State::kTrailerLine;
        ++i;
        break;
      case State::kTrailerLf:
        if (c != '\n') protocol_error("chunked body: CR without LF at the end");
        state_ = State::kDone;
        ++i;
        break;
      case State::kDone:
        break;
    }
  }
}

void SseSplitter::line_done(std::vector<std::string>& events) {
  if (line_.empty()) {
    if (has_data_) events.push_back(std::move(data_));
    data_.clear();
    has_data_ = false;
    return;
  }
  if (line_.front() == ':') {  // a comment
    line_.clear();
    return;
  }
  const size_t colon = line_.find(':');
  std::string_view name(line_), value;
  if (colon != std::string::npos) {
    name = std::string_view(line_).substr(0, colon);
    value = std::string_view(line_).substr(colon + 1);
    if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  }
  if (name == "data") {
    if (has_data_) data_ += '\n';
    data_.append(value);
    has_data_ = true;
  }
  line_.clear();
}

void SseSplitter::feed(std::string_view in, std::vector<std::string>& events) {
  for (const char c : in) {
    if (c == '\n' && after_cr_) {  // the LF of a CRLF: its CR ended the line
      after_cr_ = false;
      continue;
    }
    after_cr_ = c == '\r';
    if (c == '\r' || c == '\n') {
      line_done(events);
    } else {
      if (line_.size() >= kMaxSseLine) protocol_error("event-stream line longer than 16 MiB");
      line_ += c;
    }
  }
}

std::optional<std::string> ResponseHead::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (iequals(k, name)) return v;
  return std::nullopt;
}

ResponseHead parse_response_head(std::string_view head) {
  ResponseHead h;
  size_t eol = head.find('\n');
  std::string_view status_line = trim(head.substr(0, eol));
  // "HTTP/1.1 200 OK"
  if (!status_line.starts_with("HTTP/1.") || status_line.size() < 12 || status_line[8] != ' ')
    protocol_error("bad status line: '" + std::string(status_line.substr(0, 80)) + "'");
  const std::string_view code = status_line.substr(9, 3);
  const auto [end, ec] = std::from_chars(code.data(), code.data() + 3, h.status);
  if (ec != std::errc() || end != code.data() + 3 || h.status < 100 || h.status > 999)
    protocol_error("bad status code in '" + std::string(status_line.substr(0, 80)) + "'");
  if (status_line.size() > 13) h.reason = std::string(status_line.substr(13));
  while (eol != std::string_view::npos) {
    const size_t start = eol + 1;
    eol = head.find('\n', start);
    const std::string_view line = trim(
        head.substr(start, eol == std::string_view::npos ? std::string_view::npos : eol - start));
    if (line.empty()) continue;
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0)
      protocol_error("bad header line: '" + std::string(line.substr(0, 80)) + "'");
    h.headers.emplace_back(std::string(trim(line.substr(0, colon))),
                           std::string(trim(line.substr(colon + 1))));
  }
  return h;
}

void post(const Address& address, const std::string& path, const std::string& content_type,
          const std::string& body, Clock::time_point deadline,
          const std::function<void(const ResponseHead&)>& on_head, const BodySink& on_body) {
  const int family = address.storage.ss_family;
  Socket sock(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (sock.fd() < 0)
    throw HttpError(HttpErrorKind::kConnect, std::string("socket: ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(sock.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

  // Connect (non-blocking, bounded by the deadline).
  if (::connect(sock.fd(), reinterpret_cast<const sockaddr*>(&address.storage), address.length) !=
      0) {
    if (errno != EINPROGRESS)
      throw HttpError(HttpErrorKind::kConnect,
                      "connect to " + address.host_header + ": " + std::strerror(errno));
    wait_for(sock.fd(), POLLOUT, deadline, "connecting");
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(sock.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0)
      throw HttpError(HttpErrorKind::kConnect,
                      "connect to " + address.host_header + ": " + std::strerror(err));
  }

  // Send the request.
  std::string request = "POST " + path + " HTTP/1.1\r\nHost: " + address.host_header +
                        "\r\nUser-Agent: specula-bench-serve\r\nAccept: text/event-stream, "
                        "application/json\r\nContent-Type: " +
                        content_type + "\r\nContent-Length: " + std::to_string(body.size()) +
                        "\r\nConnection: close\r\n\r\n" + body;
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(sock.fd(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      wait_for(sock.fd(), POLLOUT, deadline, "sending the request");
    } else if (n < 0 && errno != EINTR) {
      protocol_error(std::string("send: ") + std::strerror(errno));
    }
  }

  // Read: the head, then the body by its framing.
  std::string buf, decoded;
  bool have_head = false, chunked = false, stop = false;
  std::optional<uint64_t> content_length;
  uint64_t body_bytes = 0;
  ChunkedDecoder dechunk;
  char chunk[16384];
  auto deliver = [&](std::string_view bytes) {
    if (chunked) {
      decoded.clear();
      dechunk.feed(bytes, decoded);
      if (!decoded.empty() && !on_body(decoded)) stop = true;
      return;
    }
    if (content_length) bytes = bytes.substr(0, *content_length - body_bytes);
    body_bytes += bytes.size();
    if (!bytes.empty() && !on_body(bytes)) stop = true;
  };
  auto complete = [&] {
    return chunked ? dechunk.done() : content_length && body_bytes >= *content_length;
  };
  for (;;) {
    if (have_head && (stop || complete())) return;
    const ssize_t n = ::recv(sock.fd(), chunk, sizeof chunk, 0);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait_for(sock.fd(), POLLIN, deadline,
                 have_head ? "reading the response body" : "waiting for the response");
        continue;
      }
      if (errno == EINTR) continue;
      protocol_error(std::string("recv: ") + std::strerror(errno));
    }
    if (n == 0) {  // the server closed the connection
      if (!have_head) protocol_error("connection closed before a complete response head");
      if (chunked || content_length) protocol_error("connection closed in the middle of the body");
      return;  // the body ran to the close
    }
    if (Clock::now() >= deadline)
      throw HttpError(HttpErrorKind::kTimeout, fmt_timeout("reading the response body"));
    const std::string_view got(chunk, static_cast<size_t>(n));
    if (have_head) {
      deliver(got);
      continue;
    }
    buf.append(got);
    const size_t end = buf.find("\r\n\r\n");
    if (end == std::string::npos) {
      if (buf.size() > kMaxHead) protocol_error("response head larger than 64 KiB");
      continue;
    }
    const ResponseHead head = parse_response_head(std::string_view(buf).substr(0, end));
    if (const auto te = head.header("Transfer-Encoding")) {
      if (!iequals(trim(*te), "chunked"))
        protocol_error("unsupported Transfer-Encoding '" + *te + "'");
      chunked = true;
    } else if (const auto cl = head.header("Content-Length")) {
      uint64_t v = 0;
      const auto [p, ec] = std::from_chars(cl->data(), cl->data() + cl->size(), v);
      if (ec != std::errc() || p != cl->data() + cl->size())
        protocol_error("bad Content-Length '" + *cl + "'");
      content_length = v;
    }
    have_head = true;
    on_head(head);
    const std::string rest = buf.substr(end + 4);
    buf.clear();
    if (!rest.empty()) deliver(rest);
  }
}

}  // namespace specula::cli::http
