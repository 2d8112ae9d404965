#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Training/inference alignment of DSpark (tests/cli/train_alignment.sh). Standard library only.

  sequence       RECORD                  print `specula dspark-record`'s sequence as comma-separated ids
  shard-from-score --score S --record R --target DIR --out DIR
                 write DIR/shard_<index>.safetensors (specula-dspark-shard-v1) from ONE full-sequence
                 forward (`specula score --layer-hidden`): the taps are independent of the engine's
                 incremental commits that the record holds
  check --record R --shards DIR --block-size γ [--examples FILE] [--corrupt MODE]
                 for every round the engine ran, the example tools/train/dspark_data.py builds at that
                 anchor must have exactly the context the engine gave the drafter: the same positions
                 0 .. t-1, the same anchor token, and tap rows whose bf16 bits equal the engine's f32
                 commits rounded to bf16; the block labels are the sequence's next γ tokens and the
                 target-hidden rows are the post-norm hiddens the verify judged drafts with.
                 --corrupt context+1 / target+1 builds the seed's off-by-one examples instead, and
                 engine+1 reads the engine's commits one position late; check must then fail (the
                 shell test asserts it).
  oracle-drafter --draft DIR --record R --out DIR2
                 a copy of the specula-layout drafter DIR whose Markov head encodes the record's bigrams
                 (W1[prev] = 1000·u_next(prev), W2[v] = u_v, u random unit vectors): its drafts follow the
                 sequence, so a second record has verify commits of several rows (accepted drafts)
  selftest       reader/writer round trip, bf16 rounding, anchor range, the split.
"""

import argparse
import json
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dspark_data as dd  # noqa: E402


def read_record(path):
    st = dd.SafeTensors(path)
    rec = {k: st.values(k) for k in ("sequence", "prompt_len", "committed_pos", "round_position", "round_anchor",
                                     "round_context")}
    rec["taps_shape"] = st.shape("committed_taps")
    rec["st"] = st
    rec["tap_layers"] = [int(x) for x in st.metadata["tap_layers"].split(",")]
    rec["hidden_size"] = int(st.metadata["hidden_size"])
    return rec


def shard_from_score(score_path, record_path, target_dir, out_dir, index=0):
    rec = read_record(record_path)
    cfg = dd.text_config(dd.read_target_config(target_dir))
    sc = dd.SafeTensors(score_path)
    ids = sc.values("input_ids")
    if ids != rec["sequence"]:
        raise dd.DataError(f"{score_path}: input_ids are not the record's sequence")
    T, H = len(ids), rec["hidden_size"]
    taps = []
    for layer in rec["tap_layers"]:
        name = f"hidden_states.{layer}"
        shape = sc.shape(name)
        if shape[-2:] != [T, H]:
            raise dd.DataError(f"{score_path}: {name} is {shape}, expected [{T}, {H}]")
        taps.append(dd.f32_to_bf16_bits(sc.raw(name)))
    m = len(taps)
    hidden = []
    for p in range(T):
        for k in range(m):
            hidden.extend(taps[k][p * H:(p + 1) * H])
    os.makedirs(out_dir, exist_ok=True)
    dd.write_safetensors(os.path.join(out_dir, f"shard_{index:05d}.safetensors"), {
        "hidden": ("BF16", [T, m * H], hidden), "ids": ("I32", [T], ids),
        "seq_starts": ("I64", [2], [0, T]), "resp_starts": ("I64", [1], [rec["prompt_len"][0]])},
        {"format": dd.SHARD_FORMAT, "tap_layers": ",".join(map(str, rec["tap_layers"])), "hidden_size": H,
         "vocab_size": cfg["vocab_size"],
         "target_config_hash": dd.target_config_hash(cfg), "seed": 0, "temperature": 0})


def oracle_drafter(draft_dir, record_path, out_dir):
    rec = read_record(record_path)
    seq = rec["sequence"]
    st = dd.SafeTensors(os.path.join(draft_dir, "model.safetensors"))
    V, r = st.shape("markov.w1")
    rng = random.Random(1)
    u = []
    for _ in range(V):
        v = [rng.gauss(0, 1) for _ in range(r)]
        n = sum(x * x for x in v) ** 0.5
        u.append([x / n for x in v])
    nxt = {a: b for a, b in zip(seq, seq[1:])}  # the last successor seen
    w1, w2 = [], []
    for v in range(V):
        w1 += [1000.0 * x for x in u[nxt[v]]] if v in nxt else [0.0] * r
        w2 += u[v]
    tensors = {}
    for name in st.tensors:
        if st.dtype(name) != "F32":
            raise dd.DataError(f"{st.path}: {name} is {st.dtype(name)}; the oracle copy expects F32")
        vals = w1 if name == "markov.w1" else w2 if name == "markov.w2" else st.values(name)
        tensors[name] = ("F32", st.shape(name), vals)
    os.makedirs(out_dir, exist_ok=True)
    dd.write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(draft_dir, "dspark.json")) as f:
        doc = json.load(f)
    with open(os.path.join(out_dir, "dspark.json"), "w") as f:
        json.dump(doc, f, indent=1)


def corrupt(ex, mode):
    """The seed's off-by-one, applied to a correct example."""
    ex = dict(ex)
    if mode == "context+1":  # context = positions 1 .. t, i.e. the anchor's own tap included
        ex["context_positions"] = [p + 1 for p in ex["context_positions"]]
        ex["context_rows"] = [r + 1 for r in ex["context_rows"]]
    elif mode == "target+1":  # target hidden h_{t+1+k} (seed v1)
        ex["target_positions"] = [p + 1 for p in ex["target_positions"]]
        ex["target_rows"] = [r + 1 for r in ex["target_rows"]]
    elif mode:
        raise ValueError(mode)
    return ex


