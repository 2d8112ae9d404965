// SPDX-License-Identifier: Apache-2.0
// A small blocking HTTP/1.1 client for `specula bench-serve`: one POST per
// connection ("Connection: close"), loopback servers only, the response body
// handed over as it arrives (by Content-Length, chunked transfer decoding, or
// up to the close), and an incremental splitter of server-sent events.
//
// The decoders are separate from the sockets so that they can be tested byte
// by byte; they throw HttpError (kind kProtocol) on malformed input.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace specula::cli::http {

using Clock = std::chrono::steady_clock;

enum class HttpErrorKind {
  kConnect,   // the connection could not be made (refused, unreachable)
  kTimeout,   // the deadline passed (connecting, sending or reading)
  kProtocol,  // a malformed response, or the connection closed mid-response
};

class HttpError : public std::runtime_error {
 public:
  HttpError(HttpErrorKind kind, const std::string& message)
      : std::runtime_error(message), kind_(kind) {}
  HttpErrorKind kind() const { return kind_; }

 private:
  HttpErrorKind kind_;
};

// A resolved loopback address.
struct Address {
  sockaddr_storage storage{};
  socklen_t length = 0;
  std::string host_header;  // "127.0.0.1:8080", "[::1]:8080"
};

// The address of `host`:`port` when host is loopback: an IPv4 literal in
// 127.0.0.0/8, "::1" (bracketed or not), or "localhost" (any case; taken as
// 127.0.0.1, never looked up). nullopt for anything else, names included.
std::optional<Address> loopback_address(const std::string& host, int port);

// Chunked transfer coding (RFC 9112 section 7.1), decoded incrementally: feed()
// accepts any split of the input, down to single bytes. Chunk extensions and
// trailers are skipped; bare LF line ends are accepted. Bytes after the last
// chunk's terminating blank line are ignored.
class ChunkedDecoder {
 public:
  // Appends the body bytes decoded from `in` to `out`.
  void feed(std::string_view in, std::string& out);
  // True once the zero-size chunk and its trailer section have been read.
  bool done() const { return state_ == State::kDone; }

 private:
  enum class State {
    kSize,         // hex digits of a chunk size
    kExtension,    // ";..." after the size, up to the line end
    kSizeLf,       // the LF after the size line's CR
    kData,         // chunk bytes
    kDataCr,       // the CRLF after the chunk bytes
    kDataLf,       //
    kTrailerLine,  // at the start of a trailer line (an empty one ends the body)
    kTrailerSkip,  // inside a trailer field, up to its LF
    kTrailerLf,    // the LF of the final empty line
    kDone,
  };
  State state_ = State::kSize;
  uint64_t size_ = 0;  // of the current chunk; while kData, the bytes left
  int digits_ = 0;
};

// Server-sent events (the WHATWG event-stream format), split incrementally:
// lines end with CRLF, LF or CR (also split across feeds); a blank line
// dispatches the event. Only `data` fields matter: an event is its data lines
// joined by '\n' (one space after "data:" dropped). Comment lines (":...")
// and other fields are skipped; an event without data is not dispatched; an
// unfinished event at the end of the stream is never dispatched.
class SseSplitter {
 public:
  // Appends the data of each event completed by `in` to `events`.
  void feed(std::string_view in, std::vector<std::string>& events);

 private:
  void line_done(std::vector<std::string>& events);
  std::string line_, data_;
  bool has_data_ = false;
  bool after_cr_ = false;  // the last byte was a CR (a following LF ends nothing)
};

// The status line and headers of a response.
struct ResponseHead {
  int status = 0;
  std::string reason;
  std::vector<std::pair<std::string, std::string>> headers;  // names as sent
  // The value of the first header named `name` (case-insensitive), or nullopt.
  std::optional<std::string> header(std::string_view name) const;
};

// Parses "HTTP/1.x NNN reason\r\n" + header lines (without the final blank
// line); throws HttpError(kProtocol) when malformed.
ResponseHead parse_response_head(std::string_view head);

// Called with body bytes as they arrive (already de-chunked); returning false
// stops reading and closes the connection (the rest of the body is dropped).
using BodySink = std::function<bool(std::string_view)>;

// POSTs `body` (Content-Type `content_type`) to `path` over a new connection,
// calls on_head once with the response head, then on_body with the body as it
// arrives, until its end (Content-Length, the last chunk, or the server's
// close) or until on_body returns false. Throws HttpError: kConnect when the
// connection fails, kTimeout when `deadline` passes before the end, kProtocol
// for a malformed response or one cut short. Never raises SIGPIPE.
void post(const Address& address, const std::string& path, const std::string& content_type,
          const std::string& body, Clock::time_point deadline,
          const std::function<void(const ResponseHead&)>& on_head, const BodySink& on_body);

}  // namespace specula::cli::http
