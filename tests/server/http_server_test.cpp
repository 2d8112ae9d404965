// SPDX-License-Identifier: Apache-2.0
// The HTTP server over real loopback sockets (port 0): whole and streamed
// responses, keep-alive, disconnects, slow clients and the limits, and 300
// concurrent streams. Every wait is bounded (socket receive timeouts and
// future::wait_for with seconds of margin); nothing asserts on a sleep.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "engine/core/error.h"
#include "server/http/http_server.h"

namespace specula::http {
namespace {

using namespace std::chrono_literals;

// A blocking loopback client with a receive timeout, so a server bug fails
// the test instead of hanging it.
class Client {
 public:
  explicit Client(int port, bool expect_connect = true) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (expect_connect) {
      EXPECT_TRUE(connected_) << std::strerror(errno);
    }
  }
  ~Client() { close(); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  bool connected() const { return connected_; }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  void send(std::string_view data) {
    while (!data.empty()) {
      const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      ASSERT_GT(n, 0) << std::strerror(errno);
      data.remove_prefix(static_cast<size_t>(n));
    }
  }

  struct Reply {
    int status = 0;
    std::map<std::string, std::string> headers;  // lowercase names
    std::string body;
    std::vector<std::string> chunks;  // a chunked body's chunks, in order
  };

  // One response; status 0 if the connection ended or timed out first.
  Reply read_response() {
    Reply r;
    size_t end;
    while ((end = buf_.find("\r\n\r\n")) == std::string::npos) {
      if (!read_more()) return r;
    }
    const std::string head = buf_.substr(0, end);
    buf_.erase(0, end + 4);
    size_t line_end = head.find("\r\n");
    r.status = std::stoi(head.substr(9, 3));
    while (line_end != std::string::npos) {
      const size_t start = line_end + 2;
      line_end = head.find("\r\n", start);
      const std::string line = head.substr(start, line_end - start);
      const size_t colon = line.find(':');
      std::string name = line.substr(0, colon);
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      r.headers[name] = line.substr(colon + 2);
    }
    if (r.status < 200 || r.status == 204 || r.status == 304) return r;
    const auto te = r.headers.find("transfer-encoding");
    if (te != r.headers.end() && te->second == "chunked") {
      while (true) {
        size_t eol;
        while ((eol = buf_.find("\r\n")) == std::string::npos) {
          if (!read_more()) return Reply{};
        }
        const size_t size = std::stoul(buf_.substr(0, eol), nullptr, 16);
        while (buf_.size() < eol + 2 + size + 2) {
          if (!read_more()) return Reply{};
        }
        EXPECT_EQ(buf_.substr(eol + 2 + size, 2), "\r\n");
        if (size == 0) {
          buf_.erase(0, eol + 4);
          return r;
        }
        r.chunks.push_back(buf_.substr(eol + 2, size));
        r.body += r.chunks.back();
        buf_.erase(0, eol + 2 + size + 2);
      }
    }
    if (r.headers.count("content-length")) {
      const size_t n = std::stoul(r.headers.at("content-length"));
      while (buf_.size() < n) {
        if (!read_more()) return Reply{};
      }
      r.body = buf_.substr(0, n);
      buf_.erase(0, n);
      return r;
    }
    while (read_more()) {
    }
    r.body = std::move(buf_);
    buf_.clear();
    return r;
  }

  // Reads until `text` has arrived (after what read_response consumed).
  bool wait_for_text(std::string_view text) {
    while (buf_.find(text) == std::string::npos) {
      if (!read_more()) return false;
    }
    return true;
  }

  // Whether the server closes the connection (EOF) within the receive timeout,
  // with no further bytes.
  bool sees_eof() {
    char c;
    const ssize_t n = ::recv(fd_, &c, 1, 0);
    return n == 0 && buf_.empty();
  }

 private:
  bool read_more() {
    char tmp[16 << 10];
    const ssize_t n = ::recv(fd_, tmp, sizeof(tmp), 0);
    if (n <= 0) return false;
    buf_.append(tmp, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  bool connected_ = false;
  std::string buf_;
};

// A Server on 127.0.0.1:<any port> running on its own thread.
class Running {
 public:
  Running(ServerOptions options, Handler handler) {
    options.host = "127.0.0.1";
    options.port = 0;
    server_ = std::make_unique<Server>(std::move(options), std::move(handler));
    done_ = std::async(std::launch::async, [this] { server_->run(); });
  }
  ~Running() { stop(); }
  Server& server() { return *server_; }
  int port() const { return server_->port(); }
  // Stops the server; whether run() returned within a generous bound.
  bool stop() {
    if (!done_.valid()) return true;
    server_->stop();
    const bool returned = done_.wait_for(10s) == std::future_status::ready;
    EXPECT_TRUE(returned) << "run() did not return after stop()";
    if (returned) done_.get();
    return returned;
  }

 private:
  std::unique_ptr<Server> server_;
  std::future<void> done_;
};

std::string get(std::string_view target, std::string_view extra = "") {
  return "GET " + std::string(target) + " HTTP/1.1\r\nHost: t\r\n" + std::string(extra) + "\r\n";
}

// Answers every request with its method, path, query and remote address.
void echo(const Request& req, std::shared_ptr<Exchange> ex) {
  Response r;
  r.content_type = "text/plain";
  r.body = req.method + " " + req.path + " " + req.query + " " + req.remote + " " + req.body;
  r.headers.emplace_back("X-Extra", "1");
  ex->respond(std::move(r));
}

TEST(HttpServer, PlainResponse) {
  Running s({}, echo);
  Client c(s.port());
  c.send(get("/hello?x=1"));
  const Client::Reply r = c.read_response();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.at("content-type"), "text/plain");
  EXPECT_EQ(r.headers.at("connection"), "keep-alive");
  EXPECT_EQ(r.headers.at("x-extra"), "1");
  EXPECT_EQ(r.headers.at("content-length"), std::to_string(r.body.size()));
  EXPECT_EQ(r.body.rfind("GET /hello x=1 127.0.0.1:", 0), 0u) << r.body;
}

TEST(HttpServer, KeepAliveServesRequestsInOrderOnOneSocket) {
  Running s({}, echo);
  Client c(s.port());
  c.send(get("/one"));
  const Client::Reply one = c.read_response();
  c.send(get("/two"));
  const Client::Reply two = c.read_response();
  ASSERT_EQ(one.status, 200);
  ASSERT_EQ(two.status, 200);
  EXPECT_NE(one.body.find("/one"), std::string::npos);
  EXPECT_NE(two.body.find("/two"), std::string::npos);
  // Same connection: the same remote port.
  EXPECT_EQ(one.body.substr(one.body.rfind(':')), two.body.substr(two.body.rfind(':')));
  // Pipelined: both requests in one write, answered in order.
  c.send(get("/three") + "POST /four HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody");
  const Client::Reply three = c.read_response();
  const Client::Reply four = c.read_response();
  EXPECT_NE(three.body.find("GET /three"), std::string::npos);
  EXPECT_NE(four.body.find("POST /four"), std::string::npos);
  EXPECT_NE(four.body.find("body"), std::string::npos);
  EXPECT_EQ(s.server().open_connections(), 1u);
}

TEST(HttpServer, ConnectionCloseIsHonoured) {
  Running s({}, echo);
  Client c(s.port());
  c.send(get("/", "Connection: close\r\n"));
  const Client::Reply r = c.read_response();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.at("connection"), "close");
  EXPECT_TRUE(c.sees_eof());
}

TEST(HttpServer, EndedExchangeIsFreedEvenIfItsCallbackHoldsIt) {
  std::mutex mutex;
  std::vector<std::weak_ptr<Exchange>> seen;
  Running s({}, [&](const Request& req, std::shared_ptr<Exchange> ex) {
    ex->on_close([ex] { ex->closed(); });  // a self-reference
    {
      std::lock_guard lock(mutex);
      seen.push_back(ex);
    }
    echo(req, ex);
  });
  Client c(s.port());
  c.send(get("/1"));
  EXPECT_EQ(c.read_response().status, 200);
  // A later round trip: the loop has surely let go of the first exchange.
  c.send(get("/2"));
  EXPECT_EQ(c.read_response().status, 200);
  std::lock_guard lock(mutex);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen[0].expired());
}

TEST(HttpServer, HandlerExceptionGets500) {
  Running s({}, [](const Request&, std::shared_ptr<Exchange>) { throw Error("boom"); });
  Client c(s.port());
  c.send(get("/"));
  const Client::Reply r = c.read_response();
  EXPECT_EQ(r.status, 500);
  EXPECT_EQ(r.body, R"({"error":{"message":"boom"}})");
}

TEST(HttpServer, ExpectContinueGets100BeforeTheBody) {
  Running s({}, echo);
  Client c(s.port());
  c.send("POST /e HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n");
  EXPECT_EQ(c.read_response().status, 100);
  c.send("hello");
  const Client::Reply r = c.read_response();
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(r.body.find("hello"), std::string::npos);
}

// Streams `n` chunks from threads of its own; joins them when destroyed.
struct Streamer {
  std::mutex mutex;
  std::vector<std::thread> threads;
  ~Streamer() {
    for (auto& t : threads) t.join();
  }
  void spawn(std::function<void()> f) {
    std::lock_guard lock(mutex);
    threads.emplace_back(std::move(f));
  }
};

TEST(HttpServer, StreamedChunksFromAnotherThreadArriveInOrder) {
  Streamer streamer;
  Running s({}, [&](const Request&, std::shared_ptr<Exchange> ex) {
    ex->start_stream(200, "text/event-stream", {{"X-Stream", "yes"}});
    streamer.spawn([ex] {
      for (int i = 0; i < 10; ++i) EXPECT_TRUE(ex->write("data: " + std::to_string(i) + "\n\n"));
      ex->end();
      EXPECT_FALSE(ex->write("late"));  // after end()
    });
  });
  Client c(s.port());
  for (int round = 0; round < 2; ++round) {  // the connection stays usable after a stream
    c.send(get("/stream"));
    const Client::Reply r = c.read_response();
    ASSERT_EQ(r.status, 200);
    EXPECT_EQ(r.headers.at("transfer-encoding"), "chunked");
    EXPECT_EQ(r.headers.at("cache-control"), "no-cache");
    EXPECT_EQ(r.headers.at("content-type"), "text/event-stream");
    EXPECT_EQ(r.headers.at("x-stream"), "yes");
    EXPECT_EQ(r.headers.count("content-length"), 0u);
    ASSERT_EQ(r.chunks.size(), 10u);
    for (int i = 0; i < 10; ++i) {
      EXPECT_EQ(r.chunks[static_cast<size_t>(i)], "data: " + std::to_string(i) + "\n\n");
    }
  }
}

TEST(HttpServer, Http10StreamEndsByClosing) {
  Running s({}, [](const Request&, std::shared_ptr<Exchange> ex) {
    ex->start_stream(200, "text/plain");
    ex->write("abc");
    ex->write("def");
    ex->end();
  });
  Client c(s.port());
  c.send("GET / HTTP/1.0\r\n\r\n");
  const Client::Reply r = c.read_response();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.count("transfer-encoding"), 0u);
  EXPECT_EQ(r.headers.at("connection"), "close");
  EXPECT_EQ(r.body, "abcdef");
}