def check(record_path, shards_dir, gamma, examples_path=None, mode="", expect_accepts=False):
    """Returns a list of failure messages (empty: aligned)."""
    rec = read_record(record_path)
    shards = dd.ShardSet(shards_dir)
    sh = shards.shards[0]
    errs = []
    if shards.tap_layers != rec["tap_layers"]:
        errs.append(f"tap_layers: shard {shards.tap_layers}, engine {rec['tap_layers']}")
    W = rec["taps_shape"][1]
    H = rec["hidden_size"]
    pos = rec["committed_pos"]
    seq = rec["sequence"]
    first, length, resp = sh.sequence(0)
    if sh.ids[first:first + length] != seq:
        errs.append("the shard's ids are not the recorded sequence")
    engine_bits = {}  # position -> bf16 bits of the engine's committed taps (first commit only)

    # engine+1 pretends the engine handed the drafter the taps one position late (its row i being
    # position i+1's taps, i.e. the anchor's own tap as the last context row).
    late = 1 if mode == "engine+1" else 0

    def committed(p):
        if p not in engine_bits:
            i = pos.index(min(p + late, len(pos) - 1))
            engine_bits[p] = dd.f32_to_bf16_bits(rec["st"].raw("committed_taps", i * W, W))
        return engine_bits[p]

    if pos != list(range(len(pos))):
        errs.append(f"the engine committed positions {pos[:12]}..., expected 0, 1, 2, ... once each")
    checked = 0
    for r, t in enumerate(rec["round_position"]):
        anchor, n_ctx = rec["round_anchor"][r], rec["round_context"][r]
        # The engine side: before round r the drafter holds the taps of 0 .. t-1.
        if n_ctx != t or pos[:n_ctx] != list(range(t)):
            errs.append(f"round {r}: anchor at {t} but the drafter had {n_ctx} rows {pos[:n_ctx][-3:]}")
        if seq[t] != anchor:
            errs.append(f"round {r}: engine anchor {anchor} is not sequence[{t}] = {seq[t]}")
        if t not in dd.anchor_range(length, resp, gamma):
            continue  # the block runs past the sequence: no training example
        ex = corrupt(dd.make_example(shards, 0, t, gamma), "" if late else mode)
        checked += 1
        cb, ce = ex["context_positions"]
        if [cb, ce] != [0, t]:
            errs.append(f"round {r}: example context positions [{cb}, {ce}), engine [0, {t})")
        if ex["anchor_id"] != anchor:
            errs.append(f"round {r}: example anchor {ex['anchor_id']}, engine {anchor}")
        if ex["block_ids"] != seq[t + 1:t + 1 + gamma]:
            errs.append(f"round {r}: block ids {ex['block_ids']} are not sequence[{t + 1}..{t + gamma}]")
        rows = sh.hidden_bits(*ex["context_rows"])
        for i in range(n_ctx):
            want = committed(i)
            got = rows[(i - 0) * W:(i + 1) * W].tolist() if i < len(rows) // W else None
            if got != want:
                errs.append(f"round {r}: context row {i} (position {cb + i}) differs from the engine's commit "
                            f"of position {i}")
                break
        # The verify judged draft k with the target's logits at t+k: the post-norm hidden there is
        # what the engine committed at t+k (its last tap), where it committed it.
        tb, te = ex["target_rows"]
        trows = sh.hidden_bits(tb, te)
        for k in range(gamma):
            p = t + k
            if p >= len(pos):
                break
            if trows[k * W + W - H:(k + 1) * W].tolist() != committed(p)[W - H:]:
                errs.append(f"round {r}: target hidden of draft {k} is not the engine's post-norm hidden at {p}")
                break
    rp = rec["round_position"]
    longest = max((b - a for a, b in zip(rp, rp[1:])), default=0)
    if expect_accepts and longest < 2:
        errs.append(f"no verify committed accepted drafts (round anchors {rp[:8]}...): multi-row commits untested")
    if checked == 0:
        errs.append("no round had a full block inside the sequence: nothing was compared (raise -n)")
    if examples_path:
        with open(examples_path) as f:
            doc = json.load(f)
        for e in doc["examples"]:
            t = e["t"]
            if e["context_positions"] != [0, t] or e["anchor_id"] != seq[t] or \
                    e["block_ids"] != seq[t + 1:t + 1 + gamma]:
                errs.append(f"{examples_path}: example at t={t} is misaligned: {e['context_positions']}")
            for i, row in enumerate(e.get("context_hidden_bf16", [])):
                if i < len(pos) and row != committed(i):
                    errs.append(f"{examples_path}: example at t={t}: context row {i} differs from the engine's")
                    break
    print(f"check: {len(rec['round_position'])} rounds, {checked} with a full block compared, "
          f"{len(pos)} committed rows, longest verify commit {longest}, mode {mode or 'aligned'}: {len(errs)} problem(s)")
    return errs


