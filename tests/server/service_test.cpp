// SPDX-License-Identifier: Apache-2.0
// The Service without sockets: requests go to Service::handle with a recording
// Exchange, on the embedded family (CPU), with the engine thread running.
#include "server/service/service.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>

#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/runtime/text_generation.h"

namespace specula::server {
namespace {

using nlohmann::json;

std::string models_dir() {
  return std::string(SPECULA_SOURCE_DIR) + "/models";
}

// Records what the service answers; thread-safe like the real one.
class RecordingExchange : public http::Exchange {
 public:
  void respond(http::Response r) override {
    std::lock_guard lock(mu_);
    status_ = r.status;
    headers_ = r.headers;
    body_ = std::move(r.body);
    done_ = true;
    cv_.notify_all();
  }
  void start_stream(int status, std::string,
                    std::vector<std::pair<std::string, std::string>>) override {
    std::lock_guard lock(mu_);
    status_ = status;
    streaming_ = true;
  }
  bool write(std::string_view data) override {
    std::lock_guard lock(mu_);
    if (closed_) return false;
    events_.emplace_back(data);
    cv_.notify_all();
    return true;
  }
  void end() override {
    std::lock_guard lock(mu_);
    done_ = true;
    cv_.notify_all();
  }
  bool closed() const override {
    std::lock_guard lock(mu_);
    return closed_;
  }
  void on_close(std::function<void()> cb) override {
    std::lock_guard lock(mu_);
    on_close_ = std::move(cb);
  }
  // The client goes away.
  void disconnect() {
    std::function<void()> cb;
    {
      std::lock_guard lock(mu_);
      closed_ = true;
      cb = on_close_;
    }
    if (cb) cb();
  }
  bool wait_done(double seconds = 60) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return done_; });
  }
  bool wait_events(size_t n, double seconds = 60) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::duration<double>(seconds),
                        [&] { return events_.size() >= n || done_; });
  }
  int status() const {
    std::lock_guard lock(mu_);
    return status_;
  }
  std::string body() const {
    std::lock_guard lock(mu_);
    return body_;
  }
  std::vector<std::string> events() const {
    std::lock_guard lock(mu_);
    return events_;
  }
  std::vector<std::pair<std::string, std::string>> headers() const {
    std::lock_guard lock(mu_);
    return headers_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int status_ = 0;
  bool streaming_ = false, done_ = false, closed_ = false;
  std::vector<std::pair<std::string, std::string>> headers_;
  std::string body_;
  std::vector<std::string> events_;
  std::function<void()> on_close_;
};

class ServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(models_dir() + "/gemma4-tiny-py-assistant")) return;
    target_ = gemma4::Gemma4Model::load(models_dir() + "/gemma4-tiny-py").release();
    model_ = assistant::AssistantModel::load(models_dir() + "/gemma4-tiny-py-assistant",
                                             target_->config(), target_->backend())
                 .release();
    drafter_ = new assistant::AssistantDrafter(*target_, *model_);
    tokenizer_ = new Tokenizer(Tokenizer::load(models_dir() + "/gemma4-tiny-py"));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete drafter_;
    delete model_;
    delete target_;
  }
  void SetUp() override {
    if (target_ == nullptr) GTEST_SKIP() << "embedded family not present";
  }
  void TearDown() override { stop(); }

  void start(int max_rows = 4, int max_queue = 16, bool with_drafter = true,
             double request_timeout_s = 600) {
    speculative::EngineOptions eo;
    eo.max_rows = max_rows;
    eo.schedule.draft_tokens = 3;
    engine_ =
        std::make_unique<speculative::Engine>(*target_, with_drafter ? drafter_ : nullptr, eo);
    ServiceOptions so;
    so.model_name = "tiny";
    so.max_num_seqs = max_rows;
    so.max_queue = max_queue;
    so.log_requests = false;
    so.request_timeout_s = request_timeout_s;
    so.eos_ids = tokenizer_->eos_ids();
    so.has_drafter = with_drafter;
    so.context_length = target_->max_context();
    service_ = std::make_unique<Service>(*engine_, *tokenizer_, so);
    thread_ = std::thread([this] { service_->run_engine(); });
  }
  void stop() {
    if (!service_) return;
    service_->shutdown(5);
    thread_.join();
    service_.reset();
    engine_.reset();
  }
  std::shared_ptr<RecordingExchange> post(const std::string& path, const json& body) {
    http::Request r;
    r.method = "POST";
    r.path = r.target = path;
    r.body = body.dump();
    auto ex = std::make_shared<RecordingExchange>();
    service_->handle(r, ex);
    return ex;
  }
  json completion(const json& body) {
    auto ex = post("/v1/completions", body);
    EXPECT_TRUE(ex->wait_done());
    EXPECT_EQ(ex->status(), 200) << ex->body();
    return json::parse(ex->body());
  }
  // The text of a stream's events, and the parsed events.
  static std::string stream_text(const std::vector<std::string>& events, bool chat) {
    std::string text;
    for (const std::string& e : events) {
      if (e.rfind("data: {", 0) != 0) continue;
      json j = json::parse(e.substr(6));
      if (!j.contains("choices") || j["choices"].empty()) continue;
      const json& c = j["choices"][0];
      if (chat) {
        if (c["delta"].contains("content")) text += c["delta"]["content"].get<std::string>();
      } else {
        text += c["text"].get<std::string>();
      }
    }
    return text;
  }
  std::string generate_alone(const std::string& prompt, int max_tokens) {
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = max_tokens;
    p.stop_token_ids = tokenizer_->eos_ids();
    speculative::DraftSchedule schedule;
    return generate_text(*target_, nullptr, *tokenizer_,
                         tokenizer_->encode(prompt, /*add_special_tokens=*/true), p, schedule)
        .text;
  }

  static inline gemma4::Gemma4Model* target_ = nullptr;
  static inline assistant::AssistantModel* model_ = nullptr;
  static inline assistant::AssistantDrafter* drafter_ = nullptr;
  static inline Tokenizer* tokenizer_ = nullptr;
  std::unique_ptr<speculative::Engine> engine_;
  std::unique_ptr<Service> service_;
  std::thread thread_;
};