TEST(HttpServer, ClientDisconnectMidStreamFiresOnCloseOnce) {
  std::promise<std::shared_ptr<Exchange>> got_exchange;
  std::promise<void> closed;
  std::atomic<int> close_calls{0};
  std::atomic<bool> on_io_thread_ok{false};
  Running s({}, [&](const Request&, std::shared_ptr<Exchange> ex) {
    const std::thread::id io = std::this_thread::get_id();
    ex->on_close([&, io] {
      on_io_thread_ok = std::this_thread::get_id() == io;
      if (++close_calls == 1) closed.set_value();
    });
    ex->start_stream(200, "text/event-stream");
    ex->write("first");
    got_exchange.set_value(ex);
  });
  Client c(s.port());
  c.send(get("/"));
  ASSERT_TRUE(c.wait_for_text("first"));
  auto ex_future = got_exchange.get_future();
  ASSERT_EQ(ex_future.wait_for(5s), std::future_status::ready);
  const std::shared_ptr<Exchange> ex = ex_future.get();
  EXPECT_FALSE(ex->closed());
  c.close();
  ASSERT_EQ(closed.get_future().wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(on_io_thread_ok);
  EXPECT_TRUE(ex->closed());
  EXPECT_FALSE(ex->write("after"));
  ex->end();
  // A callback registered after the close runs at once, on this thread.
  bool late = false;
  ex->on_close([&] { late = true; });
  EXPECT_TRUE(late);
  EXPECT_EQ(close_calls.load(), 1);
}

TEST(HttpServer, SlowClientWithinTimeoutIsServedWhileOthersAre) {
  ServerOptions o;
  o.request_timeout_s = 30;  // far beyond the few ms the bytes take
  Running s(o, echo);
  Client slow(s.port());
  const std::string req = get("/slow");
  const size_t half = req.size() / 2;
  for (size_t i = 0; i < half; ++i) {
    slow.send(req.substr(i, 1));
    std::this_thread::sleep_for(1ms);
  }
  Client other(s.port());  // served while the slow request is half sent
  other.send(get("/fast"));
  const Client::Reply fast = other.read_response();
  EXPECT_EQ(fast.status, 200);
  EXPECT_NE(fast.body.find("/fast"), std::string::npos);
  for (size_t i = half; i < req.size(); ++i) {
    slow.send(req.substr(i, 1));
    std::this_thread::sleep_for(1ms);
  }
  const Client::Reply r = slow.read_response();
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(r.body.find("/slow"), std::string::npos);
}

TEST(HttpServer, SlowClientPastTimeoutGets408WhileOthersAreServed) {
  ServerOptions o;
  o.request_timeout_s = 0.3;
  Running s(o, echo);
  Client slow(s.port());
  slow.send("GET /sl");  // and nothing more
  Client other(s.port());
  other.send(get("/fast"));
  EXPECT_EQ(other.read_response().status, 200);
  const Client::Reply r = slow.read_response();  // within the client's 5 s timeout
  EXPECT_EQ(r.status, 408);
  EXPECT_EQ(r.headers.at("connection"), "close");
  EXPECT_NE(r.body.find("\"error\""), std::string::npos);
  EXPECT_TRUE(slow.sees_eof());
  // The other, kept-alive connection is still served.
  other.send(get("/again"));
  EXPECT_EQ(other.read_response().status, 200);
}

TEST(HttpServer, IdleKeepAliveConnectionIsClosed) {
  ServerOptions o;
  o.idle_timeout_s = 0.2;
  Running s(o, echo);
  Client c(s.port());
  c.send(get("/"));
  EXPECT_EQ(c.read_response().status, 200);
  EXPECT_TRUE(c.sees_eof());
}

TEST(HttpServer, PayloadTooLargeWithCustomErrorBody) {
  ServerOptions o;
  o.max_body_bytes = 100;
  o.error_response = [](int status, std::string message) {
    Response r;
    r.status = status;
    r.content_type = "text/plain";
    r.body = "custom " + std::to_string(status) + ": " + message;
    return r;
  };
  std::atomic<bool> handled{false};
  Running s(o, [&](const Request& req, std::shared_ptr<Exchange> ex) {
    handled = true;
    echo(req, ex);
  });
  Client c(s.port());
  // The body follows at once: the server decides from Content-Length, and its
  // graceful close keeps the unread body from resetting the answer away.
  c.send("POST /big HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" + std::string(5000, 'x'));
  const Client::Reply r = c.read_response();
  EXPECT_EQ(r.status, 413);
  EXPECT_EQ(r.headers.at("content-type"), "text/plain");
  EXPECT_EQ(r.headers.at("connection"), "close");
  EXPECT_EQ(r.body.rfind("custom 413: ", 0), 0u) << r.body;
  EXPECT_TRUE(c.sees_eof());
  EXPECT_FALSE(handled);
}

TEST(HttpServer, MalformedRequestGets400AndClose) {
  Running s({}, echo);
  Client c(s.port());
  c.send("NOT HTTP AT ALL\r\n\r\n");
  const Client::Reply r = c.read_response();
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.headers.at("content-type"), "application/json");
  EXPECT_TRUE(c.sees_eof());
}

