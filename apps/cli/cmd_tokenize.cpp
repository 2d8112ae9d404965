// SPDX-License-Identifier: Apache-2.0
// `specula tokenize` / `specula detokenize`.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>

#include "apps/cli/commands.h"
#include "apps/cli/setup.h"

namespace specula::cli {
namespace {

struct TokenizeArgs {
  std::string tokenizer;
  std::string text;
  std::string text_file;  // "-": standard input
  std::string ids;
  bool no_special = false;
  bool skip_special = false;
  bool json = false;
};

std::string default_tokenizer(const std::string& given) {
  if (!given.empty()) return given;
  return models_root() + "/gemma4-tiny-py";
}

// The whole of a file or of standard input ("-"), bytes as they are (NUL included).
std::string read_text_file(const std::string& path) {
  if (path == "-") {
    std::string text{std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()};
    if (std::cin.bad()) fail("--text-file: cannot read standard input");
    return text;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("--text-file: cannot open {}", path);
  std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (in.bad()) fail("--text-file: cannot read {}", path);
  return text;
}

void run_tokenize(const TokenizeArgs& a, bool from_file) {
  Tokenizer tok = Tokenizer::load(default_tokenizer(a.tokenizer));
  const std::vector<int32_t> ids =
      tok.encode(from_file ? read_text_file(a.text_file) : a.text, !a.no_special);
  if (a.json) {
    nlohmann::json pieces = nlohmann::json::array();
    for (int32_t id : ids) pieces.push_back(tok.id_to_token(id).value_or(""));
    fmt::print("{}\n", nlohmann::json{{"ids", ids}, {"tokens", pieces}}.dump());
  } else {
    fmt::print("{}\n", fmt::join(ids, ","));
  }
}

void run_detokenize(const TokenizeArgs& a) {
  Tokenizer tok = Tokenizer::load(default_tokenizer(a.tokenizer));
  const std::vector<int32_t> ids = parse_id_list(a.ids, "--ids");
  for (int32_t id : ids) {
    if (id >= tok.vocab_size())
      fail("--ids: token id {} is outside the vocabulary of {} tokens", id, tok.vocab_size());
  }
  const std::string text = tok.decode(ids, a.skip_special);
  if (a.json) {
    fmt::print("{}\n", nlohmann::json{{"text", text}}.dump());
  } else {
    fmt::print("{}\n", text);
  }
}

}  // namespace

void register_tokenize(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* tok = app.add_subcommand("tokenize", "Print the token ids of a text");
  tok->add_option("--tokenizer", args->tokenizer,
                  "tokenizer.json or a model directory (default: the embedded model)");
  // Exactly one of --text and --text-file.
  CLI::Option_group* input = tok->add_option_group("input", "The text: exactly one of");
  input->add_option("--text", args->text, "Text to tokenize");
  CLI::Option* text_file =
      input->add_option("--text-file", args->text_file,
                        "File whose bytes are the text to tokenize ('-': standard input); for "
                        "texts with NUL bytes or too long for the command line");
  input->require_option(1);
  tok->add_flag("--no-special", args->no_special, "Do not add special tokens (BOS)");
  tok->add_flag("--json", args->json, "Print {\"ids\": [...], \"tokens\": [...]}");
  tok->callback([args, text_file] { run_tokenize(*args, text_file->count() > 0); });

  CLI::App* detok = app.add_subcommand("detokenize", "Print the text of token ids");
  detok->add_option("--tokenizer", args->tokenizer,
                    "tokenizer.json or a model directory (default: the embedded model)");
  detok->add_option("--ids", args->ids, "Token ids, comma-separated")->required();
  detok->add_flag("--skip-special", args->skip_special, "Leave special tokens out of the text");
  detok->add_flag("--json", args->json, "Print {\"text\": ...}");
  detok->callback([args] { run_detokenize(*args); });
}

}  // namespace specula::cli
