// SPDX-License-Identifier: Apache-2.0
#include "server/web/web_assets.h"

#include <cstddef>

namespace specula::web {

namespace detail {
// web_page.cpp, generated from index.html by embed.cmake at build time.
extern const unsigned char kChatPage[];
extern const std::size_t kChatPageSize;
}  // namespace detail

std::string_view chat_page_html() {
  return {reinterpret_cast<const char*>(detail::kChatPage), detail::kChatPageSize};
}

}  // namespace specula::web
