// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include "engine/kv/kv_cache.h"

namespace specula {
namespace {

// One ring layer (window 4, rollback slack 2) and one full layer, 1 head of dim 1,
// so each row's value is simply its position.
KvCacheSpec tiny_spec() {
  KvCacheSpec spec;
  spec.layers = {{.owns_cache = true, .n_kv_heads = 1, .head_dim = 1, .window = 4},
                 {.owns_cache = true, .n_kv_heads = 1, .head_dim = 1, .window = 0},
                 {.owns_cache = false}};
  spec.max_context = 64;
  spec.max_rollback = 2;
  return spec;
}

// Writes positions [from, from + n) with key = position + junk (junk marks rows to be rolled back).
void write_positions(SequenceKv& kv, int64_t from, int64_t n, float junk = 0) {
  HostTensor k(DType::kF32, {n, 1, 1}), v(DType::kF32, {n, 1, 1});
  for (int64_t i = 0; i < n; ++i) {
    k.data<float>()[i] = static_cast<float>(from + i) + junk;
    v.data<float>()[i] = static_cast<float>(-(from + i));
  }
  kv.write_ring(0, from, k, v);
  kv.write_full(1, from, k, v);
  kv.commit(n);
}

std::vector<float> ring_keys(const SequenceKv& kv, int64_t from, int64_t to) {
  HostTensor k(DType::kF32, {to - from, 1, 1}), v(DType::kF32, {to - from, 1, 1});
  kv.read_ring(0, from, to, k, v);
  return {k.f32().begin(), k.f32().end()};
}

TEST(SequenceKv, RingKeepsTheWindowAfterWrapping) {
  SequenceKv kv(tiny_spec());
  write_positions(kv, 0, 10);  // ring capacity 6: keeps positions 4..9
  EXPECT_EQ(kv.length(), 10);
  EXPECT_EQ(kv.ring_oldest(0), 4);
  EXPECT_EQ(ring_keys(kv, 6, 10), (std::vector<float>{6, 7, 8, 9}));
  EXPECT_THROW(ring_keys(kv, 3, 10), Error);
  EXPECT_EQ(kv.full_keys(1, 10).f32()[3], 3.0f);
}

TEST(SequenceKv, RollbackAfterWrapThenRewriteIsConsistent) {
  SequenceKv kv(tiny_spec());
  write_positions(kv, 0, 9);
  write_positions(kv, 9, 1, 100);  // a rejected verify token at position 9: ring keeps 4..9
  kv.truncate(9);
  // The next reads (position 9) need positions 4..8 (window + 1): still retained.
  EXPECT_EQ(ring_keys(kv, 4, 9), (std::vector<float>{4, 5, 6, 7, 8}));
  write_positions(kv, 9, 1);  // the accepted token replaces it
  write_positions(kv, 10, 1);
  EXPECT_EQ(ring_keys(kv, 8, 11), (std::vector<float>{8, 9, 10}));
}

TEST(SequenceKv, RollbackBeyondTheRetainedWindowIsRefused) {
  SequenceKv kv(tiny_spec());
  write_positions(kv, 0, 12);  // ring keeps 6..11
  // Rolling back to 10 needs positions 5..9 (window + 1): 5 is gone.
  try {
    kv.truncate(10);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("roll back"), std::string::npos) << e.what();
  }
  EXPECT_EQ(kv.length(), 12);
  kv.truncate(11);  // needs 6..10: fine
  EXPECT_EQ(kv.length(), 11);
}

TEST(SequenceKv, ContextOverflowNamesTheSize) {
  SequenceKv kv(tiny_spec());
  write_positions(kv, 0, 60);
  try {
    kv.check_room(10);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("64"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace specula
