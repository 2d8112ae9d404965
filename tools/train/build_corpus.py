#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Builds the training corpus of the embedded default Gemma 4 family.

The corpus is the Python 3.11 standard library as Debian ships it (packages
libpython3.11-stdlib and libpython3.11-minimal by default: together they hold
the whole pure-Python standard library; the first alone is only about half of
it). Runs here with plain python3 and no dependencies; the output is
deterministic for a given set of installed package versions.

Selection: every `*.py` path that `dpkg -L <package>` lists and that is a
regular file, minus test directories (`test`, `tests`, `idle_test`), minus
empty files and files that are not valid UTF-8; duplicates (same path, or same
content) are kept once. Files are sorted by path. Split BY FILE on that order:
index % 20 == 0 -> heldout, index % 20 == 10 -> valid (early stopping), the
rest -> train. CRLF line ends become LF.

Outputs (default /work/main/.carry/corpus/, git-ignored; `.carry/` travels to
the GPU machine with `carry: [".carry"]`):
  train.txt, valid.txt, heldout.txt  files of the split joined with "\\n\\n"
  manifest.json  packages + versions, rules, and per file: path, package,
                 sha256 (of the bytes read), bytes, chars, split, offset and
                 length (in characters) of the file inside its split's text.

    python3 tools/train/build_corpus.py [--out DIR] [--packages a,b]
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys

DEFAULT_PACKAGES = "libpython3.11-stdlib,libpython3.11-minimal"
SEPARATOR = "\n\n"
SKIP_DIRS = {"test", "tests", "idle_test"}
HELDOUT_EVERY = 20
HELDOUT_REMAINDER = 0
VALID_REMAINDER = 10


def package_files(package):
    """The *.py regular files a Debian package installs (sorted)."""
    try:
        out = subprocess.run(["dpkg", "-L", package], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"build_corpus: cannot list package {package!r} with dpkg -L: {e}")
    paths = [p.strip() for p in out.splitlines()]
    return sorted(p for p in paths if p.endswith(".py") and os.path.isfile(p) and not os.path.islink(p))


def package_version(package):
    try:
        return subprocess.run(["dpkg-query", "-W", "-f", "${Version}", package], check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def skipped_dir(path):
    return any(part in SKIP_DIRS for part in path.split("/")[:-1])


def split_of(index):
    r = index % HELDOUT_EVERY
    if r == HELDOUT_REMAINDER:
        return "heldout"
    if r == VALID_REMAINDER:
        return "valid"
    return "train"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/work/main/.carry/corpus", help="output folder")
    ap.add_argument("--packages", default=DEFAULT_PACKAGES, help="comma-separated Debian packages")
    args = ap.parse_args()

    packages = [p for p in args.packages.split(",") if p]
    owner = {}
    for pkg in packages:
        for path in package_files(pkg):
            owner.setdefault(path, pkg)
    skipped = []
    seen_sha = {}
    files = []
    for path in sorted(owner):
        if skipped_dir(path):
            skipped.append({"path": path, "reason": "test directory"})
            continue
        with open(path, "rb") as f:
            data = f.read()
        sha = hashlib.sha256(data).hexdigest()
        if not data.strip():
            skipped.append({"path": path, "reason": "empty"})
            continue
        if sha in seen_sha:
            skipped.append({"path": path, "reason": f"duplicate of {seen_sha[sha]}"})
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            skipped.append({"path": path, "reason": f"not UTF-8: {e}"})
            continue
        seen_sha[sha] = path
        files.append({"path": path, "package": owner[path], "sha256": sha, "bytes": len(data),
                      "text": text.replace("\r\n", "\n")})

    splits = {"train": [], "valid": [], "heldout": []}
    offsets = {"train": 0, "valid": 0, "heldout": 0}
    for i, f in enumerate(files):
        s = split_of(i)
        if splits[s]:
            offsets[s] += len(SEPARATOR)
        f["split"] = s
        f["offset"] = offsets[s]
        f["chars"] = len(f["text"])
        splits[s].append(f["text"])
        offsets[s] += len(f["text"])

    os.makedirs(args.out, exist_ok=True)
    for s, texts in splits.items():
        joined = SEPARATOR.join(texts)
        assert len(joined) == offsets[s], (s, len(joined), offsets[s])
        with open(os.path.join(args.out, f"{s}.txt"), "w", encoding="utf-8", newline="") as fo:
            fo.write(joined)
    manifest = {
        "producer": "tools/train/build_corpus.py",
        "packages": {p: package_version(p) for p in packages},
        "license_note": "Python standard library sources, PSF License (see /usr/share/doc/<package>/copyright)",
        "selection": "dpkg -L <package> | *.py regular files; minus directories test/, tests/, idle_test/; "
                     "minus empty, non-UTF-8 and duplicate-content files; CRLF -> LF; sorted by path",
        "split_rule": f"index in sorted list % {HELDOUT_EVERY}: {HELDOUT_REMAINDER} -> heldout, "
                      f"{VALID_REMAINDER} -> valid, else train",
        "separator": SEPARATOR,
        "counts": {s: len(t) for s, t in splits.items()},
        "chars": dict(offsets),
        "files": [{k: v for k, v in f.items() if k != "text"} for f in files],
        "skipped": skipped,
    }
    with open(os.path.join(args.out, "manifest.json"), "w", encoding="utf-8") as fo:
        json.dump(manifest, fo, indent=1)
    print(f"build_corpus: {len(files)} files ({manifest['counts']}), chars {manifest['chars']}, "
          f"skipped {len(skipped)}, written to {args.out}")


if __name__ == "__main__":
    main()
