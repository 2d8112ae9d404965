// SPDX-License-Identifier: Apache-2.0
// Server: the epoll loop (see http_server.h for the contract).
//
// Everything here runs on the I/O thread except the constructor, the
// destructor, port(), stop(), stop_accepting() and open_connections(). The
// loop is level-triggered: a connection's interest set says what it waits for
// (input while it may read, output while bytes are queued, always RDHUP), and
// no call in the loop blocks. Other threads reach it only through the Hub
// (exchange output) and the atomics below, each followed by an eventfd write.
//
// A connection's life: read and parse a request; hand it to the handler with
// an Exchange; move the exchange's output to the socket as it comes; when the
// response ended and went out, either read the next request (bytes that
// arrived meanwhile are kept) or close. Closing after a response is graceful:
// shut the write side, then discard input until the client closes or a short
// linger ends, so that a client still sending does not get a reset that would
// destroy the response in its receive buffer.
#include <fmt/format.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <unordered_map>

#include "engine/core/error.h"
#include "server/http/exchange_impl.h"
#include "server/http/http_server.h"
#include "server/http/request_parser.h"

namespace specula::http {

namespace {

using Clock = std::chrono::steady_clock;
using detail::ExchangeImpl;

// epoll_data ids of the two non-connection descriptors; connections count
// up from kFirstConnId.
constexpr uint64_t kListenId = 0, kEventId = 1, kFirstConnId = 2;
// While a request is being answered, input for the next one is buffered up to
// this much; then reading pauses (RDHUP still reports a disconnect).
constexpr size_t kMaxBufferedInput = 64u << 10;
// At most this much is read from one connection per wake-up, so one fast
// sender cannot starve the others (level-triggered epoll comes back to it).
constexpr size_t kMaxReadPerEvent = 1u << 20;
// How long a closing connection may take to drain its last response and to
// close its side after ours (error responses, Connection: close, 503s).
constexpr auto kLinger = std::chrono::seconds(2);
// How often the timers are checked (also the longest epoll_wait).
constexpr int kTickMs = 100;

std::string describe_errno(int err) {
  return std::strerror(err);
}

std::string address_string(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
    std::string out =
        "[";  // (built piecewise: "[" + string trips a GCC 12 -Wrestrict false positive)
    out += host;
    out += "]:";
    out += std::to_string(port);
    return out;
  }
  return "?";
}

}  // namespace

struct Server::Impl {
  // One client connection; touched only by the I/O thread.
  struct Connection {
    int fd = -1;
    uint64_t id = 0;
    std::string remote;
    RequestParser parser;
    std::string in;   // received bytes the parser has not consumed
    std::string out;  // bytes to send, from out_off on
    size_t out_off = 0;
    std::shared_ptr<ExchangeImpl> exchange;  // the request being answered
    bool response_done = false;              // the exchange ended; all its bytes are in `out`
    bool close_after = false;                // close once `out` is sent
    bool closing = false;                    // nothing more is read as requests; input is discarded
    bool write_shut = false;     // shutdown(SHUT_WR) done, waiting for the client's close
    bool continue_sent = false;  // "100 Continue" went out for the current request
    bool timing = false;         // a request has started arriving (request_start valid)
    uint32_t events = 0;         // the epoll interest set now
    Clock::time_point request_start, idle_since, close_deadline;

    Connection(size_t max_header, size_t max_body) : parser(max_header, max_body) {}
  };

  ServerOptions options;
  Handler handler;
  int listen_fd = -1, epoll_fd = -1, event_fd = -1;
  int bound_port = 0;
  std::shared_ptr<detail::Hub> hub = std::make_shared<detail::Hub>();
  std::atomic<bool> stop_requested{false};
  std::atomic<bool> stop_accepting_requested{false};
  std::atomic<size_t> open_count{0};
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> conns;
  uint64_t next_id = kFirstConnId;
  bool accept_paused = false;
  Clock::time_point accept_resume;

  ~Impl() {
    {
      std::lock_guard lock(hub->mutex);
      hub->alive = false;
      hub->ready.clear();
      hub->event_fd = -1;
    }
    for (auto& [id, c] : conns) ::close(c->fd);
    if (listen_fd >= 0) ::close(listen_fd);
    if (epoll_fd >= 0) ::close(epoll_fd);
    if (event_fd >= 0) ::close(event_fd);
  }

  // --- setup ---

