// SPDX-License-Identifier: Apache-2.0
// A small, dependency-free fuzzing driver for LLVMFuzzerTestOneInput targets, so
// CI can fuzz for a bounded time with any compiler (gcc + ASan included). It is
// not coverage-guided: it mutates seeds at random (bit flips, byte inserts and
// deletes, chunk copies, splices, interesting integers in binary and as JSON
// numbers, JSON tokens, and strings lifted from the seeds). As a stand-in for
// coverage, each target reports an outcome (which check rejected the input, or
// the shape of what it accepted); inputs with new outcomes become seeds.
//
// Usage: <target> [--seconds N] [--seed S] [--max-len L] [--artifact-dir D] PATH...
// Every PATH is a corpus directory (each file a seed) or one file; all seeds
// are run once unmutated first (replaying a saved crash input works that way).
// On a crash, sanitizer report or escaping exception, the input being run is
// written to D/crash-<target>-<n> (default D = current directory).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_target.h"

extern "C" void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

namespace {

using Bytes = std::vector<uint8_t>;

// What the crash handlers write out; set before each run, read only in handlers.
const uint8_t* volatile g_input = nullptr;
volatile size_t g_input_size = 0;
char g_artifact[4096] = "crash-input";

void write_artifact() {
  const int fd = ::open(g_artifact, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  size_t done = 0;
  while (done < g_input_size) {
    const ssize_t n = ::write(fd, g_input + done, g_input_size - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  static const char kMsg[] = "\nfuzz_driver: input that crashed written to ";
  (void)!::write(2, kMsg, sizeof(kMsg) - 1);
  (void)!::write(2, g_artifact, std::strlen(g_artifact));
  (void)!::write(2, "\n", 1);
}

void on_fatal_signal(int sig) {
  write_artifact();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

struct Options {
  double seconds = 10;
  uint64_t seed = 1;
  size_t max_len = 8192;
  std::string artifact_dir = ".";
  std::vector<std::string> paths;
};

[[noreturn]] void usage(const char* argv0, const std::string& problem) {
  std::fprintf(stderr,
               "%s: %s\nusage: %s [--seconds N] [--seed S] [--max-len L] [--artifact-dir D] "
               "CORPUS_DIR_OR_FILE...\n",
               argv0, problem.c_str(), argv0);
  std::exit(2);
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(argv[0], a + " needs a value");
      return argv[++i];
    };
    try {
      if (a == "--seconds") {
        o.seconds = std::stod(value());
      } else if (a == "--seed") {
        o.seed = std::stoull(value());
      } else if (a == "--max-len") {
        o.max_len = std::stoull(value());
      } else if (a == "--artifact-dir") {
        o.artifact_dir = value();
      } else if (a.rfind("--", 0) == 0) {
        usage(argv[0], "unknown option " + a);
      } else {
        o.paths.push_back(a);
      }
    } catch (const std::logic_error&) {
      usage(argv[0], "bad value for " + a);
    }
  }
  if (o.paths.empty()) usage(argv[0], "no corpus given");
  if (o.max_len == 0) usage(argv[0], "--max-len must be positive");
  return o;
}

Bytes read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<Bytes> load_seeds(const std::vector<std::string>& paths) {
  std::vector<Bytes> seeds;
  for (const std::string& p : paths) {
    std::error_code ec;
    if (std::filesystem::is_directory(p, ec)) {
      std::vector<std::filesystem::path> files;
      for (const auto& e : std::filesystem::directory_iterator(p)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
      std::sort(files.begin(), files.end());  // deterministic for a given seed
      for (const auto& f : files) seeds.push_back(read_file(f));
    } else if (std::filesystem::is_regular_file(p, ec)) {
      seeds.push_back(read_file(p));
    } else {
      std::fprintf(stderr, "fuzz_driver: no such corpus file or directory: %s\n", p.c_str());
      std::exit(2);
    }
  }
  if (seeds.empty()) seeds.push_back(Bytes{'{', '}'});
  return seeds;
}

// Quoted strings in the seeds ("dtype", "full_attention", ...): splicing known
// keys and values in is what lets random mutation reach deep validation code.
std::vector<std::string> dictionary_from(const std::vector<Bytes>& seeds) {
  std::set<std::string> words;
  for (const Bytes& s : seeds) {
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] != '"') continue;
      size_t j = i + 1;
      while (j < s.size() && s[j] != '"' && j - i < 64) ++j;
      if (j < s.size() && s[j] == '"') {
        words.insert(
            std::string(s.begin() + static_cast<long>(i), s.begin() + static_cast<long>(j) + 1));
        i = j;
      }
    }
  }
  return {words.begin(), words.end()};
}

class Mutator {
 public:
  Mutator(uint64_t seed, size_t max_len, std::vector<std::string> dictionary)
      : rng_(seed), max_len_(max_len), dictionary_(std::move(dictionary)) {}

