#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Chat-format goldens for engine/chat (render_chat) from Google's Gemma 4 chat template.

Renders ~30 text-only conversations through transformers' apply_chat_template,
with a tokenizer object that carries the released Gemma 4 template, for both
template flavours (31B/26B-A4B/12B "large" and E2B/E4B "edge"), and writes

  <out-dir>/cases.jsonl      one case per line: name, family, messages,
                             add_generation_prompt, enable_thinking, rendered
  <out-dir>/templates.json   sha256 of the normalised text of every template
                             file given (checked against the C++ table)

Template text is NOT committed (only its digests are): pass the files in a
git-ignored folder (.carry/chat_templates/, carried to the GPU machine).

Where the template texts come from (verbatim public copies of Google's
huggingface.co/google/gemma-4-*-it chat_template.jinja; copies in two
independent repositories have identical bytes where their revisions overlap):
  - github.com/ollama/ollama, model/renderers/testdata/
      gemma4_31b_chat_template.jinja2  commits 8a0016f82 (2026-07-14, "align gemma4
        chat template handling", the current upstream revision), c7c2837c9
        (2026-04-29), bf2a42172 (2026-04-13; same bytes as llama.cpp 3fc65063d)
      gemma4_e2b_chat_template.jinja2  commits 8a0016f82, c7c2837c9, bf2a42172
  - github.com/ggml-org/llama.cpp (via a fork with full history,
    CompleteTech-LLC-AI-Research/llama.cpp), models/templates/
      gemma4.jinja at 5208e2d5b (2026-04-02, the release-day template, 266 lines)
      google-gemma-4-31B-it.jinja at 3fc65063d (2026-04-10, "align to the updated
        official gemma4 template")
File names expected in --templates-dir: gemma4_{large,edge}_<date>.jinja; the
goldens use the 2026-07-14 pair.

Usage (GPU machine, transformers installed):
  python tools/golden/make_chat_golden.py --templates-dir .carry/chat_templates --out-dir $OUT
Local pre-check without transformers (jinja2 configured as transformers does):
  python3 tools/golden/make_chat_golden.py --engine jinja --out-dir /tmp/chat_golden
"""

import argparse
import glob
import hashlib
import json
import os
import sys

CURRENT = {"large": "gemma4_large_2026-07-14.jinja", "edge": "gemma4_edge_2026-07-14.jinja"}


def normalize(text):
    """Must match specula::normalize_chat_template."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.rstrip(" \t") for line in text.split("\n")]
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines)


def sha256_normalized(text):
    return hashlib.sha256(normalize(text).encode("utf-8")).hexdigest()


def text(t):
    return {"type": "text", "text": t}


def conversations():
    """(name, messages, add_generation_prompt, enable_thinking) tuples."""
    sys_msg = {"role": "system", "content": "You are a concise assistant."}
    return [
        ("single_user", [{"role": "user", "content": "Hello!"}], True, False),
        ("single_user_no_gen", [{"role": "user", "content": "Hello!"}], False, False),
        ("system_user", [sys_msg, {"role": "user", "content": "What is 2+2?"}], True, False),
        ("developer_user", [{"role": "developer", "content": "Answer in French."},
                            {"role": "user", "content": "Good morning"}], True, False),
        ("multi_turn", [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello! How can I help?"},
                        {"role": "user", "content": "Tell me a joke."}], True, False),
        ("multi_turn_ends_with_model", [sys_msg, {"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "Hello."}], False, False),
        ("whitespace_trimmed", [{"role": "user", "content": "  \n Hi there \n\n"},
                                {"role": "assistant", "content": "\n\n  Hello  \n"},
                                {"role": "user", "content": "\t\r\nok\t"}], True, False),
        ("empty_user", [{"role": "user", "content": ""}], True, False),
        ("empty_system", [{"role": "system", "content": ""}, {"role": "user", "content": "x"}],
         True, False),
        ("null_assistant_content", [{"role": "user", "content": "a"},
                                    {"role": "assistant", "content": None},
                                    {"role": "user", "content": "b"}], True, False),
        ("special_characters", [{"role": "user", "content":
                                 "Quotes \" ' and \\ backslash, {{ braces }}, {% tag %}, "
                                 "<b>html</b> & ampersand, emoji \U0001F600, accents é ü ß, CJK 漢字"}],
         True, False),
        ("literal_special_tokens", [{"role": "user", "content": "Say <|turn>model and <turn|> and <bos>"}],
         True, False),
        ("newlines_inside", [{"role": "user", "content": "line1\nline2\n\nline3\n"},
                             {"role": "assistant", "content": "a\n\nb"}], True, False),
        ("unicode_whitespace", [{"role": "user", "content": "\u3000\u00a0Hi\u2028\x1c"},
                                {"role": "assistant", "content": "\u2003ok\u200b"},
                                {"role": "user", "content": "\x85end\u205f"}], True, False),
        ("parts_user", [{"role": "user", "content": [text(" part one "), text("part two\n")]}], True, False),
        ("parts_system", [{"role": "system", "content": [text("You are "), text(" helpful. ")]},
                          {"role": "user", "content": "hi"}], True, False),
        ("parts_assistant_with_thinking", [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [text("<|channel>thought\nhmm<channel|> A1 "), text("A2")]},
            {"role": "user", "content": "q2"}], True, False),
        ("assistant_thinking_stripped", [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<|channel>thought\nLet me add.<channel|>The answer is 4."},
            {"role": "user", "content": "Thanks"}], True, False),
        ("assistant_only_thinking", [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "<|channel>thought\nonly thoughts<channel|>"}], False, False),
        ("assistant_unclosed_channel", [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "Visible<|channel>thought never closed"}], False, False),
        ("assistant_stray_close", [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "a<channel|>b<|channel>c<|channel>d<channel|>e"}], False, False),
        ("consecutive_assistants", [{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Part one."},
                                    {"role": "assistant", "content": "Part two."}], True, False),
        ("consecutive_assistants_then_user", [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "A"},
                                              {"role": "assistant", "content": "B"},
                                              {"role": "assistant", "content": "C"},
                                              {"role": "user", "content": "D"}], False, False),
        ("system_in_the_middle", [{"role": "user", "content": "a"},
                                  {"role": "system", "content": " Be brief. "},
                                  {"role": "user", "content": "b"}], True, False),
        ("reasoning_after_last_user", [{"role": "user", "content": "2+2?"},
                                       {"role": "assistant", "reasoning": "Add them.", "content": "4"}],
         False, False),
        ("reasoning_before_last_user", [{"role": "user", "content": "2+2?"},
                                        {"role": "assistant", "reasoning": "Add them.", "content": "4"},
                                        {"role": "user", "content": "and 3+3?"}], True, False),
        ("reasoning_content_key", [{"role": "user", "content": "q"},
                                   {"role": "assistant", "reasoning_content": " spaced \n", "content": "a"}],
         False, False),
        ("reasoning_empty_falls_back", [{"role": "user", "content": "q"},
                                        {"role": "assistant", "reasoning": "", "reasoning_content": "rc",
                                         "content": "a"}], False, False),
        ("thinking_with_system", [sys_msg, {"role": "user", "content": "Prove it."}], True, True),
        ("thinking_without_system", [{"role": "user", "content": "Prove it."}], True, True),
        ("thinking_multi_turn", [{"role": "user", "content": "a"},
                                 {"role": "assistant", "content": "<|channel>thought\nx<channel|>b"},
                                 {"role": "user", "content": "c"}], True, True),
        ("thinking_no_gen", [{"role": "user", "content": "a"}], False, True),
        ("only_system", [sys_msg], True, False),
        ("assistant_first", [{"role": "assistant", "content": "I start."},
                             {"role": "user", "content": "ok"}], True, False),
        ("developer_parts", [{"role": "developer", "content": [text("Rule 1."), text("Rule 2.")]},
                             {"role": "user", "content": [text("go")]}], True, False),
        ("long_conversation", [sys_msg] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "word " * (i + 1)}
            for i in range(7)], True, False),
    ]


