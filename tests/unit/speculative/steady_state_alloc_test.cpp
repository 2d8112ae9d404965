// SPDX-License-Identifier: Apache-2.0
// Rule 8: steady-state decoding allocates nothing. After a warm-up step of the
// same shape, target decode and verify forwards and assistant draft steps must
// not call operator new (scratch lives in arenas sized by a dry run).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "engine/draft/assistant/assistant_drafter.h"
#include "tests/unit/model/golden_util.h"

// Counting replacements of the global allocation functions. Under
// AddressSanitizer the sanitizer owns operator new/delete (replacing them there
// mixes allocators), so the count is only taken in unsanitized builds.
#if defined(__SANITIZE_ADDRESS__)
#define SPECULA_COUNT_ALLOCATIONS 0
#else
#define SPECULA_COUNT_ALLOCATIONS 1
#endif

namespace {
std::atomic<long> g_allocations{0};
}  // namespace

#if SPECULA_COUNT_ALLOCATIONS
void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  return operator new(n);
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept {
  return operator new(n, t);
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
#endif

namespace specula {
namespace {

TEST(SteadyState, DecodeVerifyAndDraftStepsDoNotAllocate) {
  if (!testing::golden_exists("e2b_like") || !testing::golden_exists("e2b_like_assistant"))
    GTEST_SKIP();
  auto target = gemma4::Gemma4Model::load(testing::golden_dir("e2b_like"));
  auto drafter = assistant::AssistantModel::load(testing::golden_dir("e2b_like_assistant"),
                                                   target->config(), target->backend());
  assistant::AssistantDrafter source(*target, *drafter);
  constexpr int kRows = 3;
  std::vector<SequenceKv> kvs;
  for (int i = 0; i < kRows; ++i) kvs.push_back(target->new_sequence());
  const std::vector<int32_t> prompt = {5, 9, 17, 33, 2, 71, 40, 8, 99, 12};
  std::vector<gemma4::ForwardRow> rows;
  for (auto& kv : kvs) rows.push_back({.kv = &kv, .tokens = prompt});
  target->forward(rows);

  const std::vector<int32_t> one = {7};
  const std::vector<int32_t> window = {7, 8, 9, 10, 11};
  std::vector<DraftRow> draft_rows(kRows);
  std::vector<float> hidden(static_cast<size_t>(target->config().hidden_size), 0.5f);
  auto step = [&](const std::vector<int32_t>& tokens) {
    for (int i = 0; i < kRows; ++i)
      rows[static_cast<size_t>(i)] = {
          .kv = &kvs[static_cast<size_t>(i)], .tokens = tokens, .all_logits = true};
    target->forward(rows);
    for (auto& kv : kvs) kv.truncate(kv.length() - static_cast<int64_t>(tokens.size()) + 1);
    for (int i = 0; i < kRows; ++i) {
      draft_rows[static_cast<size_t>(i)] = {
          .sequence = i,
          .token = 7,
          .position = static_cast<int32_t>(kvs[static_cast<size_t>(i)].length()),
          .target_kv = &kvs[static_cast<size_t>(i)],
          .target_hidden = hidden.data()};
    }
    for (int s = 0; s < 4; ++s) source.step(s, draft_rows);
  };
  // Warm up both shapes (the arenas size themselves on the first step of each shape).
  step(window);
  step(one);
  const long before = g_allocations.load();
  for (int i = 0; i < 5; ++i) {
    step(one);
    step(window);
  }
  EXPECT_EQ(g_allocations.load() - before, 0)
      << "allocations during steady-state decode/verify/draft steps";
}

}  // namespace
}  // namespace specula
