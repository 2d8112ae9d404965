// SPDX-License-Identifier: Apache-2.0
// Encode/decode throughput of specula::Tokenizer on a text file, single
// threaded. Optionally checks the ids against a golden int32 file.
//
//   bench_tokenizer --tokenizer ~/.cache/specula/tokenizer-gemma3
//       --text tests/golden/tokenizer/gemma_corpus.txt
//       --ids tests/golden/tokenizer/gemma_corpus.ids.bin --reps 5
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/tokenizer/tokenizer.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) specula::fail("{}: cannot open file", path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Best-of-reps wall time of fn().
template <typename F>
double best_time(int reps, F&& fn) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"specula tokenizer throughput"};
  std::string tokenizer_path, text_path, ids_path;
  int reps = 3;
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json or its folder")->required();
  app.add_option("--text", text_path, "UTF-8 text file to encode")->required();
  app.add_option("--ids", ids_path, "expected ids of the whole file (int32 little-endian)");
  app.add_option("--reps", reps, "repetitions (best time is reported)");
  CLI11_PARSE(app, argc, argv);

  try {
    auto t0 = std::chrono::steady_clock::now();
    const specula::Tokenizer tok = specula::Tokenizer::load(tokenizer_path);
    const double load_s = seconds_since(t0);
    const std::string text = read_file(text_path);
    const double mb = static_cast<double>(text.size()) / 1e6;

    std::vector<std::string_view> lines;
    for (size_t pos = 0; pos <= text.size();) {
      size_t end = text.find('\n', pos);
      if (end == std::string::npos) end = text.size();
      lines.push_back(std::string_view(text).substr(pos, end - pos));
      pos = end + 1;
    }

    std::vector<int32_t> ids;
    const double whole_s = best_time(reps, [&] { ids = tok.encode(text, false); });
    size_t line_ids = 0;
    const double lines_s = best_time(reps, [&] {
      line_ids = 0;
      for (std::string_view line : lines) line_ids += tok.encode(line, false).size();
    });
    std::string decoded;
    const double decode_s = best_time(reps, [&] { decoded = tok.decode(ids, false); });

    std::string check = "not checked";
    if (!ids_path.empty()) {
      const std::string bin = read_file(ids_path);
      std::vector<int32_t> expected(bin.size() / 4);
      std::memcpy(expected.data(), bin.data(), expected.size() * 4);
      check = expected == ids ? "ids match" : "IDS DIFFER";
    }
    fmt::print("load {:.2f} s; text {:.2f} MB, {} ids ({:.2f} bytes/id), {} lines; {}\n", load_s,
               mb, ids.size(), static_cast<double>(text.size()) / std::max<size_t>(ids.size(), 1),
               lines.size(), check);
    fmt::print("encode whole text: {:.3f} s = {:.2f} MB/s\n", whole_s, mb / whole_s);
    fmt::print("encode per line:   {:.3f} s = {:.2f} MB/s\n", lines_s, mb / lines_s);
    fmt::print("decode:            {:.3f} s = {:.2f} MB/s of text\n", decode_s,
               static_cast<double>(decoded.size()) / 1e6 / decode_s);
    fmt::print("{{\"whole_MBps\": {:.3f}, \"per_line_MBps\": {:.3f}, \"decode_MBps\": {:.3f}}}\n",
               mb / whole_s, mb / lines_s, static_cast<double>(decoded.size()) / 1e6 / decode_s);
    return check == "IDS DIFFER" ? 1 : 0;
  } catch (const specula::Error& e) {
    fmt::print(stderr, "bench_tokenizer: {}\n", e.what());
    return 1;
  }
}
