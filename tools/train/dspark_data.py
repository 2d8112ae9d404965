#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""DSpark training data: the shard reader and THE definition of training/inference alignment.

Standard library only (CI has neither numpy nor torch). Shards are what `specula regen` writes
(format "specula-dspark-shard-v1"): DIR/shard_00000.safetensors, ... each holding
  hidden      bf16 [T, m*H]  row p = the taps of row p, concatenated in tap_layers order
                             (engine convention: hidden_states index, the last = L = post-final-norm)
  ids         i32  [T]
  seq_starts  i64  [S+1]     sequence s is rows [seq_starts[s], seq_starts[s+1])
  resp_starts i64  [S]       absolute row of sequence s's first generated token
  __metadata__: format, tap_layers "a,b,c", hidden_size, vocab_size, target_config_hash, seed,
                temperature
and DIR/regen.json (the manifest; not needed here).

Alignment (docs/dspark.md: "Context (both layouts)", line 33 at this writing; the block input,
line 61; "Heads", line 105; and "Training"). Positions p are counted from
the start of the sequence (row seq_starts[s] + p). The engine's DSpark round whose pending token
(the anchor) sits at position t:
  - context   = the taps of positions 0 .. t-1, exactly what Drafter::on_committed has given the
                drafter before that round (the prefill pieces, then each verify's anchor + accepted
                drafts). The anchor's own tap is NEVER context: the target has not forwarded the
                anchor yet when the drafter runs. (The seed's trainer used positions <= t, its
                §4.7 off-by-one; we do not.)
  - anchor    = ids[t], the block's position 0 input (token_proj(E_raw[anchor]) + block_pos[0]).
  - block     = γ positions: X_0 from the anchor, X_j = mask_embed[j-1] + block_pos[j] (docs line
                61); draft k (k = 0 .. γ-1) proposes the token at position t+1+k (Heads, line 105:
                prev_0 = the anchor, prev_k = draft k-1), so the labels are ids[t+1 .. t+γ] and the
                teacher-forced Markov inputs are [ids[t], ids[t+1 .. t+γ-1]].
  - target    = the verify forward over [anchor, d_0 .. d_{γ-1}] at positions t .. t+γ judges
                draft k with the target's logits at position t+k, i.e. head(h_{t+k}) with h the
                post-final-norm hidden (the last tap). Teacher-forced, p^t_k = softmax(softcap(
                E · h_{t+k})), so the target-hidden rows are positions t .. t+γ-1.
  - anchors   = t in [max(resp_start, 1), len-1-γ]: the engine's first round anchors the first
                generated token (resp_start: the prefill committed the prompt 0 .. resp_start-1),
                and the whole block's labels must exist.
  - max_ctx   = 0 (default) keeps the whole context, as the engine does (no rolling window).
                max_ctx > 0 keeps the most recent max_ctx rows, [t - max_ctx, t): a training-time
                memory bound only, which the engine does not mirror.
