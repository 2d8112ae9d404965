// SPDX-License-Identifier: Apache-2.0
// Raw Unicode data tables (generated into unicode_tables.cpp by
// tools/tokenizer/gen_unicode_tables.py). Use the functions in unicode.h,
// not these arrays.
#pragma once

#include <cstddef>
#include <cstdint>

namespace specula::tokenizer::tables {

// Inclusive code point range [first, last] of one general category class
// (values of CharClass); code points in no range are class kOther.
struct CategoryRange {
  uint32_t first;
  uint32_t last;
  uint8_t cls;
};
// Inclusive code point range with one non-zero canonical combining class.
struct CombiningRange {
  uint32_t first;
  uint32_t last;
  uint8_t ccc;
};
// One-level canonical decomposition cp -> first [second]; second == 0 for singletons.
struct Decomposition {
  uint32_t cp;
  uint32_t first;
  uint32_t second;
};
// Canonical composition first + second -> composite (primary composites only).
struct Composition {
  uint32_t first;
  uint32_t second;
  uint32_t composite;
};

// All four arrays are sorted by their first field.
extern const CategoryRange kCategoryRanges[];
extern const size_t kCategoryRangeCount;
extern const CombiningRange kCombiningRanges[];
extern const size_t kCombiningRangeCount;
extern const Decomposition kDecompositions[];
extern const size_t kDecompositionCount;
extern const Composition kCompositions[];
extern const size_t kCompositionCount;

}  // namespace specula::tokenizer::tables
