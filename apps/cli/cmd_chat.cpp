// SPDX-License-Identifier: Apache-2.0
// `specula chat`: an interactive conversation rendered with the Gemma 4 chat
// format. The whole conversation is re-rendered and decoded each turn.
#include <fmt/format.h>
#include <unistd.h>

#include <iostream>
#include <memory>

#include "apps/cli/commands.h"
#include "apps/cli/setup.h"
#include "engine/chat/chat_format.h"
#include "engine/runtime/text_generation.h"

namespace specula::cli {
namespace {

struct ChatArgs {
  ModelArgs model;
  SamplingArgs sampling;
  speculative::DraftSchedule schedule;
  std::string system;
  bool quiet = false;
};

void run_chat(const ChatArgs& args) {
  LoadedModels m =
      load_models(args.model, /*with_draft=*/true, /*with_tokenizer=*/true, args.quiet);
  SamplingParams params = sampling_params(args.sampling, m);
  speculative::DraftSchedule schedule = args.schedule;
  resolve_schedule(schedule, m.draft_source.get());
  // A model turn ends with the end-of-turn token.
  if (auto end_turn = m.tokenizer->token_to_id("<turn|>"))
    params.stop_token_ids.push_back(*end_turn);
  const ChatOptions options = chat_options(m, args.quiet);

  std::vector<ChatMessage> messages;
  if (!args.system.empty()) messages.push_back(ChatMessage::text("system", args.system));
  const bool tty = isatty(STDIN_FILENO);
  if (!args.quiet)
    fmt::print(stderr,
               "chat: type a message; /reset clears the conversation, /exit or Ctrl-D ends\n");
  std::string line;
  while (true) {
    if (tty) {
      fmt::print("> ");
      std::fflush(stdout);
    }
    if (!std::getline(std::cin, line)) break;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      messages.resize(args.system.empty() ? 0 : 1);
      continue;
    }
    if (line.empty()) continue;
    messages.push_back(ChatMessage::text("user", line));
    // A line the turn cannot take (invalid UTF-8, past the context, ...) costs
    // that turn only: say why, forget the line, and read the next one.
    TextGenerationResult r;
    try {
      const std::string rendered = render_chat(messages, options);
      std::vector<int32_t> prompt = m.tokenizer->encode(rendered, /*add_special_tokens=*/false);
      r = generate_text(*m.target, m.draft_source.get(), *m.tokenizer, prompt, params, schedule,
                        [](std::string_view text) {
                          std::fwrite(text.data(), 1, text.size(), stdout);
                          std::fflush(stdout);
                          return true;
                        });
    } catch (const Error& e) {
      messages.pop_back();
      fmt::print(stderr, "specula: error: {} (this message is dropped; the chat goes on)\n",
                 e.what());
      continue;
    }
    fmt::print("\n");
    if (!args.quiet)
      fmt::print(stderr, "{} ({})\n", summary_line(r.stats, m.draft_source != nullptr),
                 r.finish_reason);
    messages.push_back(ChatMessage::text("assistant", r.text));
  }
}

}  // namespace

void register_chat(CLI::App& app) {
  auto args = std::make_shared<ChatArgs>();
  CLI::App* cmd =
      app.add_subcommand("chat", "Interactive chat in the Gemma 4 chat format (reads stdin)");
  add_model_options(cmd, args->model, /*with_draft=*/true);
  add_sampling_options(cmd, args->sampling, 256);
  add_draft_options(cmd, args->schedule);
  cmd->add_option("--system", args->system, "System prompt");
  cmd->add_flag("--quiet,-q", args->quiet, "No load messages or per-turn summaries on stderr");
  cmd->callback([args] { run_chat(*args); });
}

}  // namespace specula::cli
