// SPDX-License-Identifier: Apache-2.0
// bench-serve's HTTP client pieces that need no socket: the chunked decoder and
// the SSE splitter (fed whole, byte by byte, and at every split point), the
// response-head parser, and the loopback check.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "apps/cli/http_client.h"

namespace specula::cli::http {
namespace {

std::string dechunk_whole(const std::string& in, bool* done = nullptr) {
  ChunkedDecoder d;
  std::string out;
  d.feed(in, out);
  if (done) *done = d.done();
  return out;
}

std::string dechunk_bytewise(const std::string& in, bool* done = nullptr) {
  ChunkedDecoder d;
  std::string out;
  for (char c : in) d.feed(std::string_view(&c, 1), out);
  if (done) *done = d.done();
  return out;
}

TEST(ChunkedDecoder, DecodesWholeAndByteByByte) {
  const std::string in = "5\r\nhello\r\n7;ext=1\r\n, world\r\nA\r\n0123456789\r\n0\r\n\r\n";
  for (auto* f : {dechunk_whole, dechunk_bytewise}) {
    bool done = false;
    EXPECT_EQ(f(in, &done), "hello, world0123456789");
    EXPECT_TRUE(done);
  }
}

TEST(ChunkedDecoder, EverySplitPoint) {
  const std::string in =
      "3\r\nabc\r\n1a\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Trailer: 1\r\n\r\n";
  for (size_t cut = 0; cut <= in.size(); ++cut) {
    ChunkedDecoder d;
    std::string out;
    d.feed(std::string_view(in).substr(0, cut), out);
    d.feed(std::string_view(in).substr(cut), out);
    EXPECT_EQ(out, "abcabcdefghijklmnopqrstuvwxyz") << "cut at " << cut;
    EXPECT_TRUE(d.done()) << "cut at " << cut;
  }
}

TEST(ChunkedDecoder, NotDoneUntilTheLastChunkAndIgnoresWhatFollows) {
  ChunkedDecoder d;
  std::string out;
  d.feed("4\r\ndata\r\n", out);
  EXPECT_FALSE(d.done());
  d.feed("0\r\n", out);
  EXPECT_FALSE(d.done());  // the trailer section's blank line is still to come
  d.feed("\r\nHTTP/1.1 200 OK", out);
  EXPECT_TRUE(d.done());
  EXPECT_EQ(out, "data");
}

TEST(ChunkedDecoder, AcceptsBareLf) {
  bool done = false;
  EXPECT_EQ(dechunk_bytewise("2\nab\n0\n\n", &done), "ab");
  EXPECT_TRUE(done);
}

TEST(ChunkedDecoder, RejectsMalformed) {
  for (const std::string bad : {"zz\r\n", "\r\n", "3\r\nabcd\r\n", "3\rx", "3\r\nabc\rx",
                                "fffffffffffffffff\r\n", "0\r\n\rx"}) {
    ChunkedDecoder d;
    std::string out;
    try {
      d.feed(bad, out);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const HttpError& e) {
      EXPECT_EQ(e.kind(), HttpErrorKind::kProtocol) << bad;
    }
  }
}

std::vector<std::string> sse_bytewise(const std::string& in) {
  SseSplitter s;
  std::vector<std::string> events;
  for (char c : in) s.feed(std::string_view(&c, 1), events);
  return events;
}

TEST(SseSplitter, SplitsEventsByteByByte) {
  const std::string in =
      "data: {\"a\":1}\n\n"
      ": a comment\n"
      "event: message\nid: 7\ndata: {\"b\":2}\n\n"
      "data:no space\r\n\r\n"
      "data: line one\ndata: line two\n\n"
      "data: [DONE]\n\n";
  const std::vector<std::string> want = {"{\"a\":1}", "{\"b\":2}", "no space", "line one\nline two",
                                         "[DONE]"};
  EXPECT_EQ(sse_bytewise(in), want);
  SseSplitter s;
  std::vector<std::string> whole;
  s.feed(in, whole);
  EXPECT_EQ(whole, want);
}

TEST(SseSplitter, CrLfCrAndLfLineEndsAtEverySplitPoint) {
  const std::string in = "data: a\r\n\r\ndata: b\r\rdata: c\n\ndata: d\r\n\n";
  const std::vector<std::string> want = {"a", "b", "c", "d"};
  for (size_t cut = 0; cut <= in.size(); ++cut) {
    SseSplitter s;
    std::vector<std::string> events;
    s.feed(std::string_view(in).substr(0, cut), events);
    s.feed(std::string_view(in).substr(cut), events);
    EXPECT_EQ(events, want) << "cut at " << cut;
  }
}

TEST(SseSplitter, NoEventWithoutDataOrBeforeItsBlankLine) {
  EXPECT_TRUE(sse_bytewise(": keep-alive\n\nevent: ping\n\n\n\n").empty());
  EXPECT_TRUE(sse_bytewise("data: unfinished\n").empty());
  EXPECT_EQ(sse_bytewise("data:\n\n"), std::vector<std::string>{""});  // empty data is data
}

TEST(ResponseHead, ParsesStatusAndHeaders) {
  const ResponseHead h = parse_response_head(
      "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
      "transfer-encoding:  chunked \r\nRetry-After: 1");
  EXPECT_EQ(h.status, 429);
  EXPECT_EQ(h.reason, "Too Many Requests");
  EXPECT_EQ(h.header("Transfer-Encoding").value_or(""), "chunked");
  EXPECT_EQ(h.header("retry-after").value_or(""), "1");
  EXPECT_FALSE(h.header("Content-Length"));
  EXPECT_EQ(parse_response_head("HTTP/1.0 200 OK").status, 200);
  for (const char* bad :
       {"HTTP/2 200 OK", "HTTP/1.1 2x0 OK", "SSH-2.0", "HTTP/1.1 200 OK\r\nNoColon"})
    EXPECT_THROW(parse_response_head(bad), HttpError) << bad;
}

TEST(LoopbackAddress, AcceptsLoopbackOnly) {
  for (const char* ok : {"127.0.0.1", "127.255.0.9", "localhost", "LocalHost", "::1", "[::1]"})
    EXPECT_TRUE(loopback_address(ok, 8080)) << ok;
  for (const char* bad : {"10.0.0.1", "0.0.0.0", "128.0.0.1", "::", "::ffff:127.0.0.1",
                          "example.com", "127.1", "", "localhost.example.com"})
    EXPECT_FALSE(loopback_address(bad, 8080)) << bad;
  EXPECT_FALSE(loopback_address("127.0.0.1", 0));
  EXPECT_FALSE(loopback_address("127.0.0.1", 65536));
  EXPECT_EQ(loopback_address("localhost", 81)->host_header, "127.0.0.1:81");
  EXPECT_EQ(loopback_address("::1", 81)->host_header, "[::1]:81");
}

}  // namespace
}  // namespace specula::cli::http
