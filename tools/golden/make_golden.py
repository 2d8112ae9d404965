#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Golden fixtures for the specula C++ engine, produced by Hugging Face transformers.

Builds tiny random Gemma 4 targets (Gemma4ForCausalLM) and Gemma 4 assistant drafters
(Gemma4AssistantForCausalLM), randomises every parameter transformers initialises to a
constant, saves them with save_pretrained, reloads them from disk and records reference
tensors (hidden states, logits, donor K/V, greedy generation, drafter trace, assisted
generation). The file format is documented in tests/golden/README.md; it is a contract
with the C++ tests.

Run (GPU machine, transformers 5.17):
    python3 tools/golden/make_golden.py --out tests/golden [--dump-src DIR]

Everything runs on CPU in fp32 (eager attention) unless --device says otherwise: the
models are tiny and CPU fp32 avoids TF32 and nondeterministic kernels.
"""

import argparse
import datetime
import inspect
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the modules next to this script

from golden_configs import ASSISTANTS, SEED, TARGETS  # noqa: E402
from golden_util import log, versions  # noqa: E402
from golden_targets import make_target, make_target_bf16  # noqa: E402
from golden_assistants import make_assistant  # noqa: E402


# ----------------------------------------------------------------------------- sources


def dump_sources(path):
    """Saves the transformers source the fixtures depend on (for reading, not for copying)."""
    os.makedirs(path, exist_ok=True)
    import importlib

    mods = [
        "transformers.models.gemma4.modeling_gemma4",
        "transformers.models.gemma4.configuration_gemma4",
        "transformers.models.gemma4_assistant.modeling_gemma4_assistant",
        "transformers.models.gemma4_assistant.configuration_gemma4_assistant",
        "transformers.generation.candidate_generator",
        "transformers.masking_utils",
        "transformers.modeling_rope_utils",
        "transformers.cache_utils",
    ]
    info = {"versions": versions()}
    for m in mods:
        try:
            mod = importlib.import_module(m)
            with open(os.path.join(path, m.split(".")[-1] + ".py"), "w") as f:
                f.write(inspect.getsource(mod))
        except Exception as e:  # noqa: BLE001
            info[m] = f"failed: {e}"
    try:
        from transformers.generation import utils as gu

        with open(os.path.join(path, "assisted_decoding.py"), "w") as f:
            f.write(inspect.getsource(gu.GenerationMixin._assisted_decoding))
            for n in ("_get_candidate_generator", "_prepare_cache_for_generation"):
                if hasattr(gu.GenerationMixin, n):
                    f.write("\n\n" + inspect.getsource(getattr(gu.GenerationMixin, n)))
    except Exception as e:  # noqa: BLE001
        info["assisted_decoding"] = f"failed: {e}"
    try:
        import transformers.models.gemma4 as g4
        import transformers.models.gemma4_assistant as g4a
        from transformers import Gemma4TextConfig

        info["dir_gemma4"] = [n for n in dir(g4) if not n.startswith("_")]
        info["dir_gemma4_assistant"] = [n for n in dir(g4a) if not n.startswith("_")]
        info["Gemma4TextConfig_signature"] = str(inspect.signature(Gemma4TextConfig))
    except Exception as e:  # noqa: BLE001
        info["dir"] = f"failed: {e}"
    with open(os.path.join(path, "info.json"), "w") as f:
        json.dump(info, f, indent=1, default=str)
    log("sources dumped:", sorted(os.listdir(path)))


# ----------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (tests/golden)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--dump-src", default=None, help="also save the relevant transformers source here")
    ap.add_argument("--only", default=None, help="comma-separated fixture names (default: all)")
    args = ap.parse_args()

    log("versions:", versions())
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.dump_src:
        dump_sources(args.dump_src)
    meta_common = dict(
        versions=versions(),
        device=args.device,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        producer="tools/golden/make_golden.py",
        base_seed=SEED,
        attn_implementation="eager",
    )
    only = set(args.only.split(",")) if args.only else None
    failures = []
    targets = {}
    for name in TARGETS:
        if only and name not in only and not any(ASSISTANTS.get(a, ("",))[0] == name for a in only):
            continue
        try:
            targets[name] = make_target(name, args.out, args.device, meta_common)
        except Exception:  # noqa: BLE001 - report all fixtures, then fail
            traceback.print_exc()
            failures.append(name)
    if (not only or "e2b_like_bf16" in only) and "e2b_like" in targets:
        try:
            make_target_bf16(args.out, args.device, meta_common)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failures.append("e2b_like_bf16")
    for name, (tname, _, _) in ASSISTANTS.items():
        if only and name not in only:
            continue
        if tname not in targets:
            failures.append(name)
            continue
        try:
            make_assistant(name, args.out, args.device, meta_common, targets)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failures.append(name)
    if failures:
        log("FAILED:", failures)
        sys.exit(1)
    log("all fixtures written to", args.out)


if __name__ == "__main__":
    main()
