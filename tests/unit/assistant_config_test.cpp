// SPDX-License-Identifier: Apache-2.0
// The assistant drafter's config.json: fields of a wrong type give an Error
// naming the file, the field and the value, never the JSON library's own.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "engine/core/error.h"
#include "engine/draft/assistant/assistant.h"
#include "engine/io/json_util.h"

namespace specula::assistant {
namespace {

using nlohmann::json;

const std::string kFixture =
    std::string(SPECULA_SOURCE_DIR) + "/tests/golden/dense_kev_assistant/config.json";

class AssistantConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           fmt::format("specula_assistant_cfg_{}", ::getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes the fixture's config changed by `edit` and returns the load's error message.
  std::string error_of(const std::function<void(json&)>& edit) {
    json config = io::read_json_file(kFixture);
    edit(config);
    std::ofstream(dir_ / "config.json") << config.dump(2);
    try {
      (void)load_assistant_config(dir_.string());
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "expected an Error";
    return "";
  }

  std::string file() const { return (dir_ / "config.json").string(); }
  std::filesystem::path dir_;
};

TEST_F(AssistantConfigTest, FixtureLoads) {
  const AssistantConfig c = load_assistant_config(kFixture);
  EXPECT_EQ(c.backbone_hidden_size, 32);
  EXPECT_EQ(c.text.num_kv_shared_layers, c.text.num_hidden_layers);
}

TEST_F(AssistantConfigTest, ModelTypeNotAString) {
  const std::string msg = error_of([](json& c) { c["model_type"] = true; });
  EXPECT_NE(msg.find(file()), std::string::npos) << msg;
  EXPECT_NE(msg.find("model_type must be a string, got true"), std::string::npos) << msg;
}

TEST_F(AssistantConfigTest, KvSharedLayersNotAnInteger) {
  const std::string msg =
      error_of([](json& c) { c["text_config"]["num_kv_shared_layers"] = json::array(); });
  EXPECT_NE(msg.find(file()), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_kv_shared_layers must be an integer, got []"), std::string::npos) << msg;
}

TEST_F(AssistantConfigTest, HiddenLayersNotAnInteger) {
  const std::string msg = error_of([](json& c) { c["text_config"]["num_hidden_layers"] = "two"; });
  EXPECT_NE(msg.find(file()), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_hidden_layers must be an integer, got \"two\""), std::string::npos)
      << msg;
}

TEST_F(AssistantConfigTest, RootFieldsOfWrongType) {
  std::string msg = error_of([](json& c) { c["use_ordered_embeddings"] = "yes"; });
  EXPECT_NE(msg.find("use_ordered_embeddings must be true or false, got \"yes\""),
            std::string::npos)
      << msg;
  msg = error_of([](json& c) { c["num_centroids"] = 1.5; });
  EXPECT_NE(msg.find("num_centroids must be an integer, got 1.5"), std::string::npos) << msg;
  msg = error_of([](json& c) { c["backbone_hidden_size"] = 1ll << 40; });
  EXPECT_NE(msg.find("backbone_hidden_size is out of range"), std::string::npos) << msg;
}

}  // namespace
}  // namespace specula::assistant
