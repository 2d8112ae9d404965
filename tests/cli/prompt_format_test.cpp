// SPDX-License-Identifier: Apache-2.0
// bench --prompt-format's pieces (apps/cli/prompt_format.h): the first fenced
// code block of a turn (DeepSpec's HumanEval wrapping undone byte for byte,
// info strings, CRLF, empty and unclosed blocks), and prompt_text's errors
// naming the file and line.
#include <gtest/gtest.h>

#include <string>

#include "apps/cli/prompt_format.h"
#include "apps/cli/prompt_set.h"
#include "engine/core/error.h"

namespace specula::cli {
namespace {

using Status = CodeBlock::Status;

PromptEntry text_entry(std::string text, int line) {
  PromptEntry e;
  e.text = std::move(text);
  e.is_text = true;
  e.line = line;
  return e;
}

// The error message of f(), or "" when it does not throw.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(FirstCodeBlock, UndoesDeepSpecHumanEvalWrapping) {
  // tools of DeepSpec: "...tests:\n```python\n{prompt}\n```", and HumanEval
  // prompts end with one newline.
  const std::string prompt =
      "from typing import List\n\n\ndef f(x: List[int]) -> int:\n    \"\"\" Doc.\n    \"\"\"\n";
  const std::string turn =
      "Write a solution to the following problem and make sure that it passes the tests:\n"
      "```python\n" +
      prompt + "\n```";
  const CodeBlock b = first_code_block(turn);
  EXPECT_EQ(b.status, Status::kFound);
  EXPECT_EQ(b.code, prompt);
  EXPECT_EQ(b.open_line, 2);
}

TEST(FirstCodeBlock, TakesTheFirstOfSeveralAndIgnoresInlineBackticks) {
  const CodeBlock b = first_code_block(
      "see `x` and ```not a fence```\n```\na = 1\nb = 2\n```\ntext\n```c\nint y;\n```\n");
  EXPECT_EQ(b.status, Status::kFound);
  EXPECT_EQ(b.code, "a = 1\nb = 2");
  EXPECT_EQ(b.open_line, 2);
}

TEST(FirstCodeBlock, IndentedFencesAndCrlf) {
  CodeBlock b = first_code_block("intro\n  ```py\n  x = 1\n  ```  \n");
  EXPECT_EQ(b.status, Status::kFound);
  EXPECT_EQ(b.code, "  x = 1");
  b = first_code_block("intro\r\n```py\r\nx = 1\r\ny = 2\r\n```\r\n");
  EXPECT_EQ(b.status, Status::kFound);
  EXPECT_EQ(b.code, "x = 1\r\ny = 2");
}

TEST(FirstCodeBlock, EmptyNoneAndUnclosed) {
  CodeBlock b = first_code_block("```\n```");
  EXPECT_EQ(b.status, Status::kFound);
  EXPECT_EQ(b.code, "");
  EXPECT_EQ(first_code_block("").status, Status::kNone);
  EXPECT_EQ(first_code_block("just text, `inline` only\n").status, Status::kNone);
  b = first_code_block("a\nb\n```python\ncode\n");
  EXPECT_EQ(b.status, Status::kUnclosed);
  EXPECT_EQ(b.open_line, 3);
  EXPECT_EQ(first_code_block("text ```").status, Status::kNone);  // not at a line's start
  EXPECT_EQ(first_code_block("```python").status, Status::kUnclosed);
  // A line holding more than the fence does not close the block.
  EXPECT_EQ(first_code_block("```\ncode\n``` trailing words\n").status, Status::kUnclosed);
}

TEST(PromptText, FormatsAndNamesFileAndLineInErrors) {
  const PromptEntry code = text_entry("Do:\n```python\ndef f():\n```", 7);
  EXPECT_EQ(prompt_text(code, PromptFormat::kCodeBlock, "set.jsonl"), "def f():");
  EXPECT_EQ(prompt_text(code, PromptFormat::kText, "set.jsonl"), code.text);
  EXPECT_EQ(prompt_text(code, PromptFormat::kChat, "set.jsonl"), code.text);

  std::string err = error_of(
      [] { prompt_text(text_entry("no block here", 3), PromptFormat::kCodeBlock, "set.jsonl"); });
  EXPECT_NE(err.find("set.jsonl:3"), std::string::npos) << err;
  EXPECT_NE(err.find("no fenced ``` code block"), std::string::npos) << err;
  err = error_of(
      [] { prompt_text(text_entry("x\n```py\ny", 4), PromptFormat::kCodeBlock, "set.jsonl"); });
  EXPECT_NE(err.find("set.jsonl:4"), std::string::npos) << err;
  EXPECT_NE(err.find("opened on line 2"), std::string::npos) << err;
  err = error_of(
      [] { prompt_text(text_entry("```\n  \n```", 5), PromptFormat::kCodeBlock, "set.jsonl"); });
  EXPECT_NE(err.find("set.jsonl:5"), std::string::npos) << err;
  EXPECT_NE(err.find("is empty"), std::string::npos) << err;

  PromptEntry ids;
  ids.ids = {2, 5, 9};
  ids.line = 2;
  EXPECT_EQ(prompt_text(ids, PromptFormat::kText, "set.jsonl"), "");
  err = error_of([&] { prompt_text(ids, PromptFormat::kChat, "set.jsonl"); });
  EXPECT_NE(err.find("set.jsonl:2"), std::string::npos) << err;
  EXPECT_NE(err.find("--prompt-format chat"), std::string::npos) << err;
}

TEST(PromptFormatName, ParsesAndRefuses) {
  EXPECT_EQ(parse_prompt_format("text"), PromptFormat::kText);
  EXPECT_EQ(parse_prompt_format("chat"), PromptFormat::kChat);
  EXPECT_EQ(parse_prompt_format("code-block"), PromptFormat::kCodeBlock);
  const std::string err = error_of([] { parse_prompt_format("markdown"); });
  EXPECT_NE(err.find("'markdown'"), std::string::npos) << err;
}

}  // namespace
}  // namespace specula::cli
