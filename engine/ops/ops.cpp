// SPDX-License-Identifier: Apache-2.0
// The op contracts live in backend.h; this file keeps the ops library non-empty
// and holds shared validation helpers as they appear.
#include "engine/ops/backend.h"
