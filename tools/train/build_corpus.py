#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Builds the training corpus of the embedded default Gemma 4 family.

The corpus is the Python source that Debian bookworm ships: the CPython 3.11
standard library (libpython3.11-stdlib, libpython3.11-minimal) plus about 95
python3-* library packages (numpy, scipy, sympy, django, pandas, twisted, ...),
listed with pinned versions in tools/train/corpus_packages.txt. The packages are
fetched with `apt-get download` and unpacked with `dpkg-deb -x` into a cache
folder: nothing is installed, so the corpus does not depend on what the machine
has installed. Runs here with plain python3 and no dependencies; the output is
deterministic for a given package list.

Selection: every regular `*.py` file of the unpacked packages, minus
  - test directories (`test`, `tests`, `idle_test`, `testing`),
  - generated code (EXCLUDED_DIRS below: plotly's graph objects and validators,
    sympy's rubi rule tables),
  - files over --max-file-bytes (generated tables), empty files, files that are
    not valid UTF-8, and files whose longest line exceeds --max-line-chars;
duplicate contents are kept once (first by sorted path). CRLF becomes LF.

Split BY FILE and by a hash of the file's path inside its package (so adding a
package never moves another package's files between splits):
sha256(path) % 20 == 0 -> heldout, == 10 -> valid (early stopping), else train.

Outputs (default .carry/corpus/, git-ignored; `.carry/` travels to the GPU
machine with `carry: [".carry"]`):
  train.txt.xz, valid.txt.xz, heldout.txt.xz  each split's files joined with "\\n\\n"
                 (xz so that the corpus fits the 64 MiB the working tree may take
                 to the GPU machine; tools/gpu/family_run.sh unpacks them)
  manifest.json.xz  packages + versions, rules, and per file: path, package, sha256,
                 chars, split, offset and length inside its split's text.

    python3 tools/train/build_corpus.py [--out DIR] [--packages FILE] [--deb-cache DIR]
"""

import argparse
import hashlib
import json
import lzma
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SEPARATOR = "\n\n"
SKIP_DIRS = {"test", "tests", "idle_test", "testing"}
# Machine-generated Python that would teach tables, not code.
EXCLUDED_DIRS = ("plotly/graph_objs/", "plotly/validators/", "sympy/integrals/rubi/")
HELDOUT_EVERY = 20
HELDOUT_REMAINDER = 0
VALID_REMAINDER = 10


def read_package_list(path):
    """name=version lines of `path` (comments and blank lines skipped)."""
    pins = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, version = line.partition("=")
            if not sep or not name or not version:
                sys.exit(f"build_corpus: {path}:{n}: expected name=version, got {line!r}")
            pins.append((name, version))
    if not pins:
        sys.exit(f"build_corpus: {path} lists no packages")
    return pins


def deb_name(name, version):
    # apt's file naming: the epoch colon is written %3a.
    return f"{name}_{version.replace(':', '%3a')}_"


def fetch_and_unpack(pins, cache):
    """Downloads missing .debs into cache/debs and unpacks each into cache/stage/<name>.
    Returns {package: unpacked root}."""
    debs = os.path.join(cache, "debs")
    stage = os.path.join(cache, "stage")
    os.makedirs(debs, exist_ok=True)
    os.makedirs(stage, exist_ok=True)
    roots = {}
    for name, version in pins:
        prefix = deb_name(name, version)
        found = [f for f in os.listdir(debs) if f.startswith(prefix) and f.endswith(".deb")]
        if not found:
            print(f"build_corpus: apt-get download {name}={version}", flush=True)
            r = subprocess.run(["apt-get", "download", f"{name}={version}"], cwd=debs, capture_output=True,
                               text=True)
            if r.returncode != 0:
                sys.exit(f"build_corpus: apt-get download {name}={version} failed: {r.stderr.strip()}")
            found = [f for f in os.listdir(debs) if f.startswith(prefix) and f.endswith(".deb")]
            if not found:
                sys.exit(f"build_corpus: apt-get download {name}={version} wrote no {prefix}*.deb in {debs}")
        root = os.path.join(stage, name)
        marker = os.path.join(root, ".unpacked-" + version.replace(":", "_"))
        if not os.path.exists(marker):
            subprocess.run(["rm", "-rf", root], check=True)
            os.makedirs(root)
            subprocess.run(["dpkg-deb", "-x", os.path.join(debs, sorted(found)[0]), root], check=True)
            open(marker, "w").close()
        roots[name] = root
    return roots


def python_files(root):
    """(path relative to root, absolute path) of the regular *.py files under root, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in filenames:
            full = os.path.join(dirpath, fn)
            if fn.endswith(".py") and os.path.isfile(full) and not os.path.islink(full):
                out.append((os.path.relpath(full, root), full))
    return sorted(out)


def skip_reason(rel, data, args):
    parts = rel.split("/")[:-1]
    if any(p in SKIP_DIRS for p in parts):
        return "test directory"
    if any(d in rel for d in EXCLUDED_DIRS):
        return "generated code"
    if len(data) > args.max_file_bytes:
        return f"over {args.max_file_bytes} bytes"
    if not data.strip():
        return "empty"
    return None


def split_of(rel):
    r = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big") % HELDOUT_EVERY
    if r == HELDOUT_REMAINDER:
        return "heldout"
    if r == VALID_REMAINDER:
        return "valid"
    return "train"


def select_files(pins, roots, args):
    seen_sha, files, skipped = {}, [], {}
    for name, _ in pins:
        for rel, full in python_files(roots[name]):
            with open(full, "rb") as f:
                data = f.read()
            reason = skip_reason(rel, data, args)
            sha = hashlib.sha256(data).hexdigest()
            if reason is None and sha in seen_sha:
                reason = "duplicate content"
            text = None
            if reason is None:
                try:
                    text = data.decode("utf-8").replace("\r\n", "\n")
                except UnicodeDecodeError:
                    reason = "not UTF-8"
            if reason is None and max(len(line) for line in text.split("\n")) > args.max_line_chars:
                reason = f"a line over {args.max_line_chars} characters"
            if reason is not None:
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            seen_sha[sha] = rel
            files.append({"path": rel, "package": name, "sha256": sha, "text": text})
    return files, skipped


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".carry/corpus", help="output folder")
    ap.add_argument("--packages", default=os.path.join(HERE, "corpus_packages.txt"),
                    help="file of name=version lines")
    ap.add_argument("--deb-cache", default=".cache/corpus", help="where .debs are downloaded and unpacked")
    ap.add_argument("--max-file-bytes", type=int, default=200_000)
    ap.add_argument("--max-line-chars", type=int, default=1000)
    ap.add_argument("--no-xz", action="store_true", help="write plain .txt files (small test corpora)")
    args = ap.parse_args()

    pins = read_package_list(args.packages)
    roots = fetch_and_unpack(pins, args.deb_cache)
    files, skipped = select_files(pins, roots, args)

    splits = {"train": [], "valid": [], "heldout": []}
    offsets = {"train": 0, "valid": 0, "heldout": 0}
    for f in files:
        s = split_of(f["path"])
        if splits[s]:
            offsets[s] += len(SEPARATOR)
        f.update(split=s, offset=offsets[s], chars=len(f["text"]))
        splits[s].append(f["text"])
        offsets[s] += len(f["text"])

    os.makedirs(args.out, exist_ok=True)
    for s, texts in splits.items():
        joined = SEPARATOR.join(texts).encode("utf-8")
        name = os.path.join(args.out, f"{s}.txt" + ("" if args.no_xz else ".xz"))
        tmp = name + ".tmp"
        if args.no_xz:
            with open(tmp, "wb") as fo:
                fo.write(joined)
        else:
            with lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as fo:
                fo.write(joined)
        os.replace(tmp, name)
        print(f"build_corpus: {name}: {len(texts)} files, {offsets[s]:,} characters, "
              f"{os.path.getsize(name) / 1e6:.1f} MB", flush=True)
    manifest = {
        "producer": "tools/train/build_corpus.py",
        "packages": dict(pins),
        "license_note": "Debian packages' own licenses; see /usr/share/doc/<package>/copyright in each .deb",
        "selection": f"*.py regular files of the unpacked .debs; minus directories {sorted(SKIP_DIRS)}, "
                     f"generated code {list(EXCLUDED_DIRS)}, files over {args.max_file_bytes} bytes or with a "
                     f"line over {args.max_line_chars} characters, empty, non-UTF-8 and duplicate-content "
                     "files; CRLF -> LF; packages in list order, files sorted by path",
        "split_rule": f"sha256(path in package) % {HELDOUT_EVERY}: {HELDOUT_REMAINDER} -> heldout, "
                      f"{VALID_REMAINDER} -> valid, else train",
        "separator": SEPARATOR,
        "counts": {s: len(t) for s, t in splits.items()},
        "chars": dict(offsets),
        "skipped": skipped,
        "files": [{k: v for k, v in f.items() if k != "text"} for f in files],
    }
    name = os.path.join(args.out, "manifest.json" + ("" if args.no_xz else ".xz"))
    with (open(name, "w", encoding="utf-8") if args.no_xz else lzma.open(name, "wt", encoding="utf-8")) as fo:
        json.dump(manifest, fo, indent=1)
    print(f"build_corpus: {len(files)} files ({manifest['counts']}), chars {manifest['chars']}, "
          f"skipped {skipped}, written to {args.out}")


if __name__ == "__main__":
    main()
