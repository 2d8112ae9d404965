// SPDX-License-Identifier: Apache-2.0
// RequestParser: whole and byte-by-byte input, pipelining, framing errors and
// the limits, each mapped to the status the server answers with.
#include <gtest/gtest.h>

#include <string>
#include <string_view>

#include "server/http/request_parser.h"

namespace specula::http {
namespace {

using State = RequestParser::State;

constexpr std::string_view kPost =
    "POST /v1/chat/completions?stream=1&x=y HTTP/1.1\r\n"
    "Host: localhost\r\n"
    "Content-Type:  application/json \r\n"
    "X-Mixed-CASE: Value\r\n"
    "Content-Length: 11\r\n"
    "\r\n"
    "{\"a\":\"bcd\"}";

// Feeds everything in pieces of `step` bytes; returns the bytes consumed.
size_t feed_in_steps(RequestParser& p, std::string_view bytes, size_t step) {
  size_t used = 0;
  while (used < bytes.size() && p.state() == State::kNeedMore) {
    const size_t n = std::min(step, bytes.size() - used);
    const size_t u = p.feed(bytes.substr(used, n));
    used += u;
    if (u < n) break;
  }
  return used;
}

void expect_post(Request r) {
  EXPECT_EQ(r.method, "POST");
  EXPECT_EQ(r.target, "/v1/chat/completions?stream=1&x=y");
  EXPECT_EQ(r.path, "/v1/chat/completions");
  EXPECT_EQ(r.query, "stream=1&x=y");
  EXPECT_EQ(r.body, "{\"a\":\"bcd\"}");
  EXPECT_EQ(r.header("content-type"), "application/json");
  EXPECT_EQ(r.header("x-mixed-case"), "Value");
  EXPECT_EQ(r.header("host"), "localhost");
  EXPECT_FALSE(r.header("missing").has_value());
}

TEST(HttpParser, WholeRequestInOnePiece) {
  RequestParser p(16 << 10, 1 << 20);
  EXPECT_FALSE(p.started());
  EXPECT_EQ(p.feed(kPost), kPost.size());
  ASSERT_EQ(p.state(), State::kComplete);
  EXPECT_TRUE(p.keep_alive());
  EXPECT_FALSE(p.http10());
  expect_post(p.take());
}

TEST(HttpParser, ByteByByte) {
  RequestParser p(16 << 10, 1 << 20);
  EXPECT_EQ(feed_in_steps(p, kPost, 1), kPost.size());
  EXPECT_TRUE(p.started());
  ASSERT_EQ(p.state(), State::kComplete);
  expect_post(p.take());
}

TEST(HttpParser, EveryTwoWaySplit) {
  for (size_t cut = 0; cut <= kPost.size(); ++cut) {
    RequestParser p(16 << 10, 1 << 20);
    size_t used = p.feed(kPost.substr(0, cut));
    used += p.feed(kPost.substr(used));
    ASSERT_EQ(used, kPost.size()) << "cut at " << cut;
    ASSERT_EQ(p.state(), State::kComplete) << "cut at " << cut;
    expect_post(p.take());
  }
}

TEST(HttpParser, PipelinedRequestsAreConsumedOneAtATime) {
  const std::string first = "GET /a HTTP/1.1\r\nHost: x\r\n\r\n";
  const std::string second =
      "POST /b HTTP/1.1\r\nContent-Length: 3\r\nConnection: close\r\n\r\nxyz";
  const std::string both = first + second;
  RequestParser p(16 << 10, 1 << 20);
  const size_t used = p.feed(both);
  EXPECT_EQ(used, first.size());
  ASSERT_EQ(p.state(), State::kComplete);
  EXPECT_EQ(p.feed("more"), 0u);  // nothing until reset()
  Request a = p.take();
  EXPECT_EQ(a.path, "/a");
  EXPECT_EQ(a.body, "");
  EXPECT_TRUE(p.keep_alive());
  p.reset();
  EXPECT_FALSE(p.started());
  EXPECT_EQ(p.feed(std::string_view(both).substr(used)), second.size());
  ASSERT_EQ(p.state(), State::kComplete);
  EXPECT_FALSE(p.keep_alive());
  Request b = p.take();
  EXPECT_EQ(b.path, "/b");
  EXPECT_EQ(b.body, "xyz");
}

TEST(HttpParser, LineFeedLineEndsAndLeadingBlankLines) {
  RequestParser p(16 << 10, 1 << 20);
  const std::string_view req = "\r\n\nGET / HTTP/1.1\nA: b\n\n";
  EXPECT_EQ(p.feed(req), req.size());
  ASSERT_EQ(p.state(), State::kComplete);
  EXPECT_EQ(p.take().header("a"), "b");
}

TEST(HttpParser, Http10KeepAliveOnlyWhenAsked) {
  RequestParser p(16 << 10, 1 << 20);
  p.feed("GET / HTTP/1.0\r\n\r\n");
  ASSERT_EQ(p.state(), State::kComplete);
  EXPECT_TRUE(p.http10());
  EXPECT_FALSE(p.keep_alive());
  p.reset();
  p.feed("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n");
  ASSERT_EQ(p.state(), State::kComplete);
  EXPECT_TRUE(p.keep_alive());
  p.reset();
  p.feed("GET / HTTP/1.1\r\nConnection: upgrade, CLOSE\r\n\r\n");
  ASSERT_EQ(p.state(), State::kComplete);
  EXPECT_FALSE(p.keep_alive());
}

TEST(HttpParser, ExpectContinueIsReportedBeforeTheBody) {
  RequestParser p(16 << 10, 1 << 20);
  p.feed("POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n");
  EXPECT_EQ(p.state(), State::kNeedMore);
  EXPECT_TRUE(p.expects_continue());
  p.feed("ok");
  EXPECT_EQ(p.state(), State::kComplete);
  EXPECT_FALSE(p.expects_continue());
}

// The status a whole request gets (0 when it parses).
int status_of(std::string_view request, size_t max_header = 1024, size_t max_body = 100) {
  RequestParser p(max_header, max_body);
  p.feed(request);
  if (p.state() == State::kError) {
    EXPECT_FALSE(p.error_message().empty());
    return p.error_status();
  }
  EXPECT_EQ(p.state(), State::kComplete) << request;
  return 0;
}

TEST(HttpParser, ContentLengthRules) {
  // A POST without a length cannot be framed.
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\n\r\n"), 411);
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\n\r\n"), 0);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"), 0);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length: abc\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length: 1 2\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length:\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n"), 400);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab"), 0);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"), 411);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n"), 501);
}

