#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Trains a specula-layout DSpark drafter (docs/dspark.md, "Training") on `specula regen` shards.

Data and alignment: tools/train/dspark_data.py (the anchor at position t sees the taps of positions
0 .. t-1, never its own; labels ids[t+1 .. t+γ]; p^t from the post-norm hidden at t .. t+γ-1).
Module: tools/train/dspark_module.py (batched; checked against the golden reference with
--check-reference). Loss: seed §4.5, 0.1·CE + 0.9·L1 + 1.0·BCE with position weights exp(-(k-1)/γ)
and the confidence label 1 - ½·L1 (stop-gradient). Held-out: whole sequences (the `specula
calibrate` split rule); every --eval-every steps the analytic τ of a fixed set of held-out anchors.

Outputs in --out: model.safetensors + dspark.json (what engine/draft/dspark/dspark_config.cpp loads;
dspark.json's "training" object records seeds, versions, data and the last evaluation),
checkpoint.pt (--resume continues from it), train_log.jsonl (one JSON object per line).

GPU machine (torch 2.11, transformers 5.17 / safetensors):
    python3 tools/train/train_dspark.py --shards DIR --target TARGET_DIR --out OUT --steps 20000
Without torch: --dump-examples N --out FILE.json writes N sampled examples (the alignment test).
"""

import argparse
import datetime
import json
import math
import os
import platform
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import dspark_data as dd  # noqa: E402

PRODUCER = "tools/train/train_dspark.py"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", help="folder of shard_*.safetensors (specula regen)")
    p.add_argument("--target", help="the target checkpoint folder (config.json + safetensors)")
    p.add_argument("--out", help="output folder (training) or FILE.json (--dump-examples)")
    p.add_argument("--block-size", type=int, default=5, help="γ")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--hidden", type=int, default=1024, help="draft width d")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn-mult", type=int, default=2)
    p.add_argument("--markov-rank", type=int, default=256, help="r (0: no Markov head)")
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--max-seconds", type=float, default=0,
                   help="wall-time budget of the training loop (0: none): training stops at --steps or here, "
                        "whichever comes first, and the cosine schedule runs over the nearer of the two")
    p.add_argument("--export-dtype", choices=("f32", "bf16"), default="f32",
                   help="dtype of the exported model.safetensors (bf16 halves a shipped drafter)")
    p.add_argument("--batch", type=int, default=32, help="anchors per step")
    p.add_argument("--anchors-per-seq", type=int, default=8,
                   help="anchors drawn from each sampled sequence (they share its context rows)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=200, help="linear warm-up steps, then cosine to lr/10")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-ctx", type=int, default=0,
                   help="keep the most recent N context rows (0: all, as the engine does)")
    p.add_argument("--held-out-fraction", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-anchors", type=int, default=256)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--init-from", metavar="DIR",
                   help="start from an exported drafter (DIR/model.safetensors + dspark.json of the same "
                        "config and taps) with a fresh optimizer and schedule: training continued across "
                        "machines or sessions that kept only the export")
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads of torch's products (0: torch's default); --device cpu trains on these")
    p.add_argument("--no-autocast", action="store_true", help="f32 matmuls (default: bf16 autocast on CUDA)")
    p.add_argument("--dump-examples", type=int, default=0, metavar="N",
                   help="write N sampled examples as JSON to --out and exit (no torch needed)")
    p.add_argument("--check-reference", action="store_true",
                   help="compare the batched module with tests/golden/dspark (needs transformers) and exit")
    a = p.parse_args(argv)
    if not a.check_reference:
        for flag in ("shards", "out"):
            if not getattr(a, flag):
                p.error(f"--{flag} is required")
        if not a.dump_examples and not a.target:
            p.error("--target is required for training")
    if a.threads < 0:
        p.error(f"--threads {a.threads} must be >= 0")
    if a.init_from and a.resume:
        p.error("--init-from and --resume exclude each other (--resume restores OUT/checkpoint.pt)")
    if a.block_size < 1 or a.batch < 1 or a.anchors_per_seq < 1 or a.max_ctx < 0:
        p.error("--block-size, --batch and --anchors-per-seq must be >= 1, --max-ctx >= 0")
    if not 0 < a.held_out_fraction < 1:
        p.error(f"--held-out-fraction {a.held_out_fraction} is outside (0, 1)")
    return a


# ----------------------------------------------------------------------------- target


def load_target_head(target_dir, device):
    """The target's unscaled embedding table E [V, H] (tied head; bf16 as stored), soft-cap, eps,
    config and identity hash. Uses the safetensors package when present, else dspark_data's reader."""
    import torch

    cfg_full = dd.read_target_config(target_dir)
    cfg = dd.text_config(cfg_full)
    if cfg.get("tie_word_embeddings") is False:
        raise dd.DataError(f"{target_dir}/config.json: tie_word_embeddings is false; the specula layout "
                           "uses the target's tied head")
    files = sorted(f for f in os.listdir(target_dir) if f.endswith(".safetensors"))
    names = ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight")
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    for f in files:
        path = os.path.join(target_dir, f)
        st = dd.SafeTensors(path)
        name = next((n for n in names if n in st.tensors), None)
        if name is None:
            st.close()
            continue
        if st.shape(name) != [V, H]:
            raise dd.DataError(f"{path}: {name} is {st.shape(name)}, expected [{V}, {H}]")
        dtype = st.dtype(name)
        st.close()
        try:
            from safetensors import safe_open

            with safe_open(path, framework="pt") as g:
                E = g.get_tensor(name)
        except ImportError:
            st = dd.SafeTensors(path)
            tdt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dtype]
            E = torch.frombuffer(st.buffer(name), dtype=tdt).view(V, H).clone()
            st.close()
        if E.dtype not in (torch.bfloat16, torch.float32) or torch.device(device).type == "cpu":
            E = E.float()  # a CPU has no fast bf16 product; f32 holds every bf16 value exactly
        return {"E": E.to(device), "E_std": float(E[:4096].float().std()),
                "cap": cfg.get("final_logit_softcapping"), "eps": cfg["rms_norm_eps"], "cfg": cfg,
                "hash": dd.target_config_hash(cfg_full), "embed_file": path, "embed_name": name}
    raise dd.DataError(f"--target {target_dir}: no safetensors file holds {' or '.join(names)}")