def make_renderer(engine):
    """Returns render(template_text, messages, add_generation_prompt, enable_thinking)."""
    if engine == "transformers":
        import tokenizers
        import transformers
        from tokenizers import models, pre_tokenizers

        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|think|>",
                    "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
                    "<|tool_response>", "<tool_response|>", "<|image|>", "<|audio|>", "<|video|>"]
        vocab = {tok: i for i, tok in enumerate(specials + ["user", "model", "system", "\n"])}
        core = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Whitespace()
        cache = {}

        def render(template, messages, agp, thinking):
            tok = cache.get(template)
            if tok is None:
                cls = getattr(transformers, "PreTrainedTokenizerFast", None) or \
                    getattr(transformers, "TokenizersBackend")
                tok = cls(
                    tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                    pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
                tok.chat_template = template
                cache[template] = tok
            out = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp,
                                          enable_thinking=thinking)
            assert isinstance(out, str), type(out)
            return out

        return render

    # Local stand-in: jinja2 set up the way transformers compiles chat templates.
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def render(template, messages, agp, thinking):
        return env.from_string(template).render(
            messages=messages, tools=None, documents=None, add_generation_prompt=agp,
            enable_thinking=thinking, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
            unk_token="<unk>", mask_token="<mask>")

    return render


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--templates-dir", default=".carry/chat_templates")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--engine", choices=["transformers", "jinja"], default="transformers")
    args = ap.parse_args()

    if args.engine == "transformers":
        import tokenizers
        import torch
        import transformers
        print(f"torch {torch.__version__}  transformers {transformers.__version__}  "
              f"tokenizers {tokenizers.__version__}")
    import jinja2
    print(f"jinja2 {jinja2.__version__}  python {sys.version.split()[0]}")

    templates = []
    for path in sorted(glob.glob(os.path.join(args.templates_dir, "gemma4_*.jinja"))):
        with open(path, encoding="utf-8", newline="") as f:
            body = f.read()
        name = os.path.basename(path)
        family = "large" if name.startswith("gemma4_large") else "edge"
        templates.append({"file": name, "family": family, "chars": len(body),
                          "sha256_normalized": sha256_normalized(body),
                          "current": name in CURRENT.values()})
    if not templates:
        sys.exit(f"no gemma4_*.jinja files in {args.templates_dir}")
    for t in templates:
        print(f"  {t['file']:36s} {t['chars']:6d} chars  {t['sha256_normalized']}")

    render = make_renderer(args.engine)
    # With transformers, also render through plain jinja2 (set up as transformers
    # does) and report any disagreement: the goldens are transformers' output.
    cross = make_renderer("jinja") if args.engine == "transformers" else None
    os.makedirs(args.out_dir, exist_ok=True)
    n = 0
    skipped = []
    disagreements = 0
    with open(os.path.join(args.out_dir, "cases.jsonl"), "w", encoding="utf-8") as out:
        for family, file in CURRENT.items():
            with open(os.path.join(args.templates_dir, file), encoding="utf-8", newline="") as f:
                template = f.read()
            for name, messages, agp, thinking in conversations():
                try:
                    rendered = render(template, messages, agp, thinking)
                except Exception as e:  # record and go on: one odd case must not cost the run
                    skipped.append(f"{family}/{name}: {type(e).__name__}: {e}")
                    continue
                if cross is not None and cross(template, messages, agp, thinking) != rendered:
                    disagreements += 1
                    print(f"  jinja2 and transformers disagree on {family}/{name}")
                case = {"name": name, "family": family, "template": file,
                        "messages": messages, "add_generation_prompt": agp,
                        "enable_thinking": thinking, "rendered": rendered}
                out.write(json.dumps(case, ensure_ascii=False) + "\n")
                n += 1
    with open(os.path.join(args.out_dir, "templates.json"), "w", encoding="utf-8") as f:
        json.dump(templates, f, indent=1)
        f.write("\n")
    print(f"wrote {n} cases and {len(templates)} template digests to {args.out_dir}; "
          f"skipped {len(skipped)}; jinja2 cross-check disagreements: {disagreements}")
    for line in skipped:
        print(f"  skipped {line}")

    # Show two renderings so the log documents the format.
    with open(os.path.join(args.out_dir, "cases.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    for case in lines:
        if case["name"] in ("multi_turn", "thinking_with_system"):
            print(f"--- {case['family']} {case['name']}\n{case['rendered']!r}")


if __name__ == "__main__":
    main()