  size_t below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(rng_() % n); }

  // Applies 1 to 4 random mutations to `d`, using `pool` for splices.
  void mutate(Bytes& d, const std::vector<Bytes>& pool) {
    const size_t n = 1 + below(4);
    for (size_t i = 0; i < n; ++i) mutate_once(d, pool);
    if (d.size() > max_len_) d.resize(max_len_);
  }

 private:
  // Inserts `s` at a random place, or half the time puts it over a short run
  // of bytes (so one number or token replaces another).
  void insert_text(Bytes& d, const std::string& s) {
    const size_t at = below(d.size() + 1);
    if (below(2) == 0 && at < d.size()) {
      const size_t len = std::min(d.size() - at, 1 + below(8));
      d.erase(d.begin() + static_cast<long>(at), d.begin() + static_cast<long>(at + len));
    }
    d.insert(d.begin() + static_cast<long>(at), s.begin(), s.end());
  }

  void mutate_once(Bytes& d, const std::vector<Bytes>& pool) {
    static const char* const kNumbers[] = {"0",
                                           "-1",
                                           "1",
                                           "2",
                                           "-0",
                                           "0.5",
                                           "1e-9",
                                           "1.5e3",
                                           "65536",
                                           "4096",
                                           "2147483647",
                                           "-2147483648",
                                           "2147483648",
                                           "4294967295",
                                           "4294967296",
                                           "9223372036854775807",
                                           "9223372036854775808",
                                           "-9223372036854775809",
                                           "18446744073709551615",
                                           "18446744073709551616",
                                           "1e308",
                                           "1e309",
                                           "-1e309",
                                           "99999999999999999999999"};
    static const char* const kTokens[] = {"{",  "}",       "[",    "]",     "\"",   ",",
                                          ":",  "null",    "true", "false", "\"\"", "{}",
                                          "[]", "\\u0000", "\\",   " "};
    static const uint64_t kInts[] = {0,
                                     1,
                                     0x7f,
                                     0x80,
                                     0xff,
                                     0x7fff,
                                     0xffff,
                                     0x7fffffff,
                                     0xffffffff,
                                     0x100000000ull,
                                     0x7fffffffffffffffull,
                                     0xffffffffffffffffull};
    switch (below(11)) {
      case 0:  // flip one bit
        if (!d.empty()) d[below(d.size())] ^= static_cast<uint8_t>(1u << below(8));
        break;
      case 1:  // overwrite one byte
        if (!d.empty()) d[below(d.size())] = static_cast<uint8_t>(rng_());
        break;
      case 2: {  // insert random bytes
        const size_t at = below(d.size() + 1);
        const size_t len = 1 + below(4);
        for (size_t i = 0; i < len; ++i)
          d.insert(d.begin() + static_cast<long>(at), static_cast<uint8_t>(rng_()));
        break;
      }
      case 3: {  // delete a range
        if (d.empty()) break;
        const size_t at = below(d.size());
        const size_t len = 1 + below(std::min<size_t>(d.size() - at, 16));
        d.erase(d.begin() + static_cast<long>(at), d.begin() + static_cast<long>(at + len));
        break;
      }
      case 4: {  // copy a chunk of the input elsewhere in it
        if (d.empty()) break;
        const size_t from = below(d.size());
        const size_t len = 1 + below(std::min<size_t>(d.size() - from, 64));
        const Bytes chunk(d.begin() + static_cast<long>(from),
                          d.begin() + static_cast<long>(from + len));
        d.insert(d.begin() + static_cast<long>(below(d.size() + 1)), chunk.begin(), chunk.end());
        break;
      }
      case 5: {  // splice: our prefix, another input's suffix
        const Bytes& other = pool[below(pool.size())];
        const size_t cut = below(d.size() + 1);
        const size_t from = below(other.size() + 1);
        d.resize(cut);
        d.insert(d.end(), other.begin() + static_cast<long>(from), other.end());
        break;
      }
      case 6: {  // an interesting integer, little-endian, over 1/2/4/8 bytes
        const uint64_t v = kInts[below(std::size(kInts))];
        const size_t width = size_t{1} << below(4);
        if (d.size() < width) break;
        const size_t at = below(d.size() - width + 1);
        for (size_t i = 0; i < width; ++i) d[at + i] = static_cast<uint8_t>(v >> (8 * i));
        break;
      }
      case 7:
      case 8:  // an interesting number as JSON text
        insert_text(d, kNumbers[below(std::size(kNumbers))]);
        break;
      case 9:
        insert_text(d, kTokens[below(std::size(kTokens))]);
        break;
      case 10:
        if (!dictionary_.empty()) insert_text(d, dictionary_[below(dictionary_.size())]);
        break;
    }
  }