  void bind_and_listen() {
    const std::string where = options.host + ":" + std::to_string(options.port);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string port_text = std::to_string(options.port);
    if (const int rc = ::getaddrinfo(options.host.c_str(), port_text.c_str(), &hints, &found)) {
      fail("cannot listen on {}: {}", where, ::gai_strerror(rc));
    }
    // IPv4 first: "localhost" often resolves to ::1 first, and clients told
    // 127.0.0.1 are the more common case.
    std::vector<addrinfo*> candidates;
    for (addrinfo* a = found; a; a = a->ai_next) candidates.push_back(a);
    std::stable_partition(candidates.begin(), candidates.end(),
                          [](addrinfo* a) { return a->ai_family == AF_INET; });
    int err = EADDRNOTAVAIL;
    for (addrinfo* a : candidates) {
      const int fd =
          ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) {
        err = errno;
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
        listen_fd = fd;
        break;
      }
      err = errno;
      ::close(fd);
    }
    ::freeaddrinfo(found);
    if (listen_fd < 0) fail("cannot listen on {}: {}", where, describe_errno(err));
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
    bound_port = addr.ss_family == AF_INET6
                     ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                     : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);

    epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
    if (epoll_fd < 0) fail("cannot listen on {}: epoll_create1: {}", where, describe_errno(errno));
    event_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (event_fd < 0) fail("cannot listen on {}: eventfd: {}", where, describe_errno(errno));
    hub->event_fd = event_fd;
    add_fd(listen_fd, kListenId, EPOLLIN);
    add_fd(event_fd, kEventId, EPOLLIN);
  }

  void add_fd(int fd, uint64_t id, uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    if (::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
      fail("epoll_ctl(ADD) failed: {}", describe_errno(errno));
    }
  }

  // --- the loop ---

  void run() {
    std::vector<epoll_event> events(256);
    Clock::time_point last_tick = Clock::now();
    while (!stop_requested.load(std::memory_order_acquire)) {
      if (stop_accepting_requested.load(std::memory_order_acquire) && listen_fd >= 0) {
        ::close(listen_fd);  // also leaves the epoll set
        listen_fd = -1;
      }
      const int n = ::epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()), kTickMs);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail("epoll_wait failed: {}", describe_errno(errno));
      }
      for (int i = 0; i < n; ++i) {
        const uint64_t id = events[static_cast<size_t>(i)].data.u64;
        const uint32_t ev = events[static_cast<size_t>(i)].events;
        if (id == kEventId) {
          uint64_t count;
          while (::read(event_fd, &count, sizeof(count)) < 0 && errno == EINTR) {
          }
        } else if (id == kListenId) {
          accept_all();
        } else if (Connection* c = find(id)) {
          on_event(*c, ev);
        }
      }
      take_ready();
      const Clock::time_point now = Clock::now();
      if (now - last_tick >= std::chrono::milliseconds(kTickMs / 2)) {
        last_tick = now;
        check_timers(now);
      }
    }
    shut_down();
  }

  Connection* find(uint64_t id) {
    const auto it = conns.find(id);
    return it == conns.end() ? nullptr : it->second.get();
  }

  void accept_all() {
    while (listen_fd >= 0) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      const int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors: the pending connection would wake a
          // level-triggered loop forever; stop listening for a tick.
          ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, listen_fd, nullptr);
          accept_paused = true;
          accept_resume = Clock::now() + std::chrono::milliseconds(kTickMs);
        }
        return;  // EAGAIN: none left
      }
      // Small writes (SSE events, chunks) go out at once instead of waiting
      // for Nagle's algorithm to coalesce them with the next one.
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      auto owned = std::make_unique<Connection>(options.max_header_bytes, options.max_body_bytes);
      Connection& c = *owned;
      c.fd = fd;
      c.id = next_id++;
      c.remote = address_string(reinterpret_cast<sockaddr*>(&addr));
      c.idle_since = Clock::now();
      const bool over = conns.size() >= static_cast<size_t>(std::max(options.max_connections, 0));
      c.events = EPOLLIN | EPOLLRDHUP;
      epoll_event ev{};
      ev.events = c.events;
      ev.data.u64 = c.id;
      if (::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        ::close(fd);
        continue;
      }
      conns.emplace(c.id, std::move(owned));
      open_count.store(conns.size(), std::memory_order_relaxed);
      if (over) send_error(c, 503, "too many connections; retry later");
    }
  }

  void on_event(Connection& c, uint32_t ev) {
    if (ev & EPOLLERR) return close_connection(c);
    if (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP)) {
      if (!read_input(c)) return;
      // A peer that shut its side while we answer has gone (a half-closed
      // client counts as disconnected: see http_server.h).
      if ((ev & (EPOLLRDHUP | EPOLLHUP)) && (c.exchange || c.closing)) return close_connection(c);
    }
    if (ev & EPOLLOUT) {
      if (!flush(c)) return;
      if (c.response_done && c.out.empty() && !finish_response(c)) return;
      // An error response that did not fit the socket at once is out now.
      if (c.closing && !c.write_shut && c.out.empty() && !begin_close(c)) return;
    }
    if (!c.exchange && !c.closing && !process_input(c)) return;
    update_interest(c);
  }

  // Reads what is available. False if the connection was closed.
  bool read_input(Connection& c) {
    char buf[64 << 10];
    size_t total = 0;
    while (total < kMaxReadPerEvent) {
      if (c.exchange && !c.closing && c.in.size() >= kMaxBufferedInput) break;
      const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
      if (n > 0) {
        total += static_cast<size_t>(n);
        if (!c.closing) c.in.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n == 0) {
        close_connection(c);
        return false;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      close_connection(c);
      return false;
    }
    return true;
  }

  // Parses buffered input while no request is being answered, dispatching each
  // complete request. False if the connection was closed.
  bool process_input(Connection& c) {
    while (!c.exchange && !c.closing) {
      const size_t used = c.parser.feed(c.in);
      c.in.erase(0, used);
      if (c.parser.started() && !c.timing) {
        c.timing = true;
        c.request_start = Clock::now();
      }
      switch (c.parser.state()) {
        case RequestParser::State::kNeedMore:
          if (c.parser.expects_continue() && !c.continue_sent) {
            c.continue_sent = true;
            c.out += "HTTP/1.1 100 Continue\r\n\r\n";
            return flush(c);
          }
          return true;
        case RequestParser::State::kError:
          return send_error(c, c.parser.error_status(), c.parser.error_message());
        case RequestParser::State::kComplete:
          if (!dispatch(c)) return false;
          break;
      }
    }
    return true;
  }

  // Runs the handler on the request the parser completed. False if the
  // connection was closed.
  bool dispatch(Connection& c) {
    Request request = c.parser.take();
    request.remote = c.remote;
    auto exchange = std::make_shared<ExchangeImpl>(hub, c.id, c.parser.keep_alive(),
                                                   c.parser.http10(), request.method == "HEAD");
    c.exchange = exchange;
    c.response_done = false;
    c.timing = false;
    try {
      handler(request, exchange);
    } catch (const std::exception& e) {
      if (!exchange->started()) exchange->respond(error_response(500, e.what()));
    } catch (...) {
      if (!exchange->started()) exchange->respond(error_response(500, "handler failed"));
    }
    return pump(c);
  }

  // Moves the current exchange's new output to the socket. False if the
  // connection was closed.
  bool pump(Connection& c) {
    if (!c.exchange || c.response_done) return true;
    if (c.exchange->take_output(c.out)) {
      c.response_done = true;
      c.close_after = c.exchange->close_after();
    }
    if (!flush(c)) return false;
    if (c.response_done && c.out.empty()) return finish_response(c);
    return true;
  }

  // The response went out whole: ready the next request, or close. False if
  // the connection was closed.
  bool finish_response(Connection& c) {
    std::shared_ptr<ExchangeImpl> done = std::move(c.exchange);
    c.exchange.reset();
    c.response_done = false;
    if (c.close_after) {
      done->mark_closed();  // closed() turns true; on_close does not fire (it ended)
      return begin_close(c);
    }
    c.parser.reset();
    c.continue_sent = false;
    c.timing = false;
    c.idle_since = Clock::now();
    return true;
  }

  Response error_response(int status, std::string message) {
    if (options.error_response) {
      try {
        return options.error_response(status, message);
      } catch (...) {
        // A failing formatter still gets the client an answer.
      }
    }
    return detail::default_error_response(status, std::move(message));
  }

  // Answers with the server's own error and closes. False if the connection
  // was closed already.
  bool send_error(Connection& c, int status, std::string message) {
    c.out += detail::format_response(error_response(status, std::move(message)),
                                     /*keep_alive=*/false, /*head_only=*/false);
    c.closing = true;
    c.in.clear();
    c.close_deadline = Clock::now() + kLinger;
    if (!flush(c)) return false;
    if (c.out.empty()) return begin_close(c);
    update_interest(c);
    return true;
  }

  // The last response is sent: shut our side and wait (bounded) for the
  // client's close, discarding its input. False if closed at once.
  bool begin_close(Connection& c) {
    if (!c.closing) c.close_deadline = Clock::now() + kLinger;
    c.closing = true;
    c.in.clear();
    if (::shutdown(c.fd, SHUT_WR) != 0) {
      close_connection(c);
      return false;
    }
    c.write_shut = true;
    update_interest(c);
    return true;
  }

  // Sends queued output until done or EAGAIN. False if the connection was
  // closed (a write error: the client is gone).
  bool flush(Connection& c) {
    while (c.out_off < c.out.size()) {
      const ssize_t n =
          ::send(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
      if (n >= 0) {
        c.out_off += static_cast<size_t>(n);
        continue;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      close_connection(c);  // EPIPE, ECONNRESET, ...
      return false;
    }
    if (c.out_off == c.out.size()) {
      c.out.clear();
      c.out_off = 0;
    } else if (c.out_off > (1u << 20) && c.out_off > c.out.size() / 2) {
      c.out.erase(0, c.out_off);  // bounded memory for a long stream to a slow reader
      c.out_off = 0;
    }
    return true;
  }

  void update_interest(Connection& c) {
    uint32_t want = EPOLLRDHUP;
    const bool paused = c.exchange && !c.closing && c.in.size() >= kMaxBufferedInput;
    if (!paused) want |= EPOLLIN;
    if (!c.out.empty()) want |= EPOLLOUT;
    if (want == c.events) return;
    epoll_event ev{};
    ev.events = want;
    ev.data.u64 = c.id;
    if (::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c.fd, &ev) == 0) c.events = want;
  }

  // Closes the socket and forgets the connection; an exchange still pending
  // sees closed() and its on_close runs. `c` is gone afterwards.
  void close_connection(Connection& c) {
    std::shared_ptr<ExchangeImpl> exchange = std::move(c.exchange);
    ::close(c.fd);  // also leaves the epoll set
    conns.erase(c.id);
    open_count.store(conns.size(), std::memory_order_relaxed);
    if (exchange) exchange->mark_closed();
  }

  // Exchanges with new output (from any thread, or a handler on this one).
  void take_ready() {
    std::vector<std::shared_ptr<ExchangeImpl>> ready;
    {
      std::lock_guard lock(hub->mutex);
      ready.swap(hub->ready);
      hub->signalled = false;
    }
    for (const auto& exchange : ready) {
      Connection* c = find(exchange->conn_id());
      if (!c || c->exchange != exchange) continue;  // its connection is gone
      if (!pump(*c)) continue;
      if (!c->exchange && !c->closing && !process_input(*c)) continue;
      update_interest(*c);
    }
  }

  void check_timers(Clock::time_point now) {
    if (accept_paused && now >= accept_resume && listen_fd >= 0) {
      accept_paused = false;
      add_fd(listen_fd, kListenId, EPOLLIN);
    }
    const auto request_timeout = std::chrono::duration<double>(options.request_timeout_s);
    const auto idle_timeout = std::chrono::duration<double>(options.idle_timeout_s);
    std::vector<uint64_t> expired_requests, to_close;
    for (const auto& [id, c] : conns) {
      if (c->closing) {
        if (now >= c->close_deadline) to_close.push_back(id);
      } else if (c->exchange) {
        // The handler's time: a disconnect is what ends it early.
      } else if (c->timing) {
        if (now - c->request_start > request_timeout) expired_requests.push_back(id);
      } else if (c->out.empty() && now - c->idle_since > idle_timeout) {
        to_close.push_back(id);
      }
    }
    for (uint64_t id : expired_requests) {
      if (Connection* c = find(id)) {
        send_error(*c, 408,
                   fmt::format("request not received within {:g} s", options.request_timeout_s));
      }
    }
    for (uint64_t id : to_close) {
      if (Connection* c = find(id)) close_connection(*c);
    }
  }

  void shut_down() {
    if (listen_fd >= 0) {
      ::close(listen_fd);
      listen_fd = -1;
    }
    while (!conns.empty()) close_connection(*conns.begin()->second);
    std::lock_guard lock(hub->mutex);
    hub->ready.clear();
  }
};

Server::Server(ServerOptions options, Handler handler) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->handler = std::move(handler);
  impl_->bind_and_listen();
}

Server::~Server() = default;

int Server::port() const {
  return impl_->bound_port;
}

void Server::run() {
  impl_->run();
}

void Server::stop_accepting() {
  impl_->stop_accepting_requested.store(true, std::memory_order_release);
  detail::Hub::wake(impl_->event_fd);
}

void Server::stop() {
  impl_->stop_requested.store(true, std::memory_order_release);
  detail::Hub::wake(impl_->event_fd);
}

size_t Server::open_connections() const {
  return impl_->open_count.load(std::memory_order_relaxed);
}

}  // namespace specula::http
