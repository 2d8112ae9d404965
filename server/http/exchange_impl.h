// SPDX-License-Identifier: Apache-2.0
// The server's side of an Exchange (internal to specula_http): the bytes a
// handler's answer turns into, queued until the I/O thread moves them to the
// connection's socket.
//
// Threading: a handler may call respond/start_stream/write/end from any
// thread. Each call formats the bytes under the exchange's mutex and, the
// first time since the I/O thread last drained it, puts the exchange on the
// Hub's ready list and wakes the loop through the eventfd. Only the I/O thread
// drains (take_output) and closes (mark_closed).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/http/http_server.h"

namespace specula::http::detail {

class ExchangeImpl;

// What exchanges share with the I/O loop; kept alive by every exchange, so a
// handler thread holding one after the Server is gone touches only this.
struct Hub {
  int event_fd = -1;  // owned by the Server; -1 once it is closed
  std::mutex mutex;
  bool alive = true;                                 // false once the Server is destroyed
  std::vector<std::shared_ptr<ExchangeImpl>> ready;  // exchanges with new output
  bool signalled = false;                            // an eventfd write is pending

  // Queues `exchange` for the I/O thread and wakes it (any thread).
  void post(std::shared_ptr<ExchangeImpl> exchange);
  // Wakes the loop without queueing (async-signal-safe: only write(2)).
  static void wake(int event_fd);
};

// The reason phrase of a status code ("Not Found"); "Unknown" for others.
std::string_view reason_phrase(int status);

// The default error body: {"error":{"message":"..."}} with JSON escaping.
Response default_error_response(int status, std::string message);

// The head and body of a whole response. `keep_alive` picks the Connection
// header; `head_only` (a HEAD request) leaves the body out.
std::string format_response(const Response& response, bool keep_alive, bool head_only);

class ExchangeImpl final : public Exchange, public std::enable_shared_from_this<ExchangeImpl> {
 public:
  // `conn_id` names the connection (ids are never reused, unlike fds).
  // `keep_alive`: whether the client asked for it; `http10`: an HTTP/1.0
  // request (a stream then ends by closing); `head_only`: a HEAD request.
  ExchangeImpl(std::shared_ptr<Hub> hub, uint64_t conn_id, bool keep_alive, bool http10,
               bool head_only);

  void respond(Response response) override;
  void start_stream(int status, std::string content_type,
                    std::vector<std::pair<std::string, std::string>> headers = {}) override;
  bool write(std::string_view data) override;
  void end() override;
  bool closed() const override;
  void on_close(std::function<void()> callback) override;

  uint64_t conn_id() const { return conn_id_; }

  // I/O thread: what the handler produced since the last call, appended to
  // `out`. Returns whether the response has ended (all its bytes now taken).
  bool take_output(std::string& out);
  // I/O thread, after take_output returned true: whether the connection must
  // close after these bytes (the client or the response asked for it).
  bool close_after() const;
  // Whether respond or start_stream was called (a handler that threw before
  // either gets a 500).
  bool started() const;
  // I/O thread: the connection is gone. Runs the on_close callback if the
  // exchange had not ended (on this thread, no lock held).
  void mark_closed();

 private:
  // Queues this exchange on the hub if it is not queued already; call after
  // appending to out_ with the lock released.
  void notify(bool need_post);

  const std::shared_ptr<Hub> hub_;
  const uint64_t conn_id_;
  const bool keep_alive_, http10_, head_only_;

  mutable std::mutex mutex_;
  std::string out_;           // formatted bytes not yet taken by the I/O thread
  bool started_ = false;      // respond or start_stream happened
  bool streaming_ = false;    // start_stream happened
  bool chunked_ = false;      // the stream uses chunked encoding (not HTTP/1.0)
  bool ended_ = false;        // respond or end happened
  bool close_after_ = false;  // the response said Connection: close
  bool closed_ = false;       // the connection is gone
  bool queued_ = false;       // on the hub's ready list
  // Dropped when the exchange ends (it can no longer run), so a callback that
  // captures its own exchange does not keep it alive in a cycle.
  std::function<void()> on_close_;
};

}  // namespace specula::http::detail