  std::mt19937_64 rng_;
  size_t max_len_;
  std::vector<std::string> dictionary_;
};

// Runs the target on `d`, keeping it where the crash handlers can find it.
void run_one(const Bytes& d) {
  g_input = d.data();
  g_input_size = d.size();
  LLVMFuzzerTestOneInput(d.data(), d.size());
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse_args(argc, argv);
  const std::string name = std::filesystem::path(argv[0]).filename().string();
  std::snprintf(g_artifact, sizeof(g_artifact), "%s/crash-%s-seed%llu", opt.artifact_dir.c_str(),
                name.c_str(), static_cast<unsigned long long>(opt.seed));
  if (__sanitizer_set_death_callback != nullptr) {
    // Under a sanitizer its own handlers report SEGV/BUS/FPE (with a stack
    // trace) and then call the death callback; we catch only what it ignores.
    __sanitizer_set_death_callback(write_artifact);
    for (int sig : {SIGILL, SIGABRT, SIGTRAP}) std::signal(sig, on_fatal_signal);
  } else {
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP}) {
      std::signal(sig, on_fatal_signal);
    }
  }

  std::vector<Bytes> pool = load_seeds(opt.paths);
  const size_t n_seeds = pool.size();
  const size_t max_pool = n_seeds + 1024;
  Mutator mutator(opt.seed, opt.max_len, dictionary_from(pool));

  uint64_t runs = 0, accepted = 0;
  std::set<uint64_t> outcomes;  // distinct outcomes seen: the only feedback we have
  for (size_t i = 0; i < n_seeds; ++i) {
    run_one(pool[i]);
    ++runs;
    accepted += specula::fuzz::last_accepted;
    outcomes.insert(specula::fuzz::last_outcome);
  }
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration<double>(opt.seconds);
  Bytes d;
  while (std::chrono::steady_clock::now() < deadline) {
    d = pool[mutator.below(pool.size())];
    mutator.mutate(d, pool);
    run_one(d);
    ++runs;
    accepted += specula::fuzz::last_accepted;
    // An input with a new outcome becomes a seed; once the pool is full it
    // replaces a random non-original one.
    if (outcomes.insert(specula::fuzz::last_outcome).second) {
      if (pool.size() < max_pool) {
        pool.push_back(d);
      } else {
        pool[n_seeds + mutator.below(max_pool - n_seeds)] = d;
      }
    }
  }
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "%s: %llu runs in %.1f s (seed %llu), %llu accepted, %zu outcomes, %zu seeds, pool %zu: no "
      "crash\n",
      name.c_str(), static_cast<unsigned long long>(runs), elapsed,
      static_cast<unsigned long long>(opt.seed), static_cast<unsigned long long>(accepted),
      outcomes.size(), n_seeds, pool.size());
  return 0;
}