TEST_F(ServiceTest, GreedyCompletionMatchesGenerateWithAndWithoutSpeculation) {
  start();
  const std::string prompt = "def add(a, b):";
  const std::string alone = generate_alone(prompt, 24);
  json on = completion({{"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0}});
  json off = completion({{"prompt", prompt},
                         {"max_tokens", 24},
                         {"temperature", 0},
                         {"speculative", {{"enabled", false}}}});
  EXPECT_EQ(on["choices"][0]["text"], alone);
  EXPECT_EQ(off["choices"][0]["text"], alone);
  EXPECT_EQ(on["object"], "text_completion");
  EXPECT_GT(on["usage"]["speculative"]["drafted"].get<int>(), 0);
  EXPECT_FALSE(off["usage"].contains("speculative") &&
               off["usage"]["speculative"]["drafted"].get<int>() > 0);
}

TEST_F(ServiceTest, StreamConcatenatesToTheWholeResponse) {
  start();
  json body = {{"messages", {{{"role", "user"}, {"content", "Say something."}}}},
               {"max_tokens", 20},
               {"temperature", 0}};
  auto whole = post("/v1/chat/completions", body);
  ASSERT_TRUE(whole->wait_done());
  ASSERT_EQ(whole->status(), 200) << whole->body();
  const std::string text = json::parse(whole->body())["choices"][0]["message"]["content"];
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  auto streamed = post("/v1/chat/completions", body);
  ASSERT_TRUE(streamed->wait_done());
  const auto events = streamed->events();
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(json::parse(events.front().substr(6))["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(events.back(), "data: [DONE]\n\n");
  const json usage = json::parse(events[events.size() - 2].substr(6));
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_GT(usage["usage"]["completion_tokens"].get<int>(), 0);
  EXPECT_EQ(stream_text(events, true), text);
}

TEST_F(ServiceTest, ConcurrentRequestsGetWhatTheyGetAlone) {
  start(/*max_rows=*/3);
  std::vector<json> bodies;
  for (int i = 0; i < 7; ++i) {
    json b = {{"prompt", "item " + std::to_string(i * 7) + " is"},
              {"max_tokens", 6 + 3 * i},
              {"temperature", i % 2 ? 0.8 : 0.0},
              {"seed", 11 + i}};
    if (i % 3 == 1) b["speculative"] = {{"draft_tokens", 2}};
    bodies.push_back(b);
  }
  std::vector<std::string> alone;
  for (const json& b : bodies) alone.push_back(completion(b)["choices"][0]["text"]);
  std::vector<std::shared_ptr<RecordingExchange>> all;
  for (const json& b : bodies) all.push_back(post("/v1/completions", b));
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_TRUE(all[i]->wait_done());
    EXPECT_EQ(json::parse(all[i]->body())["choices"][0]["text"], alone[i]) << "request " << i;
  }
}

TEST_F(ServiceTest, DisconnectCancelsAndFreesTheRow) {
  start();
  auto ex = post("/v1/completions", {{"prompt", "Once upon a time"},
                                     {"max_tokens", 400},
                                     {"stream", true},
                                     {"ignore_eos", true}});
  ASSERT_TRUE(ex->wait_events(3));
  ex->disconnect();
  for (int i = 0; i < 200 && service_->active_jobs() > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(service_->active_jobs(), 0);
  EXPECT_EQ(engine_->kv_pool().rows_in_use, 0);
  // The service goes on serving.
  EXPECT_EQ(completion({{"prompt", "hi"}, {"max_tokens", 3}})["choices"].size(), 1u);
}

TEST_F(ServiceTest, FullQueueAnswers429WithRetryAfter) {
  start(/*max_rows=*/1, /*max_queue=*/1);
  json body = {{"prompt", "a"}, {"max_tokens", 200}, {"ignore_eos", true}};
  auto a = post("/v1/completions", body);
  auto b = post("/v1/completions", body);
  auto c = post("/v1/completions", body);
  ASSERT_TRUE(c->wait_done(5));
  EXPECT_EQ(c->status(), 429);
  EXPECT_EQ(json::parse(c->body())["error"]["code"], "queue_full");
  bool retry_after = false;
  for (auto& [k, v] : c->headers()) retry_after |= k == "Retry-After";
  EXPECT_TRUE(retry_after);
  ASSERT_TRUE(a->wait_done());
  ASSERT_TRUE(b->wait_done());
  EXPECT_EQ(a->status(), 200);
  EXPECT_EQ(b->status(), 200);
}

TEST_F(ServiceTest, UsageAndMetricsAgree) {
  start();
  int64_t prompt = 0, completion_tokens = 0, drafted = 0, accepted = 0;
  for (int i = 0; i < 4; ++i) {
    json r = completion({{"prompt", "count: " + std::to_string(i)},
                         {"max_tokens", 10 + i},
                         {"n", 1 + i % 2},
                         {"temperature", 0.7},
                         {"seed", i}});
    prompt += r["usage"]["prompt_tokens"].get<int64_t>() * (1 + i % 2);
    completion_tokens += r["usage"]["completion_tokens"].get<int64_t>();
    if (r["usage"].contains("speculative")) {
      drafted += r["usage"]["speculative"]["drafted"].get<int64_t>();
      accepted += r["usage"]["speculative"]["accepted"].get<int64_t>();
    }
  }
  const std::string m = service_->registry().render();
  auto value = [&](const std::string& name) {
    const size_t at = m.find("\n" + name + " ");
    EXPECT_NE(at, std::string::npos) << name;
    return at == std::string::npos ? -1.0 : std::stod(m.substr(at + name.size() + 2));
  };
  EXPECT_EQ(value("specula:prompt_tokens_total"), prompt);
  EXPECT_EQ(value("specula:generation_tokens_total"), completion_tokens);
  EXPECT_EQ(value("specula:spec_decode_num_draft_tokens_total"), drafted);
  EXPECT_EQ(value("specula:spec_decode_num_accepted_tokens_total"), accepted);
}

TEST_F(ServiceTest, BadRequestsGetOpenAiErrors) {
  start();
  struct Case {
    json body;
    int status;
  };
  const std::vector<Case> cases = {
      {{{"prompt", "x"}, {"temperature", "hot"}}, 400},
      {{{"prompt", "x"}, {"model", "nope"}}, 404},
      {{{"prompt", "x"}, {"max_tokens", 1000000000}}, 400},
      {{{"prompt", "x"}, {"n", 1000}}, 400},
  };
  for (const Case& c : cases) {
    auto ex = post("/v1/completions", c.body);
    ASSERT_TRUE(ex->wait_done(5));
    EXPECT_EQ(ex->status(), c.status) << c.body.dump();
    json e = json::parse(ex->body());
    EXPECT_TRUE(e["error"]["message"].is_string()) << ex->body();
    EXPECT_TRUE(e["error"]["type"].is_string());
  }
  http::Request r;
  r.method = "POST";
  r.path = "/v1/completions";
  r.body = "{not json";
  auto ex = std::make_shared<RecordingExchange>();
  service_->handle(r, ex);
  ASSERT_TRUE(ex->wait_done(5));
  EXPECT_EQ(ex->status(), 400);
  EXPECT_EQ(completion({{"prompt", "still here"}, {"max_tokens", 2}})["choices"].size(), 1u);
}

TEST_F(ServiceTest, RequestPastItsTimeoutIsCancelledWith504) {
  start(4, 16, true, /*request_timeout_s=*/0.2);
  auto ex = post("/v1/completions", {{"prompt", "a"}, {"max_tokens", 3000}, {"ignore_eos", true}});
  ASSERT_TRUE(ex->wait_done(30));
  EXPECT_EQ(ex->status(), 504);
  EXPECT_EQ(json::parse(ex->body())["error"]["type"], "timeout_error");
  EXPECT_EQ(engine_->kv_pool().rows_in_use, 0);
}

TEST_F(ServiceTest, ShutdownEndsRunningStreamsWellFormed) {
  start();
  auto ex = post("/v1/completions",
                 {{"prompt", "a"}, {"max_tokens", 3000}, {"ignore_eos", true}, {"stream", true}});
  ASSERT_TRUE(ex->wait_events(2));
  service_->shutdown(0.1);
  ASSERT_TRUE(ex->wait_done(30));
  const auto events = ex->events();
  EXPECT_EQ(events.back(), "data: [DONE]\n\n");
  EXPECT_NE(events[events.size() - 2].find("\"error\""), std::string::npos);
  // New requests are refused while shutting down.
  auto late = post("/v1/completions", {{"prompt", "b"}, {"max_tokens", 2}});
  ASSERT_TRUE(late->wait_done(5));
  EXPECT_EQ(late->status(), 503);
}

TEST_F(ServiceTest, LogprobsComeWithEveryTokenWithAndWithoutSpeculation) {
  start();
  json body = {{"prompt", "def f(x):"}, {"max_tokens", 12}, {"temperature", 0}, {"logprobs", 3}};
  json on = completion(body);
  body["speculative"] = {{"enabled", false}};
  json off = completion(body);
  const json& a = on["choices"][0]["logprobs"];
  const json& b = off["choices"][0]["logprobs"];
  ASSERT_EQ(a["tokens"].size(), on["usage"]["completion_tokens"].get<size_t>());
  ASSERT_EQ(a["tokens"], b["tokens"]);
  for (size_t i = 0; i < a["token_logprobs"].size(); ++i) {
    EXPECT_NEAR(a["token_logprobs"][i].get<double>(), b["token_logprobs"][i].get<double>(), 1e-4);
    EXPECT_LE(a["token_logprobs"][i].get<double>(), 0.0);
    // A dict by token text: two ids with one text share an entry.
    EXPECT_GE(a["top_logprobs"][i].size(), 1u);
    EXPECT_LE(a["top_logprobs"][i].size(), 3u);
  }
}

}  // namespace
}  // namespace specula::server