# ----------------------------------------------------------------------------- batches


def seq_anchor_range(shards, g, gamma):
    k, s = shards.index[g]
    _, length, resp = shards.shards[k].sequence(s)
    return dd.anchor_range(length, resp, gamma)


def sample_groups(sampler, rng, batch, per_seq):
    """batch anchors as groups (global sequence, [t, ...]) of per_seq anchors of one sequence each:
    the sequence drawn with probability proportional to its anchors, its anchors uniformly."""
    groups = []
    while sum(len(a) for _, a in groups) < batch:
        g, _ = sampler.anchor(rng.randrange(sampler.total()))
        r = seq_anchor_range(sampler.shards, g, sampler.gamma)
        n = min(per_seq, batch - sum(len(a) for _, a in groups))
        groups.append((g, [rng.choice(r) for _ in range(n)]))
    return groups


def make_batch(shards, groups, gamma, max_ctx, device):
    """Tensors for groups [(g, anchors)] (every group padded to the same anchor count with copies of
    its first anchor, weight 0). Context rows of a group: positions [c0, max t) with c0 = 0 (or
    min t - max_ctx when bounded); anchor t sees rows of positions < t (>= t - max_ctx): exactly
    dspark_data.make_example's context."""
    import torch

    A = max(len(a) for _, a in groups)
    S = len(groups)
    spans, ctx_len = [], 0
    for g, anchors in groups:
        c0 = max(0, min(anchors) - max_ctx) if max_ctx > 0 else 0
        spans.append(c0)
        ctx_len = max(ctx_len, max(anchors) - c0)
    W = shards.shards[0].width
    H = shards.hidden_size
    ctx = torch.zeros(S, ctx_len, W, dtype=torch.bfloat16)
    mask = torch.zeros(S, A, ctx_len, dtype=torch.bool)
    anchor_ids = torch.zeros(S, A, dtype=torch.long)
    prev = torch.zeros(S, A, gamma, dtype=torch.long)
    labels = torch.zeros(S, A, gamma, dtype=torch.long)
    tgt_h = torch.zeros(S, A, gamma, H, dtype=torch.bfloat16)
    weight = torch.zeros(S, A)
    pos = torch.arange(ctx_len)
    for s, ((g, anchors), c0) in enumerate(zip(groups, spans)):
        k, q = shards.index[g]
        sh = shards.shards[k]
        first = sh.sequence(q)[0]
        t_max = max(anchors)
        rows = torch.frombuffer(sh.st.buffer("hidden", (first + c0) * W, (t_max - c0) * W),
                                dtype=torch.bfloat16).view(t_max - c0, W)
        ctx[s, :t_max - c0] = rows
        for a in range(A):
            t = anchors[a] if a < len(anchors) else anchors[0]
            weight[s, a] = 1.0 if a < len(anchors) else 0.0
            ex = dd.make_example(shards, g, t, gamma, max_ctx)  # the definition; used for indices
            cb, ce = ex["context_positions"]
            mask[s, a] = (pos + c0 >= cb) & (pos + c0 < ce)
            anchor_ids[s, a] = ex["anchor_id"]
            labels[s, a] = torch.tensor(ex["block_ids"])
            prev[s, a, 0] = ex["anchor_id"]
            prev[s, a, 1:] = labels[s, a, :-1]
            tb, te = ex["target_rows"]
            th = torch.frombuffer(sh.st.buffer("hidden", tb * W, (te - tb) * W), dtype=torch.bfloat16).view(gamma, W)
            tgt_h[s, a] = th[:, W - H:]  # the last tap: post-final-norm hidden
    out = dict(ctx=ctx, mask=mask, anchor_ids=anchor_ids, prev=prev, labels=labels, tgt_h=tgt_h, weight=weight)
    return {k: v.to(device, non_blocking=True) for k, v in out.items()}


