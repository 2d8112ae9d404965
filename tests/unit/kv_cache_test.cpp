// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include "engine/backend/backends.h"
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

// store_target + store_kv (what decode steps use, so a recorded step can write
// at new positions) keep the same rows and the same bookkeeping as
// write_ring / write_full, including across a ring wrap and a rollback.
TEST(SequenceKv, StoreTargetWithStoreKvEqualsWriteRingAndWriteFull) {
  Backend& be = backend_for(Device::cpu());
  SequenceKv written(tiny_spec());
  SequenceKv stored(tiny_spec());
  auto store = [&](int64_t from, int64_t n, float junk) {
    HostTensor k(DType::kF32, {n, 1, 1}), v(DType::kF32, {n, 1, 1});
    HostTensor pos(DType::kI32, {n});
    for (int64_t i = 0; i < n; ++i) {
      k.data<float>()[i] = static_cast<float>(from + i) + junk;
      v.data<float>()[i] = static_cast<float>(-(from + i));
      pos.data<int32_t>()[i] = static_cast<int32_t>(from + i);
    }
    for (int layer : {0, 1}) {
      const SequenceKv::Storage st = stored.store_target(layer, from, n);
      be.store_kv(k, v, pos, st.k, st.v);
    }
    stored.commit(n);
  };
  for (int64_t p = 0; p < 9; ++p) {
    write_positions(written, p, 1);
    store(p, 1, 0);
  }
  write_positions(written, 9, 1, 100);  // a rejected verify token
  store(9, 1, 100);
  written.truncate(9);
  stored.truncate(9);
  write_positions(written, 9, 2);
  store(9, 2, 0);
  EXPECT_EQ(stored.ring_oldest(0), written.ring_oldest(0));
  EXPECT_EQ(ring_keys(stored, 5, 11), ring_keys(written, 5, 11));
  EXPECT_EQ(ring_keys(stored, 5, 11), (std::vector<float>{5, 6, 7, 8, 9, 10}));
  const auto fs = stored.full_keys(1, 11).f32(), fw = written.full_keys(1, 11).f32();
  EXPECT_EQ(std::vector<float>(fs.begin(), fs.end()), std::vector<float>(fw.begin(), fw.end()));
  // More rows than the ring holds, and past the context, are refused.
  EXPECT_THROW(stored.store_target(0, 11, 7), Error);
  EXPECT_THROW(stored.store_target(1, 60, 5), Error);
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
