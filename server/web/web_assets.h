// SPDX-License-Identifier: Apache-2.0
// The chat page served at "/": server/web/index.html (HTML, CSS and JS in one
// file, nothing fetched from elsewhere), compiled into the binary at build time.
#pragma once

#include <string_view>

namespace specula::web {

// The page's bytes (UTF-8 HTML).
std::string_view chat_page_html();

}  // namespace specula::web