TEST(HttpServer, PastMaxConnectionsGets503) {
  ServerOptions o;
  o.max_connections = 1;
  Running s(o, echo);
  Client first(s.port());
  first.send(get("/"));
  EXPECT_EQ(first.read_response().status, 200);  // now surely accepted
  Client second(s.port());
  const Client::Reply r = second.read_response();
  EXPECT_EQ(r.status, 503);
  EXPECT_TRUE(second.sees_eof());
  first.send(get("/"));
  EXPECT_EQ(first.read_response().status, 200);
}

TEST(HttpServer, ThreeHundredConcurrentStreams) {
  constexpr size_t kClients = 300;
  constexpr int kChunks = 3;
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<std::shared_ptr<Exchange>> pending;
  Running s({}, [&](const Request&, std::shared_ptr<Exchange> ex) {
    ex->start_stream(200, "text/event-stream");
    std::lock_guard lock(mutex);
    pending.push_back(std::move(ex));
    cv.notify_one();
  });
  // One producer streams to every client at once, as a batched engine would,
  // starting when all are connected (so all 300 are open together).
  size_t open_at_start = 0;
  std::thread producer([&] {
    std::vector<std::shared_ptr<Exchange>> all;
    {
      std::unique_lock lock(mutex);
      cv.wait_for(lock, 20s, [&] { return pending.size() == kClients; });
      all = pending;
    }
    open_at_start = s.server().open_connections();
    for (int i = 0; i < kChunks; ++i) {
      for (auto& ex : all) ex->write("event " + std::to_string(i) + "\n");
    }
    for (auto& ex : all) ex->end();
  });
  std::vector<std::unique_ptr<Client>> clients;
  for (size_t i = 0; i < kClients; ++i) {
    clients.push_back(std::make_unique<Client>(s.port()));
    clients.back()->send(get("/s" + std::to_string(i)));
  }
  size_t complete = 0;
  for (auto& c : clients) {
    const Client::Reply r = c->read_response();
    complete += r.status == 200 && r.body == "event 0\nevent 1\nevent 2\n";
  }
  producer.join();
  EXPECT_EQ(complete, kClients);
  EXPECT_EQ(open_at_start, kClients);
}

