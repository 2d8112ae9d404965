// SPDX-License-Identifier: Apache-2.0
// ExchangeImpl and response formatting: see exchange_impl.h.
#include "server/http/exchange_impl.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdio>

namespace specula::http::detail {

namespace {

// Header names and values go on one line: a CR or LF in them (from a handler
// echoing user input) would let that input add headers of its own.
void append_header_text(std::string& out, std::string_view text) {
  for (char c : text) out.push_back(c == '\r' || c == '\n' ? ' ' : c);
}

void append_header(std::string& out, std::string_view name, std::string_view value) {
  append_header_text(out, name);
  out += ": ";
  append_header_text(out, value);
  out += "\r\n";
}

void append_status_line(std::string& out, int status) {
  out += "HTTP/1.1 ";
  out += std::to_string(status);
  out += ' ';
  out += reason_phrase(status);
  out += "\r\n";
}

bool has_header(const std::vector<std::pair<std::string, std::string>>& headers,
                std::string_view lower_name) {
  for (const auto& [name, value] : headers) {
    if (name.size() != lower_name.size()) continue;
    bool same = true;
    for (size_t i = 0; i < name.size() && same; ++i) {
      const char c = name[i] >= 'A' && name[i] <= 'Z' ? static_cast<char>(name[i] + 32) : name[i];
      same = c == lower_name[i];
    }
    if (same) return true;
  }
  return false;
}

}  // namespace

void Hub::wake(int event_fd) {
  const uint64_t one = 1;
  // A full counter (EAGAIN) means a wake-up is pending anyway.
  (void)!::write(event_fd, &one, sizeof(one));
}

void Hub::post(std::shared_ptr<ExchangeImpl> exchange) {
  std::lock_guard lock(mutex);
  if (!alive) return;
  ready.push_back(std::move(exchange));
  if (!signalled) {
    signalled = true;
    wake(event_fd);
  }
}

std::string_view reason_phrase(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 200:
      return "OK";
    case 201:
      return "Created";
    case 202:
      return "Accepted";
    case 204:
      return "No Content";
    case 301:
      return "Moved Permanently";
    case 302:
      return "Found";
    case 304:
      return "Not Modified";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 409:
      return "Conflict";
    case 411:
      return "Length Required";
    case 413:
      return "Content Too Large";
    case 415:
      return "Unsupported Media Type";
    case 422:
      return "Unprocessable Content";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 502:
      return "Bad Gateway";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return "Unknown";
  }
}

Response default_error_response(int status, std::string message) {
  Response r;
  r.status = status;
  r.content_type = "application/json";
  std::string escaped;
  for (char c : message) {
    switch (c) {
      case '"':
        escaped += "\\\"";
        break;
      case '\\':
        escaped += "\\\\";
        break;
      case '\n':
        escaped += "\\n";
        break;
      case '\r':
        escaped += "\\r";
        break;
      case '\t':
        escaped += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          escaped += buf;
        } else {
          escaped += c;
        }
    }
  }
  r.body = "{\"error\":{\"message\":\"" + escaped + "\"}}";
  return r;
}

std::string format_response(const Response& response, bool keep_alive, bool head_only) {
  std::string out;
  out.reserve(128 + response.body.size());
  append_status_line(out, response.status);
  if (!response.content_type.empty()) append_header(out, "Content-Type", response.content_type);
  // 1xx, 204 and 304 carry no body and no length (RFC 9110 8.6).
  const bool no_body = response.status == 204 || response.status == 304 || response.status < 200;
  if (!no_body) append_header(out, "Content-Length", std::to_string(response.body.size()));
  append_header(out, "Connection", keep_alive ? "keep-alive" : "close");
  for (const auto& [name, value] : response.headers) append_header(out, name, value);
  out += "\r\n";
  if (!no_body && !head_only) out += response.body;
  return out;
}

ExchangeImpl::ExchangeImpl(std::shared_ptr<Hub> hub, uint64_t conn_id, bool keep_alive, bool http10,
                           bool head_only)
    : hub_(std::move(hub)),
      conn_id_(conn_id),
      keep_alive_(keep_alive),
      http10_(http10),
      head_only_(head_only) {}

