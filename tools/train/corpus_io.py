# SPDX-License-Identifier: Apache-2.0
"""Reads build_corpus.py's output (standard library only, so tools that run without torch can use
it): the manifest and each split's file texts, from plain files or their .xz copies."""

import json
import lzma
import os


def _open_text(path):
    """path, or path + ".xz" (build_corpus.py writes xz so the corpus can travel); None if neither."""
    if os.path.exists(path):
        return open(path, encoding="utf-8", newline="")
    if os.path.exists(path + ".xz"):
        return lzma.open(path + ".xz", "rt", encoding="utf-8", newline="")
    return None


def read_manifest(corpus):
    f = _open_text(os.path.join(corpus, "manifest.json"))
    if f is None:
        raise FileNotFoundError(f"{corpus}: no manifest.json(.xz): not a build_corpus.py output")
    with f:
        return json.load(f)


def read_split(corpus, manifest, split):
    """([file texts], [paths]) of `split` in manifest order; ([], []) when its text file is absent."""
    f = _open_text(os.path.join(corpus, f"{split}.txt"))
    if f is None:
        return [], []
    with f:
        text = f.read()
    files = [m for m in manifest["files"] if m["split"] == split]
    return [text[m["offset"]:m["offset"] + m["chars"]] for m in files], [m["path"] for m in files]