TEST(HttpParser, BodyLimitDecidedFromContentLength) {
  // 413 before any body byte arrived.
  RequestParser p(1024, 100);
  p.feed("POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n");
  ASSERT_EQ(p.state(), State::kError);
  EXPECT_EQ(p.error_status(), 413);
  EXPECT_EQ(status_of("POST / HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + std::string(100, 'x')), 0);
}

TEST(HttpParser, HeaderLimit) {
  const std::string big = "GET / HTTP/1.1\r\nX: " + std::string(2000, 'a') + "\r\n\r\n";
  EXPECT_EQ(status_of(big, 1024), 431);
  // Also when the head never ends: the parser holds at most the limit.
  RequestParser p(1024, 100);
  const std::string endless = "GET / HTTP/1.1\r\nX: " + std::string(5000, 'a');
  feed_in_steps(p, endless, 7);
  ASSERT_EQ(p.state(), State::kError);
  EXPECT_EQ(p.error_status(), 431);
  EXPECT_EQ(status_of(big, 4096), 0);
}

TEST(HttpParser, BadRequestLines) {
  EXPECT_EQ(status_of("GARBAGE\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET /\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET  / HTTP/1.1\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET / HTTP/1.1 extra\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET nopath HTTP/1.1\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET /a\x01 HTTP/1.1\r\n\r\n"), 400);
  EXPECT_EQ(status_of("G(T / HTTP/1.1\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET / HTTP/x.y\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET / HTTP/2.0\r\n\r\n"), 505);
  EXPECT_EQ(status_of("BREW / HTTP/1.1\r\n\r\n"), 501);
  // Detected from the first line, before the head ends.
  RequestParser p(1024, 100);
  p.feed("BAD\r\nHost: x\r\n");
  EXPECT_EQ(p.state(), State::kError);
  EXPECT_EQ(p.error_status(), 400);
}

TEST(HttpParser, BadHeaders) {
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\nNoColon\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\nBad Name: x\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\n: x\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n"), 400);
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\nA: b\rc\r\n\r\n"), 400);
  using namespace std::string_literals;
  EXPECT_EQ(status_of("GET / HTTP/1.1\r\nA: b\0c\r\n\r\n"s), 400);
}

TEST(HttpParser, HeaderLookupIsByLowercaseNameFirstWins) {
  RequestParser p(1024, 100);
  p.feed("GET /p?q HTTP/1.1\r\nACCEPT: a\r\naccept: b\r\nEmpty:\r\n\r\n");
  ASSERT_EQ(p.state(), State::kComplete);
  const Request r = p.take();
  EXPECT_EQ(r.header("accept"), "a");
  EXPECT_EQ(r.header("empty"), "");
  EXPECT_EQ(r.path, "/p");
  EXPECT_EQ(r.query, "q");
  ASSERT_EQ(r.headers.size(), 3u);
  EXPECT_EQ(r.headers[0].first, "accept");
}

TEST(HttpParser, QuerySplitOnFirstQuestionMark) {
  RequestParser p(1024, 100);
  p.feed("GET /a/b?c=d?e HTTP/1.1\r\n\r\n");
  ASSERT_EQ(p.state(), State::kComplete);
  Request r = p.take();
  EXPECT_EQ(r.path, "/a/b");
  EXPECT_EQ(r.query, "c=d?e");
  p.reset();
  p.feed("GET /plain HTTP/1.1\r\n\r\n");
  r = p.take();
  EXPECT_EQ(r.path, "/plain");
  EXPECT_EQ(r.query, "");
  p.reset();
  p.feed("GET /empty? HTTP/1.1\r\n\r\n");
  r = p.take();
  EXPECT_EQ(r.path, "/empty");
  EXPECT_EQ(r.query, "");
}

}  // namespace
}  // namespace specula::http