def forward_batch(P, cfg, head, b, autocast):
    """Draft logits, confidence logits and frozen target logits for a batch (flattened [B, γ, ...])."""
    import torch

    import dspark_module as dm

    dev = b["ctx"].device
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=autocast):
        kv = dm.context_kv(P, cfg, b["ctx"], head["eps"])
        emb = head["E"][b["anchor_ids"]].float()
        h = dm.block_hidden(P, cfg, kv, b["mask"], emb, head["eps"])
        U = dm.base_logits(P, h, head["E"], head["cap"])
        D, conf = dm.heads(P, U, h, b["prev"])
        with torch.no_grad():
            T = dm.softcap((b["tgt_h"].to(head["E"].dtype) @ head["E"].T).float(), head["cap"])
    g = cfg["block_size"]
    keep = b["weight"].reshape(-1) > 0
    V = D.shape[-1]
    return (D.reshape(-1, g, V)[keep].float(), conf.reshape(-1, g)[keep].float(), T.reshape(-1, g, V)[keep],
            b["labels"].reshape(-1, g)[keep])


# ----------------------------------------------------------------------------- training


def versions():
    import torch

    v = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import transformers

        v["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import safetensors

        v["safetensors"] = safetensors.__version__
    except ImportError:
        pass
    return v


def repo_commit():
    """The specula commit the trainer ran from (best effort; "unknown" outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def lr_at(a, step, elapsed=0.0):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    if a.max_seconds > 0:  # a wall-time budget: progress is the larger of the two fractions
        frac = max(frac, min(1.0, elapsed / a.max_seconds))
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def evaluate(P, cfg, head, shards, eval_groups, a, dev):
    """Held-out analytic acceptance (teacher-forced, seed §4.5): mean a_k per position and mean τ."""
    import torch

    import dspark_module as dm

    g = cfg["block_size"]
    sums = {"loss": 0.0, "ce": 0.0, "tv": 0.0, "conf": 0.0}
    a_sum, tau_sum, n = torch.zeros(g), 0.0, 0
    with torch.no_grad():
        for i in range(0, len(eval_groups), a.batch):
            chunk = eval_groups[i:i + a.batch]
            b = make_batch(shards, chunk, g, a.max_ctx, dev)
            D, conf, T, labels = forward_batch(P, cfg, head, b, not a.no_autocast and dev.type == "cuda")
            lt = dm.loss_terms(D, conf, T, labels, g)
            acc, tau = dm.analytic_acceptance(lt["l1"])
            for k in sums:
                sums[k] += float(lt[k]) * len(labels)
            a_sum += acc.sum(0).cpu()
            tau_sum += float(tau.sum())
            n += len(labels)
    return {"anchors": n, "tau": tau_sum / n, "a_k": [float(x) / n for x in a_sum],
            **{k: v / n for k, v in sums.items()}}


def export(P, a, head, shards, out_dir, extra):
    """model.safetensors (f32 or --export-dtype bf16, exact names) + dspark.json (docs/dspark.md "Checkpoints")."""
    cfg = model_config(a, shards, head)
    import torch

    dtype = torch.bfloat16 if getattr(a, "export_dtype", "f32") == "bf16" else torch.float32
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in P.items()}
    path = os.path.join(out_dir, "model.safetensors")
    try:
        from safetensors.torch import save_file

        save_file(tensors, path, metadata={"format": "pt", "producer": PRODUCER})
    except ImportError:  # e.g. Debian's python3-torch, which has no safetensors package beside it
        def entry(v):
            if v.dtype == torch.bfloat16:  # dd.write_safetensors takes bf16 as 16-bit patterns
                return ("BF16", list(v.shape), [b & 0xFFFF for b in v.view(torch.int16).reshape(-1).tolist()])
            return ("F32", list(v.shape), v.reshape(-1).tolist())

        dd.write_safetensors(path, {k: entry(v) for k, v in tensors.items()}, {"format": "pt", "producer": PRODUCER})
    tc = head["cfg"]
    doc = {"kind": "dspark-drafter", "variant": "dspark", "version": 1,
           "target": {"hidden_size": tc["hidden_size"], "vocab_size": tc["vocab_size"],
                      "num_hidden_layers": tc["num_hidden_layers"], "config_hash": head["hash"]},
           "config": cfg,
           "training": extra}
    with open(os.path.join(out_dir, "dspark.json"), "w") as f:
        json.dump(doc, f, indent=1)


def load_export(P, cfg, src):
    """Copies an exported drafter's weights (src/model.safetensors, f32 or bf16) into P, after
    checking that src/dspark.json has this run's config (block, width, layers, heads, ffn, Markov
    rank, taps) and that every tensor name and shape matches."""
    import torch

    doc_path = os.path.join(src, "dspark.json")
    try:
        with open(doc_path) as f:
            src_doc = json.load(f)
        src_cfg = src_doc["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise dd.DataError(f"--init-from {doc_path}: cannot read its config: {e}") from None
    for key, want in cfg.items():
        if key != "rms_norm_eps" and src_cfg.get(key) != want:
            raise dd.DataError(f"--init-from {doc_path}: config.{key} is {src_cfg.get(key)!r}, this run has {want!r}")
    st = dd.SafeTensors(os.path.join(src, "model.safetensors"))
    try:
        if set(st.tensors) != set(P):
            raise dd.DataError(f"--init-from {st.path}: tensors {sorted(set(st.tensors) ^ set(P))} are in one of "
                               "the export and this run's drafter only")
        types = {"BF16": torch.bfloat16, "F32": torch.float32}
        with torch.no_grad():
            for name, v in P.items():
                if st.shape(name) != list(v.shape) or st.dtype(name) not in types:
                    raise dd.DataError(f"--init-from {st.path}: {name} is {st.dtype(name)} {st.shape(name)}, "
                                       f"expected BF16 or F32 {list(v.shape)}")
                t = torch.frombuffer(st.buffer(name), dtype=types[st.dtype(name)]).view(v.shape)
                v.copy_(t.float())
    finally:
        st.close()
    print(f"initialized from {src}", flush=True)
    prev = src_doc.get("training") or {}
    # The lineage, so that an export says how much training lies behind it in all.
    return {"dir": os.path.abspath(src), "steps": prev.get("steps"), "commit": prev.get("commit"),
            "held_out_eval": prev.get("held_out_eval"), "init_from": prev.get("init_from")}


def model_config(a, shards, head):
    return {"block_size": a.block_size, "hidden_size": a.hidden, "num_layers": a.layers, "num_heads": a.heads,
            "ffn_mult": a.ffn_mult, "markov_rank": a.markov_rank, "tap_layers": shards.tap_layers,
            "rms_norm_eps": head["eps"]}


def check_data_against_target(shards, head, target_dir):
    tc = head["cfg"]
    L = tc["num_hidden_layers"]
    if shards.hidden_size != tc["hidden_size"] or shards.vocab_size != tc["vocab_size"]:
        raise dd.DataError(f"--shards {shards.directory}: hidden_size {shards.hidden_size} / vocab_size "
                           f"{shards.vocab_size}, but --target {target_dir} has {tc['hidden_size']} / {tc['vocab_size']}")
    if shards.target_config_hash and shards.target_config_hash != head["hash"]:
        raise dd.DataError(f"--shards {shards.directory}: target_config_hash {shards.target_config_hash}, but "
                           f"--target {target_dir} hashes to {head['hash']}")
    if shards.tap_layers[-1] != L or any(not 0 <= t <= L for t in shards.tap_layers):
        raise dd.DataError(f"--shards {shards.directory}: tap_layers {shards.tap_layers} must lie in [0, {L}] and end "
                           f"with {L} (the post-final-norm hidden that gives p^t)")


def train(a):
    import torch

    import dspark_module as dm

    dev = torch.device(a.device)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    shards = dd.ShardSet(a.shards)
    head = load_target_head(a.target, dev)
    check_data_against_target(shards, head, a.target)
    cfg = model_config(a, shards, head)
    if cfg["hidden_size"] % cfg["num_heads"] or (cfg["hidden_size"] // cfg["num_heads"]) % 2:
        raise dd.DataError(f"--hidden {a.hidden} must be a multiple of --heads {a.heads} with an even head dim")
    train_seqs, held_seqs = dd.split_sequences(shards.num_sequences(), a.held_out_fraction)
    if not held_seqs or not train_seqs:
        raise dd.DataError(f"--held-out-fraction {a.held_out_fraction} splits the {shards.num_sequences()} sequences "
                           f"into {len(train_seqs)} train and {len(held_seqs)} held-out; both need one")
    train_sampler = dd.AnchorSampler(shards, train_seqs, a.block_size)
    held_sampler = dd.AnchorSampler(shards, held_seqs, a.block_size)
    eval_rng = random.Random(a.seed + 1)
    eval_groups = [(g, [t]) for g, t in held_sampler.sample(eval_rng, a.eval_anchors)]

    m, H, V = len(shards.tap_layers), shards.hidden_size, shards.vocab_size
    torch.manual_seed(a.seed)
    P = {k: v.to(dev).requires_grad_(True)
         for k, v in dm.init_params(cfg, H, V, m, head["E_std"], torch.Generator().manual_seed(a.seed)).items()}
    decay = [v for k, v in P.items() if v.dim() == 2 and k not in ("markov.w1", "markov.w2")]
    no_decay = [v for k, v in P.items() if not (v.dim() == 2 and k not in ("markov.w1", "markov.w2"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95))
    lineage = load_export(P, cfg, a.init_from) if a.init_from else None
    rng = random.Random(a.seed)
    step = 0
    ckpt_path = os.path.join(a.out, "checkpoint.pt")
    log_path = os.path.join(a.out, "train_log.jsonl")
    if a.resume:
        ck = torch.load(ckpt_path, map_location=dev, weights_only=False)
        for key in ("block_size", "layers", "hidden", "heads", "ffn_mult", "markov_rank", "seed", "max_ctx"):
            if ck["args"][key] != getattr(a, key):
                raise dd.DataError(f"{ckpt_path}: was trained with --{key.replace('_', '-')} {ck['args'][key]}, "
                                   f"not {getattr(a, key)}")
        with torch.no_grad():
            for k, v in P.items():
                v.copy_(ck["params"][k])
        opt.load_state_dict(ck["opt"])
        step = ck["step"]
        rng.setstate(ck["py_rng"])
        torch.set_rng_state(ck["torch_rng"].cpu())
        print(f"resumed from {ckpt_path} at step {step}", flush=True)
    autocast = not a.no_autocast and dev.type == "cuda"
    meta = {"producer": PRODUCER, "commit": repo_commit(), "seed": a.seed, "args": vars(a), "versions": versions(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "shards": {"dir": os.path.abspath(a.shards), "files": len(shards.shards),
                       "sequences": shards.num_sequences(), "metadata": shards.metadata},
            "split": {"rule": "sequence i held out when floor((i+1) f) > floor(i f)",
                      "held_out_fraction": a.held_out_fraction, "train_sequences": len(train_seqs),
                      "held_out_sequences": len(held_seqs), "train_anchors": train_sampler.total(),
                      "held_out_anchors": held_sampler.total(), "eval_anchors": len(eval_groups)},
            "alignment": "context = taps of positions < t (never the anchor's own); labels ids[t+1..t+γ]; "
                         "p^t from post-norm hidden at t..t+γ-1 (tools/train/dspark_data.py)",
            "loss": "0.1 CE + 0.9 L1 + 1.0 BCE(conf, stopgrad(1 - L1/2)), weights exp(-(k-1)/γ)",
            "target": {"dir": os.path.abspath(a.target), "config_hash": head["hash"], "embed": head["embed_name"]},
            "init_from": lineage}
    last_eval = None

    def log(obj):
        with open(log_path, "a") as f:
            f.write(json.dumps(obj) + "\n")

    def save():
        torch.save({"params": {k: v.detach() for k, v in P.items()}, "opt": opt.state_dict(), "step": step,
                    "args": vars(a), "py_rng": rng.getstate(), "torch_rng": torch.get_rng_state()}, ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)

    log({"event": "start", "step": step, **meta})
    t0 = time.time()
    while step < a.steps:
        elapsed = time.time() - t0
        if a.max_seconds > 0 and elapsed >= a.max_seconds:
            print(f"--max-seconds {a.max_seconds:g} reached at step {step}", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(a, step, elapsed)
        b = make_batch(shards, sample_groups(train_sampler, rng, a.batch, a.anchors_per_seq), a.block_size,
                       a.max_ctx, dev)
        D, conf, T, labels = forward_batch(P, cfg, head, b, autocast)
        lt = dm.loss_terms(D, conf, T, labels, a.block_size)
        opt.zero_grad(set_to_none=True)
        lt["loss"].backward()
        gnorm = torch.nn.utils.clip_grad_norm_(list(P.values()), a.grad_clip)
        if not torch.isfinite(lt["loss"]):
            raise RuntimeError(f"step {step}: loss is {float(lt['loss'])}")
        opt.step()
        step += 1
        if step % a.log_every == 0 or step == 1:
            rec = {"step": step, "lr": lr_at(a, step - 1, elapsed), "grad_norm": float(gnorm),
                   "seconds": round(time.time() - t0, 2), **{k: float(lt[k]) for k in ("loss", "ce", "tv", "conf")}}
            log(rec)
            print(json.dumps(rec), flush=True)
        if step % a.eval_every == 0 or step == a.steps:
            last_eval = evaluate(P, cfg, head, shards, eval_groups, a, dev)
            last_eval["step"] = step
            log({"step": step, "eval": last_eval})
            print(json.dumps({"step": step, "eval": last_eval}), flush=True)
            save()
    if last_eval is None or last_eval.get("step") != step:  # resumed at the end, or stopped by --max-seconds
        last_eval = evaluate(P, cfg, head, shards, eval_groups, a, dev)
        last_eval["step"] = step
        log({"step": step, "eval": last_eval})
        print(json.dumps({"step": step, "eval": last_eval}), flush=True)
        save()
    meta.update(finished=datetime.datetime.now(datetime.timezone.utc).isoformat(), steps=step,
                held_out_eval=last_eval)
    export(P, a, head, shards, a.out, meta)
    log({"event": "export", "step": step, "dir": os.path.abspath(a.out)})
    print(f"exported {a.out}/model.safetensors and dspark.json (held-out τ {last_eval['tau']:.3f})", flush=True)


# ----------------------------------------------------------------------------- reference check


def check_reference():
    """The batched module on tests/golden/dspark vs its expected.safetensors (the fixture the C++
    engine is tested against) and vs make_dspark_golden.py's own per-anchor functions. The golden's
    rounds t_r become anchors of ONE group, so the key mask (context = positions < t) is exercised."""
    import importlib.util

    import torch

    import dspark_module as dm

    spec = importlib.util.spec_from_file_location("make_dspark_golden",
                                                  os.path.join(REPO, "tools", "golden", "make_dspark_golden.py"))
    gold = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gold)
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    tgt = gold.load_target(os.path.join(REPO, "tests", "golden", "dense_kev"))
    gdir = os.path.join(REPO, "tests", "golden", "dspark")
    with open(os.path.join(gdir, "dspark.json")) as f:
        cfg = json.load(f)["config"]
    P = load_file(os.path.join(gdir, "model.safetensors"))
    exp = load_file(os.path.join(gdir, "expected.safetensors"))
    taps = torch.cat([tgt.hs[t] for t in cfg["tap_layers"]], dim=-1)
    ctxs = [int(t) for t in exp["contexts"]]
    seq = exp["sequence"].long()
    C = max(ctxs)
    mask = (torch.arange(C)[None, :] < torch.tensor(ctxs)[:, None])[None]  # [1, A, C]
    kv = dm.context_kv(P, cfg, taps[None, :C], tgt.eps)
    anchors = seq[torch.tensor(ctxs)]
    h = dm.block_hidden(P, cfg, kv, mask, tgt.E[anchors][None], tgt.eps)[0]
    U = dm.base_logits(P, h, tgt.E, tgt.cap)
    prev = torch.cat([anchors[:, None], exp["draft_tokens"][:, :-1].long()], dim=1)  # the greedy chain
    D, conf = dm.heads(P, U, h, prev)
    diffs = {"base_logits": gold.max_diff(U, exp["base_logits"]), "block_logits": gold.max_diff(D, exp["block_logits"]),
             "confidences": gold.max_diff(torch.sigmoid(conf), exp["confidences"])}
    # The per-anchor reference itself, at the same rounds.
    gold_U = torch.stack([gold.specula_block(P, gold.specula_context_kv(P, taps[:t], tgt.eps), int(seq[t]), tgt.E,
                                             tgt.cap, tgt.eps)[1] for t in ctxs])
    diffs["vs_specula_block"] = gold.max_diff(U, gold_U)
    # The off-by-one must be visible: context = positions <= t changes the logits.
    mask1 = (torch.arange(C + 1)[None, :] <= torch.tensor(ctxs)[:, None])[None]
    kv1 = dm.context_kv(P, cfg, taps[None, :C + 1], tgt.eps)
    U1 = dm.base_logits(P, dm.block_hidden(P, cfg, kv1, mask1, tgt.E[anchors][None], tgt.eps)[0], tgt.E, tgt.cap)
    shifted = gold.max_diff(U1, exp["base_logits"])
    print(json.dumps({"max_abs_diff": diffs, "shifted_context_diff": shifted}))
    bad = {k: v for k, v in diffs.items() if not v <= 1e-4}
    if bad or not shifted > 1e-3:
        print(f"check-reference: FAILED {bad or 'the shifted context was not detected'}", file=sys.stderr)
        return 1
    print("check-reference: ok (batched module == golden fixture and reference; shifted context detected)")
    return 0


def main(argv=None):
    a = parse_args(argv)
    try:
        if a.dump_examples:
            shards = dd.ShardSet(a.shards)
            doc = dd.dump_examples(shards, a.dump_examples, a.block_size, a.max_ctx, a.seed)
            doc["producer"] = PRODUCER
            with open(a.out, "w") as f:
                json.dump(doc, f)
            print(f"wrote {len(doc['examples'])} examples to {a.out}")
            return 0
        if a.check_reference:
            return check_reference()
        train(a)
    except dd.DataError as e:
        print(f"train_dspark: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
