// SPDX-License-Identifier: Apache-2.0
// DSpark parity with PyTorch on the CPU (docs/dspark.md, "Golden fixtures"):
// tests/golden/dspark (specula layout) and tests/golden/dspark_deepspec
// (DeepSpec's own modeling code), every round within 1e-5. The check itself
// (dspark_golden_check.h) is shared with the CUDA test. Skips while a fixture
// is absent.
#include <gtest/gtest.h>

#include "tests/unit/dspark/dspark_golden_check.h"

namespace specula {
namespace {

TEST(DSparkGolden, SpeculaLayoutMatchesPyTorch) {
  testing::check_dspark_fixture("dspark");
}
TEST(DSparkGolden, DeepSpecLayoutMatchesDeepSpec) {
  testing::check_dspark_fixture("dspark_deepspec");
}

}  // namespace
}  // namespace specula
