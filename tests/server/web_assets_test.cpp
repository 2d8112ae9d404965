// SPDX-License-Identifier: Apache-2.0
// The chat page compiled into the binary (server/web/web_assets.h).
#include "server/web/web_assets.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>
#include <string>

namespace specula::web {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

TEST(ChatPage, IsAnHtmlDocument) {
  const std::string_view page = chat_page_html();
  ASSERT_FALSE(page.empty());
  EXPECT_EQ(lower(page.substr(0, 15)), "<!doctype html>");
  EXPECT_NE(page.find("<title>specula</title>"), std::string_view::npos);
  // The ids the browser test (tests/server/node/chat_page_test.mjs) relies on.
  for (const char* id : {"id=\"input\"", "id=\"send\"", "id=\"messages\"", "id=\"model\""}) {
    EXPECT_NE(page.find(id), std::string_view::npos) << id;
  }
}

TEST(ChatPage, FetchesNothingFromElsewhere) {
  const std::string page = lower(chat_page_html());
  EXPECT_EQ(page.find("http://"), std::string::npos);
  EXPECT_EQ(page.find("https://"), std::string::npos);
  EXPECT_EQ(page.find("src=\"//"), std::string::npos);
  EXPECT_EQ(page.find("href=\"//"), std::string::npos);
  EXPECT_EQ(page.find("@import"), std::string::npos);
}

TEST(ChatPage, IsTheSourceFileByteForByte) {
  std::ifstream in(SPECULA_SOURCE_DIR "/server/web/index.html", std::ios::binary);
  ASSERT_TRUE(in) << "cannot open server/web/index.html";
  std::stringstream source;
  source << in.rdbuf();
  EXPECT_TRUE(source.str() == chat_page_html()) << "the embedded page is stale or mangled";
}

}  // namespace
}  // namespace specula::web
