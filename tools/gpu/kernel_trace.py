#!/usr/bin/env python3
"""Where a forward's time goes, from a kernel_trace.cpp CSV.

Forwards are the runs of kernels between two embedding launches. Among the
forwards with the same kernel count (a decode step, a verify window, ...), the
one with the median span is broken down by kernel (name + grid): calls, summed
durations, and the "incremental" time, how far each kernel moved the end of
the step past the kernels before it (programmatic dependent launches overlap
kernels, so durations double count; the increments add up to the span).

  python3 tools/gpu/kernel_trace.py trace.csv [--kernels N] [--top 20] [--timeline A:B]

--timeline A:B also lists kernels A..B-1 of that median forward in launch
order: start and end relative to kernel A's start, duration, and the gap from
the latest end before it (negative: overlapped).
"""
import argparse
import collections
import re


def load(path):
    rows = []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split(",", 4)
            if len(parts) < 5:
                continue
            name = parts[4].replace("specula::cuda::", "").replace("(anonymous namespace)::", "")
            name = re.sub(r"\(.*$", "", name.replace("void ", ""))
            rows.append((int(parts[0]), int(parts[1]), f"{name} g{parts[2]}"))
    rows.sort()
    return rows


def forwards(rows):
    starts = [i for i, r in enumerate(rows) if "embedding_kernel" in r[2]]
    return [rows[a:b] for a, b in zip(starts, starts[1:])]


def span(seg):
    return max(e for _, e, _ in seg) - seg[0][0]


def breakdown(seg):
    totals = collections.defaultdict(lambda: [0, 0, 0])
    prev_end = seg[0][0]
    for s, e, n in seg:
        t = totals[n]
        t[0] += 1
        t[1] += e - s
        t[2] += max(e, prev_end) - prev_end
        prev_end = max(prev_end, e)
    return totals


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--kernels", type=int, help="only forwards of this many kernels")
    ap.add_argument("--groups", type=int, default=3, help="most common kernel counts to show")
    ap.add_argument("--top", type=int, default=20, help="kernels listed per forward")
    ap.add_argument("--timeline", help="A:B, kernels A..B-1 of the median forward, in order")
    args = ap.parse_args()
    segs = forwards(load(args.trace))
    counts = collections.Counter(len(s) for s in segs)
    wanted = [args.kernels] if args.kernels else [n for n, _ in counts.most_common(args.groups)]
    for n in wanted:
        group = sorted((s for s in segs if len(s) == n), key=span)
        if not group:
            print(f"no forward of {n} kernels")
            continue
        median = group[len(group) // 2]
        print(f"\n{len(group)} forwards of {n} kernels; median span {span(median) / 1e6:.3f} ms "
              f"(min {span(group[0]) / 1e6:.3f})")
        totals = breakdown(median)
        whole = sum(t[2] for t in totals.values())
        print(f"{'kernel':72s} {'calls':>5s} {'dur us':>9s} {'incr us':>9s} {'incr %':>7s}")
        for name, t in sorted(totals.items(), key=lambda kv: -kv[1][2])[: args.top]:
            print(f"{name[:72]:72s} {t[0]:5d} {t[1] / 1e3:9.1f} {t[2] / 1e3:9.1f} {100 * t[2] / whole:7.1f}")
        if args.timeline:
            timeline(median, *(int(v) for v in args.timeline.split(":")))


def timeline(seg, first, last):
    base = seg[first][0]
    prev_end = max([e for _, e, _ in seg[:first]], default=base)
    print(f"{'#':>5s} {'start us':>9s} {'end us':>9s} {'dur us':>8s} {'gap us':>8s}  kernel")
    for i in range(first, min(last, len(seg))):
        s, e, n = seg[i]
        print(f"{i:5d} {(s - base) / 1e3:9.2f} {(e - base) / 1e3:9.2f} {(e - s) / 1e3:8.2f} "
              f"{(s - prev_end) / 1e3:8.2f}  {n[:90]}")
        prev_end = max(prev_end, e)


if __name__ == "__main__":
    main()