def selftest():
    assert dd.f32_to_bf16_bits([1.0, -2.0, 1.00390625, 1.01171875]) == [0x3F80, 0xC000, 0x3F80, 0x3F82]
    assert dd.bf16_bits_to_floats([0x3F80, 0xC040]) == [1.0, -3.0]
    with tempfile.TemporaryDirectory() as d:
        # Two sequences; hidden row p of each holds the value p in every column (m=2, H=3).
        T, lens, resp = 0, [9, 12], [3, 5]
        hidden, ids, starts, rs = [], [], [0], []
        for n, r in zip(lens, resp):
            for p in range(n):
                hidden += dd.f32_to_bf16_bits([float(p)] * 6)
                ids.append(10 + p)
            rs.append(T + r)
            T += n
            starts.append(T)
        dd.write_safetensors(os.path.join(d, "shard_00000.safetensors"), {
            "hidden": ("BF16", [T, 6], hidden), "ids": ("I32", [T], ids), "seq_starts": ("I64", [3], starts),
            "resp_starts": ("I64", [2], rs)},
            {"format": dd.SHARD_FORMAT, "tap_layers": "1,2", "hidden_size": 3, "vocab_size": 100,
             "target_config_hash": "x", "seed": 1, "temperature": 0})
        s = dd.ShardSet(d)
        assert list(dd.anchor_range(9, 3, 4)) == [3, 4]  # t + 4 <= 8
        ex = dd.make_example(s, 1, 6, 4)
        assert ex["context_positions"] == [0, 6] and ex["context_rows"] == [9, 15], ex
        assert ex["anchor_id"] == 16 and ex["block_ids"] == [17, 18, 19, 20] and ex["target_rows"] == [15, 19]
        last = s.shards[0].hidden_bits(*ex["context_rows"])[-6:]
        assert dd.bf16_bits_to_floats(last) == [5.0] * 6  # position t-1, never t
        assert dd.make_example(s, 1, 6, 4, max_ctx=2)["context_positions"] == [4, 6]
        sampler = dd.AnchorSampler(s, [0, 1], 4)
        assert sampler.total() == 2 + 3 and sampler.anchor(2) == (1, 5)
        for g, t in sampler.sample(random.Random(0), 50):
            k, q = s.index[g]
            _, n, r0 = s.shards[k].sequence(q)
            assert r0 <= t <= n - 1 - 4
        try:
            dd.make_example(s, 0, 5, 4)
            raise AssertionError("anchor 5 of a 9-token sequence with γ 4 has no whole block")
        except dd.DataError:
            pass
        s.shards[0].st.close()
    assert dd.split_sequences(8, 0.25) == ([0, 1, 2, 4, 5, 6], [3, 7])
    print("selftest: ok")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sequence")
    s.add_argument("record")
    s = sub.add_parser("shard-from-score")
    s.add_argument("--score", required=True)
    s.add_argument("--record", required=True)
    s.add_argument("--target", required=True, help="the target folder (config.json)")
    s.add_argument("--out", required=True)
    s.add_argument("--index", type=int, default=0, help="writes shard_<index>.safetensors")
    s = sub.add_parser("check")
    s.add_argument("--record", required=True)
    s.add_argument("--shards", required=True)
    s.add_argument("--block-size", type=int, required=True)
    s.add_argument("--examples")
    s.add_argument("--corrupt", default="", choices=["", "context+1", "target+1", "engine+1"])
    s.add_argument("--expect-accepts", action="store_true", help="fail unless some verify accepted drafts")
    s = sub.add_parser("oracle-drafter")
    s.add_argument("--draft", required=True)
    s.add_argument("--record", required=True)
    s.add_argument("--out", required=True)
    sub.add_parser("selftest")
    a = p.parse_args()
    try:
        if a.cmd == "sequence":
            print(",".join(map(str, read_record(a.record)["sequence"])))
        elif a.cmd == "shard-from-score":
            shard_from_score(a.score, a.record, a.target, a.out, a.index)
        elif a.cmd == "oracle-drafter":
            oracle_drafter(a.draft, a.record, a.out)
        elif a.cmd == "check":
            errs = check(a.record, a.shards, a.block_size, a.examples, a.corrupt, a.expect_accepts)
            for e in errs[:20]:
                print("MISMATCH:", e)
            return 1 if errs else 0
        else:
            selftest()
    except dd.DataError as e:
        print(f"check_alignment: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
