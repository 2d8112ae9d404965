// SPDX-License-Identifier: Apache-2.0
// Token id lists given on the command line (--prompt-ids, --ids).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace specula::io {

// Parses "1,2,3" (spaces allowed around and instead of commas) into token ids:
// non-negative decimal integers that fit int32. An Error starting with `flag`
// names the bad item; an empty list is an Error too.
std::vector<int32_t> parse_id_list(const std::string& text, const char* flag);

}  // namespace specula::io
