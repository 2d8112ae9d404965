// SPDX-License-Identifier: Apache-2.0
// SHA-256 (FIPS 180-4), used to recognise chat templates by digest without
// shipping their text. Incremental: update() any number of times, then digest.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace specula {

class Sha256 {
 public:
  Sha256();
  void update(std::string_view bytes);
  // Finishes the hash; the object must not be updated afterwards.
  std::array<uint8_t, 32> digest();
  // Lower-case hex of digest().
  std::string hex_digest();

 private:
  void compress(const uint8_t* block);

  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> buffer_{};
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

// One-shot lower-case hex SHA-256 of `bytes`.
std::string sha256_hex(std::string_view bytes);

}  // namespace specula