TEST(HttpServer, StopEndsRunAndClosesPendingExchanges) {
  std::promise<void> started;
  std::promise<void> closed;
  auto s =
      std::make_unique<Running>(ServerOptions{}, [&](const Request&, std::shared_ptr<Exchange> ex) {
        ex->on_close([&] { closed.set_value(); });
        ex->start_stream(200, "text/plain");
        started.set_value();
      });
  Client idle(s->port());
  Client streaming(s->port());
  streaming.send(get("/"));
  ASSERT_EQ(started.get_future().wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(s->stop());
  EXPECT_EQ(closed.get_future().wait_for(0s), std::future_status::ready);
  EXPECT_EQ(s->server().open_connections(), 0u);
  EXPECT_TRUE(idle.sees_eof());
}

TEST(HttpServer, StopBeforeRunReturnsAtOnce) {
  Server server({.host = "127.0.0.1", .port = 0}, echo);
  server.stop();
  auto done = std::async(std::launch::async, [&] { server.run(); });
  EXPECT_EQ(done.wait_for(5s), std::future_status::ready);
}

TEST(HttpServer, StopAcceptingKeepsServingOpenConnections) {
  Running s({}, echo);
  Client open(s.port());
  open.send(get("/"));
  EXPECT_EQ(open.read_response().status, 200);
  s.server().stop_accepting();
  // The listening socket closes on the loop's next turn: wait (bounded) for a
  // refused connection.
  bool refused = false;
  for (int i = 0; i < 500 && !refused; ++i) {
    Client probe(s.port(), /*expect_connect=*/false);
    refused = !probe.connected();
    if (!refused) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(refused);
  open.send(get("/still"));
  EXPECT_EQ(open.read_response().status, 200);
}

TEST(HttpServer, BindFailureNamesHostAndPort) {
  Server first({.host = "127.0.0.1", .port = 0}, echo);
  const std::string where = "127.0.0.1:" + std::to_string(first.port());
  try {
    Server second({.host = "127.0.0.1", .port = first.port()}, echo);
    FAIL() << "binding a port in use should throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(where), std::string::npos) << e.what();
  }
}

TEST(HttpServer, LocalhostBinds) {
  Server server({.host = "localhost", .port = 0}, echo);
  EXPECT_GT(server.port(), 0);
}

}  // namespace
}  // namespace specula::http
