// SPDX-License-Identifier: Apache-2.0
// A small HTTP/1.1 server on one epoll thread, for many concurrent streaming
// clients (docs/architecture.md says why not a thread per connection).
//
// One I/O thread owns every socket: it accepts, reads and parses requests
// (RequestParser), calls the handler, and writes responses. A handler runs on
// the I/O thread and must not block: it answers at once through its Exchange,
// or keeps the Exchange (a shared handle) and answers later from any thread.
// Writes from other threads are queued and the I/O thread is woken (eventfd).
//
// What the server enforces itself, answering with options.error_response:
//   400 malformed request line / headers, 411 a body without Content-Length
//   (chunked request bodies are refused with 411 too), 413 a Content-Length
//   over max_body_bytes, 431 headers over max_header_bytes, 408 a request not
//   received within request_timeout_s (a client sending a byte at a time gets
//   this, and nobody else waits for it), 503 past max_connections.
// Keep-alive: requests on one connection are answered in order; a new request
// is read only after the previous response has ended. Streaming responses use
// chunked transfer encoding.
// A client that closes its connection (EPOLLRDHUP / a failed write) before its
// exchange ended fires the exchange's on_close callback, on the I/O thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace specula::http {

// A parsed request. Header names are lowercased; values have surrounding
// whitespace trimmed. `path` is `target` without its query string.
struct Request {
  std::string method;
  std::string target;
  std::string path;
  std::string query;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  std::string remote;  // "127.0.0.1:54321"

  // The first header of that (lowercase) name.
  std::optional<std::string_view> header(std::string_view lower_name) const;
};

// A whole response. Content-Length is set by the server.
struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers (e.g. Retry-After)
  std::string body;
};

// One request's answer. Thread-safe; the server holds it only while the
// connection lives, so writing after the client left is a no-op returning false.
class Exchange {
 public:
  virtual ~Exchange() = default;
  // A whole response. At most one of respond / start_stream per exchange.
  virtual void respond(Response response) = 0;
  // Starts a chunked response (status and headers now, body by write()).
  virtual void start_stream(int status, std::string content_type,
                            std::vector<std::pair<std::string, std::string>> headers = {}) = 0;
  // Queues body bytes of a started stream; false once the client is gone.
  virtual bool write(std::string_view data) = 0;
  // Ends a started stream (the last chunk).
  virtual void end() = 0;
  // True once the client disconnected (or the server closed the connection).
  virtual bool closed() const = 0;
  // Called once, on the I/O thread, if the client disconnects (or the server
  // stops) before the exchange ended; called at once (on the caller's thread)
  // if already closed and not ended. Once the exchange ended the callback is
  // dropped, so it may capture the exchange itself.
  virtual void on_close(std::function<void()> callback) = 0;
};

using Handler = std::function<void(const Request&, std::shared_ptr<Exchange>)>;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port (see Server::port())
  size_t max_body_bytes = 8u << 20;
  size_t max_header_bytes = 16u << 10;
  // A request (headers and body) must arrive within this many seconds of its
  // first byte; an idle keep-alive connection is closed after idle_timeout_s.
  double request_timeout_s = 30;
  double idle_timeout_s = 60;
  int max_connections = 4096;
  // The body of the server's own error responses (400, 408, 411, 413, 431,
  // 503): given the status and a message, returns the response to send.
  std::function<Response(int status, std::string message)> error_response;
};

// Output is not flow-controlled: a stream writing faster than its client reads
// grows that connection's buffer (fine for token streams, which are small).
// While a request is being answered no timeout applies to it; a disconnect is
// what ends it early (on_close).
class Server {
 public:
  // Binds and listens now (throws specula::Error naming host:port on failure).
  Server(ServerOptions options, Handler handler);
  // Closes every socket. run() must have returned (stop() it first).
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The bound port (useful with port 0).
  int port() const;
  // Runs the I/O loop on the calling thread until stop().
  void run();
  // Stops accepting new connections (the listening socket closes); open
  // connections keep being served. Thread-safe.
  void stop_accepting();
  // Makes run() return soon, closing every connection. Thread-safe and
  // async-signal-safe (it writes to an eventfd).
  void stop();
  // Connections open now (any thread).
  size_t open_connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace specula::http