tests/cli/train_alignment.sh checks this against what the engine actually commits.
"""

import argparse
import array
import bisect
import json
import math
import mmap
import os
import random
import struct
import sys

SHARD_FORMAT = "specula-dspark-shard-v1"
_DTYPES = {"BF16": ("H", 2), "F16": ("e", 2), "F32": ("f", 4), "F64": ("d", 8), "I32": ("i", 4),
           "I64": ("q", 8), "U8": ("B", 1), "I8": ("b", 1), "I16": ("h", 2), "U16": ("H", 2),
           "U32": ("I", 4), "U64": ("Q", 8), "BOOL": ("B", 1)}


class DataError(Exception):
    """Bad input: names the file, the field and the value."""


# ----------------------------------------------------------------------------- bf16


def bf16_bits_to_floats(bits):
    """Sequence of bf16 bit patterns (ints) -> list of Python floats (exact: bf16 widens to f32)."""
    wide = array.array("I", (b << 16 for b in bits))
    out = array.array("f")
    out.frombytes(wide.tobytes())
    return out.tolist()


def f32_to_bf16_bits(values):
    """f32 values -> bf16 bit patterns, round to nearest even (torch's .to(torch.bfloat16)); NaN
    stays a quiet NaN."""
    raw = array.array("f", values)
    bits = array.array("I")
    bits.frombytes(raw.tobytes())
    out = []
    for u in bits:
        if (u & 0x7F800000) == 0x7F800000 and (u & 0x007FFFFF):
            out.append(((u >> 16) | 0x0040) & 0xFFFF)
        else:
            out.append(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)
    return out


# ----------------------------------------------------------------------------- safetensors


class SafeTensors:
    """A read-only, memory-mapped safetensors file: header, metadata and row access."""

    def __init__(self, path):
        self.path = path
        try:
            self._file = open(path, "rb")
        except OSError as e:
            raise DataError(f"{path}: cannot open: {e}") from None
        head = self._file.read(8)
        if len(head) != 8:
            raise DataError(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(self._file.fileno()).st_size
        if n > size - 8:
            raise DataError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(self._file.read(n))
        except ValueError as e:
            raise DataError(f"{path}: header is not JSON: {e}") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.tensors = header
        self._base = 8 + n
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else b""
        for name, t in self.tensors.items():
            if t.get("dtype") not in _DTYPES:
                raise DataError(f"{path}: tensor {name}: dtype {t.get('dtype')!r} is not supported")
            b, e = t["data_offsets"]
            want = math.prod(t["shape"]) * _DTYPES[t["dtype"]][1]
            if e - b != want or self._base + e > size:
                raise DataError(f"{path}: tensor {name}: data_offsets {t['data_offsets']} do not hold "
                                f"{t['dtype']} {t['shape']}")

    def close(self):
        if isinstance(self._map, mmap.mmap):
            self._map.close()
        self._file.close()

    def info(self, name):
        if name not in self.tensors:
            raise DataError(f"{self.path}: no tensor {name!r} (has {sorted(self.tensors)})")
        return self.tensors[name]

    def shape(self, name):
        return list(self.info(name)["shape"])

    def dtype(self, name):
        return self.info(name)["dtype"]

    def raw(self, name, first=0, count=None):
        """Elements [first, first+count) of the flattened tensor as an array of its storage type
        (bf16: the bit patterns)."""
        t = self.info(name)
        code, size = _DTYPES[t["dtype"]]
        total = math.prod(t["shape"])
        count = total - first if count is None else count
        if first < 0 or count < 0 or first + count > total:
            raise DataError(f"{self.path}: tensor {name}: elements [{first}, {first + count}) "
                            f"outside its {total}")
        b = self._base + t["data_offsets"][0] + first * size
        out = array.array(code)
        out.frombytes(self._map[b:b + count * size])
        if sys.byteorder != "little":
            out.byteswap()
        return out

    def buffer(self, name, first=0, count=None):
        """Elements [first, first+count) as a bytearray (little-endian storage bytes), e.g. for
        torch.frombuffer."""
        t = self.info(name)
        size = _DTYPES[t["dtype"]][1]
        total = math.prod(t["shape"])
        count = total - first if count is None else count
        if first < 0 or count < 0 or first + count > total:
            raise DataError(f"{self.path}: tensor {name}: elements [{first}, {first + count}) outside its {total}")
        b = self._base + t["data_offsets"][0] + first * size
        return bytearray(self._map[b:b + count * size])

    def values(self, name, first=0, count=None):
        """As raw(), widened to Python numbers (bf16 -> float)."""
        r = self.raw(name, first, count)
        return bf16_bits_to_floats(r) if self.dtype(name) == "BF16" else r.tolist()


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: (dtype, shape, flat values)}; BF16 values are bit patterns. Names sorted."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, shape, vals = tensors[name]
        code, size = _DTYPES[dtype]
        data = array.array(code, vals)
        if len(data) != math.prod(shape):
            raise DataError(f"{path}: tensor {name}: {len(data)} values for shape {shape}")
        if sys.byteorder != "little":
            data.byteswap()
        blob = data.tobytes()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


# ----------------------------------------------------------------------------- shards


class Shard:
    """One shard file: its sequences, ids and hidden rows (rows are absolute within the shard)."""

    def __init__(self, path):
        self.path = path
        self.st = SafeTensors(path)
        md = self.st.metadata
        if md.get("format") != SHARD_FORMAT:
            raise DataError(f"{path}: __metadata__.format is {md.get('format')!r}, expected {SHARD_FORMAT!r}")
        try:
            self.tap_layers = [int(x) for x in md["tap_layers"].split(",")]
            self.hidden_size = int(md["hidden_size"])
            self.vocab_size = int(md["vocab_size"])
        except (KeyError, ValueError) as e:
            raise DataError(f"{path}: __metadata__ tap_layers/hidden_size/vocab_size: {e} ({md})") from None
        self.target_config_hash = md.get("target_config_hash", "")
        for name, dtype in (("hidden", "BF16"), ("ids", "I32"), ("seq_starts", "I64"), ("resp_starts", "I64")):
            if self.st.dtype(name) != dtype:
                raise DataError(f"{path}: tensor {name} is {self.st.dtype(name)}, expected {dtype}")
        T, width = self.st.shape("hidden")
        self.width = width
        if width != len(self.tap_layers) * self.hidden_size:
            raise DataError(f"{path}: hidden is [{T}, {width}], expected m*H = {len(self.tap_layers)}*"
                            f"{self.hidden_size} columns (tap_layers {self.tap_layers})")
        if self.st.shape("ids") != [T]:
            raise DataError(f"{path}: ids is {self.st.shape('ids')}, expected [{T}]")
        self.ids = self.st.values("ids")
        self.seq_starts = self.st.values("seq_starts")
        self.resp_starts = self.st.values("resp_starts")
        S = len(self.resp_starts)
        if len(self.seq_starts) != S + 1 or self.seq_starts[0] != 0 or self.seq_starts[-1] != T:
            raise DataError(f"{path}: seq_starts {self.seq_starts[:4]}... must be [S+1] from 0 to T={T}")
        for s in range(S):
            a, b, r = self.seq_starts[s], self.seq_starts[s + 1], self.resp_starts[s]
            if not a <= r <= b or a >= b:
                raise DataError(f"{path}: sequence {s}: rows [{a}, {b}) with resp_start {r}")
        bad = [i for i in self.ids if not 0 <= i < self.vocab_size]
        if bad:
            raise DataError(f"{path}: ids hold {bad[0]}, outside the vocabulary of {self.vocab_size}")

    def num_sequences(self):
        return len(self.resp_starts)

    def sequence(self, s):
        """(first row, length, resp_start as a position within the sequence)."""
        a = self.seq_starts[s]
        return a, self.seq_starts[s + 1] - a, self.resp_starts[s] - a

    def hidden_bits(self, row_begin, row_end):
        """bf16 bit patterns of hidden rows [row_begin, row_end), row-major [rows * m*H]."""
        return self.st.raw("hidden", row_begin * self.width, (row_end - row_begin) * self.width)


class ShardSet:
    """Every DIR/shard_*.safetensors, checked to agree on taps and target; sequences numbered
    globally in file order."""

    def __init__(self, directory):
        try:
            names = sorted(n for n in os.listdir(directory)
                           if n.startswith("shard_") and n.endswith(".safetensors"))
        except OSError as e:
            raise DataError(f"--shards {directory}: {e}") from None
        if not names:
            raise DataError(f"--shards {directory}: no shard_*.safetensors files")
        self.directory = directory
        self.shards = [Shard(os.path.join(directory, n)) for n in names]
        first = self.shards[0]
        for sh in self.shards[1:]:
            for field in ("tap_layers", "hidden_size", "vocab_size", "target_config_hash"):
                if getattr(sh, field) != getattr(first, field):
                    raise DataError(f"{sh.path}: {field} {getattr(sh, field)!r} differs from "
                                    f"{first.path}'s {getattr(first, field)!r}")
        self.tap_layers, self.hidden_size = first.tap_layers, first.hidden_size
        self.vocab_size, self.target_config_hash = first.vocab_size, first.target_config_hash
        self.metadata = dict(first.st.metadata)
        self.index = [(k, s) for k, sh in enumerate(self.shards) for s in range(sh.num_sequences())]

    def num_sequences(self):
        return len(self.index)


# ----------------------------------------------------------------------------- target identity


def text_config(cfg):
    """A Gemma 4 config.json's text fields (multimodal checkpoints nest them under text_config)."""
    return cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg


def canonical_config_string(cfg):
    """docs/dspark.md "Checkpoints": the target identity text whose sha256 is config_hash (the same
    text tools/golden/make_dspark_golden.py and engine/draft/dspark/dspark_config.cpp build)."""
    c = text_config(cfg)
    cap = c.get("final_logit_softcapping")
    fields = [("hidden_size", c["hidden_size"]), ("num_hidden_layers", c["num_hidden_layers"]),
              ("vocab_size", c["vocab_size"]), ("intermediate_size", c["intermediate_size"]),
              ("num_attention_heads", c["num_attention_heads"]), ("num_key_value_heads", c["num_key_value_heads"]),
              ("head_dim", c["head_dim"]), ("sliding_window", c.get("sliding_window") or 0),
              ("final_logit_softcapping", "none" if cap is None else format(float(cap), "g")),
              ("layer_types", ",".join(c["layer_types"]))]
    return "gemma4-target-v1;" + ";".join(f"{k}={v}" for k, v in fields)


def target_config_hash(cfg):
    import hashlib
    return hashlib.sha256(canonical_config_string(cfg).encode("utf-8")).hexdigest()


def read_target_config(target_dir):
    path = os.path.join(target_dir, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read the target's config: {e}") from None


# ----------------------------------------------------------------------------- alignment


def anchor_range(length, resp_start, gamma):
    """Valid anchors t of a sequence of `length` positions (see the module docstring)."""
    return range(max(resp_start, 1), length - gamma)


def make_example(shards, seq, t, gamma, max_ctx=0):
    """The training example of global sequence `seq` anchored at position t (module docstring).
    Positions are within the sequence; *_rows are absolute rows of the shard."""
    k, s = shards.index[seq]
    sh = shards.shards[k]
    first, length, resp = sh.sequence(s)
    if t not in anchor_range(length, resp, gamma):
        raise DataError(f"{sh.path}: sequence {s}: anchor {t} outside {anchor_range(length, resp, gamma)}")
    ctx_begin = max(0, t - max_ctx) if max_ctx > 0 else 0
    return {
        "sequence": seq, "shard": os.path.basename(sh.path), "shard_sequence": s, "t": t,
        "context_positions": [ctx_begin, t],  # half-open: the taps of positions ctx_begin .. t-1
        "context_rows": [first + ctx_begin, first + t],
        "anchor_id": sh.ids[first + t],
        "block_ids": sh.ids[first + t + 1:first + t + 1 + gamma],
        "target_positions": [t, t + gamma],  # post-norm hidden h_{t+k} gives p^t for draft k
        "target_rows": [first + t, first + t + gamma],
    }


def split_sequences(num, held_out_fraction):
    """Whole sequences: i is held out when floor((i+1) f) > floor(i f) (as `specula calibrate`
    splits prompts). Returns (train, held_out) lists of global sequence ids."""
    train, held = [], []
    for i in range(num):
        (held if math.floor((i + 1) * held_out_fraction) > math.floor(i * held_out_fraction) else train).append(i)
    return train, held


class AnchorSampler:
    """Uniform over every valid (sequence, anchor) of `sequences` (not per sequence: long
    sequences get proportionally more anchors)."""

    def __init__(self, shards, sequences, gamma):
        self.shards, self.gamma = shards, gamma
        self.seqs, self.cum = [], [0]
        for g in sequences:
            k, s = shards.index[g]
            _, length, resp = shards.shards[k].sequence(s)
            n = len(anchor_range(length, resp, gamma))
            if n > 0:
                self.seqs.append((g, max(resp, 1)))
                self.cum.append(self.cum[-1] + n)
        if self.cum[-1] == 0:
            raise DataError(f"{shards.directory}: no sequence has a response of at least {gamma + 1} tokens "
                            f"(block size {gamma}) among the {len(sequences)} selected")

    def total(self):
        return self.cum[-1]

    def anchor(self, i):
        """The i-th anchor in a fixed order: (global sequence, t)."""
        j = bisect.bisect_right(self.cum, i) - 1
        g, t0 = self.seqs[j]
        return g, t0 + (i - self.cum[j])

    def sample(self, rng, n):
        return [self.anchor(rng.randrange(self.total())) for _ in range(n)]


def dump_examples(shards, n, gamma, max_ctx, seed, with_hidden=True):
    """n examples drawn with random.Random(seed), as JSON-ready dicts; with_hidden adds the bf16
    bit patterns of the context rows and of the target-hidden rows' last tap."""
    sampler = AnchorSampler(shards, range(shards.num_sequences()), gamma)
    rng = random.Random(seed)
    out = []
    for g, t in sampler.sample(rng, n):
        ex = make_example(shards, g, t, gamma, max_ctx)
        if with_hidden:
            sh = shards.shards[shards.index[g][0]]
            w, H = sh.width, sh.hidden_size
            bits = sh.hidden_bits(*ex["context_rows"])
            ex["context_hidden_bf16"] = [bits[i * w:(i + 1) * w].tolist() for i in range(len(bits) // w)]
            tb = sh.hidden_bits(*ex["target_rows"])
            ex["target_hidden_bf16"] = [tb[i * w + w - H:(i + 1) * w].tolist() for i in range(gamma)]
        out.append(ex)
    return {"format": "specula-dspark-examples-v1", "block_size": gamma, "max_ctx": max_ctx, "seed": seed,
            "tap_layers": shards.tap_layers, "hidden_size": shards.hidden_size, "examples": out}


def main(argv=None):
    p = argparse.ArgumentParser(description="Inspect DSpark training shards; dump sampled examples as JSON.")
    p.add_argument("--shards", required=True)
    p.add_argument("--block-size", type=int, default=5)
    p.add_argument("--max-ctx", type=int, default=0)
    p.add_argument("--dump-examples", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="-")
    a = p.parse_args(argv)
    try:
        shards = ShardSet(a.shards)
        if a.dump_examples <= 0:
            n = sum(len(anchor_range(*sh.sequence(s)[1:], a.block_size))
                    for sh in shards.shards for s in range(sh.num_sequences()))
            print(json.dumps({"shards": len(shards.shards), "sequences": shards.num_sequences(),
                              "anchors": n, "tap_layers": shards.tap_layers, "hidden_size": shards.hidden_size,
                              "target_config_hash": shards.target_config_hash}))
            return 0
        doc = dump_examples(shards, a.dump_examples, a.block_size, a.max_ctx, a.seed)
    except DataError as e:
        print(f"dspark_data: error: {e}", file=sys.stderr)
        return 1
    text = json.dumps(doc)
    if a.out == "-":
        print(text)
    else:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