void ExchangeImpl::notify(bool need_post) {
  if (need_post) hub_->post(shared_from_this());
}

void ExchangeImpl::respond(Response response) {
  bool need_post = false;
  std::function<void()> unused_callback;  // destroyed after the lock is released
  {
    std::lock_guard lock(mutex_);
    if (started_ || closed_) return;  // a second answer, or nobody to answer
    started_ = true;
    ended_ = true;
    unused_callback = std::move(on_close_);
    close_after_ = !keep_alive_;
    out_ += format_response(response, keep_alive_, head_only_);
    need_post = !queued_;
    queued_ = true;
  }
  notify(need_post);
}

void ExchangeImpl::start_stream(int status, std::string content_type,
                                std::vector<std::pair<std::string, std::string>> headers) {
  bool need_post = false;
  {
    std::lock_guard lock(mutex_);
    if (started_ || closed_) return;
    started_ = true;
    streaming_ = true;
    // HTTP/1.0 has no chunked encoding: the body there ends when the
    // connection closes.
    chunked_ = !http10_;
    close_after_ = !keep_alive_ || http10_;
    append_status_line(out_, status);
    if (!content_type.empty()) append_header(out_, "Content-Type", content_type);
    if (chunked_) append_header(out_, "Transfer-Encoding", "chunked");
    append_header(out_, "Connection", close_after_ ? "close" : "keep-alive");
    // Proxies and browsers must not hold server-sent events back.
    if (content_type.rfind("text/event-stream", 0) == 0 && !has_header(headers, "cache-control")) {
      append_header(out_, "Cache-Control", "no-cache");
    }
    for (const auto& [name, value] : headers) append_header(out_, name, value);
    out_ += "\r\n";
    need_post = !queued_;
    queued_ = true;
  }
  notify(need_post);
}

bool ExchangeImpl::write(std::string_view data) {
  bool need_post = false;
  {
    std::lock_guard lock(mutex_);
    if (closed_ || !streaming_ || ended_) return false;
    // An empty chunk would read as the last one; a HEAD answer has no body.
    if (data.empty() || head_only_) return true;
    if (chunked_) {
      char size[24];
      const int n = std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
      out_.append(size, static_cast<size_t>(n));
      out_ += data;
      out_ += "\r\n";
    } else {
      out_ += data;
    }
    need_post = !queued_;
    queued_ = true;
  }
  notify(need_post);
  return true;
}

void ExchangeImpl::end() {
  bool need_post = false;
  std::function<void()> unused_callback;  // destroyed after the lock is released
  {
    std::lock_guard lock(mutex_);
    if (closed_ || !streaming_ || ended_) return;
    ended_ = true;
    unused_callback = std::move(on_close_);
    if (chunked_ && !head_only_) out_ += "0\r\n\r\n";
    need_post = !queued_;
    queued_ = true;
  }
  notify(need_post);
}

bool ExchangeImpl::closed() const {
  std::lock_guard lock(mutex_);
  return closed_;
}

void ExchangeImpl::on_close(std::function<void()> callback) {
  {
    std::lock_guard lock(mutex_);
    // After the end it can never run; not keeping it also frees whatever it
    // holds (often this exchange: a cycle otherwise).
    if (ended_) return;
    if (!closed_) {
      on_close_.swap(callback);  // the previous one, if any, dies below, unlocked
      return;
    }
  }
  if (callback) callback();
}

bool ExchangeImpl::take_output(std::string& out) {
  std::lock_guard lock(mutex_);
  out += out_;
  out_.clear();
  queued_ = false;
  return ended_;
}

bool ExchangeImpl::close_after() const {
  std::lock_guard lock(mutex_);
  return close_after_;
}

bool ExchangeImpl::started() const {
  std::lock_guard lock(mutex_);
  return started_;
}

void ExchangeImpl::mark_closed() {
  std::function<void()> callback;
  {
    std::lock_guard lock(mutex_);
    if (closed_) return;
    closed_ = true;
    out_.clear();
    if (!ended_) callback = std::move(on_close_);
    on_close_ = nullptr;
  }
  if (callback) callback();
}

}  // namespace specula::http::detail
