# SPDX-License-Identifier: Apache-2.0
"""train_family.py: sizes, paths and model kwargs of the family, the run's clock (T0) and log,
and the run bookkeeping (Run, status.json, versions, packing into family.tgz parts).
"""

import datetime
import hashlib
import io
import json
import os
import platform
import tarfile
import time

T0 = time.time()  # the run's clock starts before torch loads (log, Run.deadline)

import torch  # noqa: E402

SLIDING = "sliding_attention"
FULL = "full_attention"
VOCAB = 8192
CTX = 512
K_DRAFT = 4
SOFTCAP = 30.0
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                  # Gemma 4's own control tokens (engine/chat/chat_format.h)
                  "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"]
PAD, EOS, BOS, UNK = 0, 1, 2, 3
LIMIT_ALPHABET = 160  # rarer characters fall back to <0xNN> byte tokens
ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}
TARGET_DIR = "models/gemma4-tiny-py"
DRAFTER_DIR = "models/gemma4-tiny-py-assistant"
DSPARK_DIR = "models/gemma4-tiny-py-dspark"  # trained by tools/train/embedded_dspark_cpu.sh, not here
GOLDEN_DIR = "tests/golden/embedded"
GOLDEN_PROMPT_LENS = [41, 97, 163, 211]  # two shorter than the 128 window, two longer
GOLDEN_NEW = 32
MAX_FILE_BYTES = 16 * 1000 * 1000
PART_BYTES = 15 * 1000 * 1000


def log(*args):
    print(f"[{time.time() - T0:7.1f}s]", *args, flush=True)


def target_text_kwargs():
    """Gemma4TextConfig kwargs of the target (model_type gemma4_text)."""
    return dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        layer_types=[SLIDING, SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL],
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, global_head_dim=128,
        sliding_window=128, hidden_size_per_layer_input=32, vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2, final_logit_softcapping=SOFTCAP, rope_parameters=json.loads(json.dumps(ROPE)),
        max_position_embeddings=4096, tie_word_embeddings=True, attention_k_eq_v=False, enable_moe_block=False,
        use_double_wide_mlp=False, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, attention_dropout=0.0,
    )


def drafter_text_kwargs():
    """text_config of the assistant: Q-only layers over the target's donors (same head geometry)."""
    return dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        layer_types=[SLIDING, SLIDING, SLIDING, FULL], num_attention_heads=4, num_key_value_heads=1,
        head_dim=64, global_head_dim=128, sliding_window=128, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, num_kv_shared_layers=4, final_logit_softcapping=None,
        rope_parameters=json.loads(json.dumps(ROPE)), max_position_embeddings=4096, tie_word_embeddings=True,
        attention_k_eq_v=False, enable_moe_block=False, use_double_wide_mlp=False, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
        attention_dropout=0.0,
    )


DRAFTER_KWARGS = dict(backbone_hidden_size=256, use_ordered_embeddings=True, num_centroids=64,
                      centroid_intermediate_top_k=8, tie_word_embeddings=True)


# ----------------------------------------------------------------------------- bookkeeping


class Run:
    """Results, timings and the output locations of one run; status.json is rewritten after
    every phase so that a run killed by the time limit still reports what it did."""

    def __init__(self, args):
        self.args = args
        self.results = {"phases": {}, "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds")}
        self.deadline = T0 + args.deadline_seconds

    def left(self):
        return self.deadline - time.time()

    def phase(self, name, seconds, **info):
        self.results["phases"][name] = dict(seconds=round(seconds, 2), **info)
        log(f"phase {name} done in {seconds:.1f}s {info if info else ''}")
        self.save_status()

    def save_status(self):
        if not self.args.pack_dir:
            return
        os.makedirs(self.args.pack_dir, exist_ok=True)
        with open(os.path.join(self.args.pack_dir, "status.json"), "w") as f:
            json.dump(self.results, f, indent=1, default=str)


def versions():
    v = {"torch": torch.__version__, "python": platform.python_version(),
         "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for mod in ("transformers", "tokenizers", "safetensors"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            v[mod] = None
    return v


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pack(run, root):
    """tar.gz of models/ + tests/golden/embedded/ split into <= 15 MB parts in --pack-dir."""
    if not run.args.pack_dir:
        return []
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel in ("models", GOLDEN_DIR):
            if os.path.exists(os.path.join(root, rel)):
                tar.add(os.path.join(root, rel), arcname=rel)
    data = buf.getvalue()
    for name in os.listdir(run.args.pack_dir):
        if name.startswith("family.tgz.part"):
            os.remove(os.path.join(run.args.pack_dir, name))
    parts = []
    for i in range(0, len(data), PART_BYTES):
        p = os.path.join(run.args.pack_dir, f"family.tgz.part{i // PART_BYTES:02d}")
        with open(p, "wb") as f:
            f.write(data[i:i + PART_BYTES])
        parts.append(os.path.basename(p))
    log(f"packed {len(data) / 1e6:.1f} MB into {parts}")
    return parts
