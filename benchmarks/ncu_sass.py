"""Summarize an Nsight Compute source page (SASS) of the fused kernel: where the warps stall and
which instructions are executed most.

    python3 benchmarks/ncu_sass.py OUTDIR/source.csv [--top 30]

``source.csv`` is ``ncu -i REPORT --page source --csv --print-source sass`` (benchmarks/ncu_h200.sh).
For each profiled kernel: the stall reasons summed over all samples, the executed warp-instructions
by opcode (the first word of the SASS line, e.g. ``HFMA2``, ``LDG``, ``IMAD``), the SASS lines
with the most stall samples, and the kernel by region: SASS lines grouped by how often each ran (a line run
once per tile and warp is the epilogue, one run BT/BK times as often the K loop), with each group's share of
instructions and of stall samples (NOTES.md, twenty-eighth session).
"""
from __future__ import annotations

import argparse
import csv
import io
from collections import Counter


def blocks(path):
    """Split the file into one (header, rows) per kernel."""
    text = open(path).read()
    out, cur = [], None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            cur = None
            continue
        if row[0] == "Address":
            cur = (row, [])
            out.append(cur)
            continue
        if cur is not None:
            cur[1].append(row)
    return out


def num(s):
    try:
        return float(s.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def opcode(src):
    words = src.strip().split()
    w = words[0] if words else "?"
    if w.startswith("@"):  # predicate
        w = words[1] if len(words) > 1 else "?"
    return w.split(".")[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("source_csv")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    for k, (hdr, rows) in enumerate(blocks(a.source_csv)):
        col = {h: i for i, h in enumerate(hdr)}
        samp = col["Warp Stall Sampling (All Samples)"]
        inst = col["Instructions Executed"]
        stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
        tot_s = sum(num(r[samp]) for r in rows) or 1.0
        tot_i = sum(num(r[inst]) for r in rows) or 1.0
        print(f"=== kernel {k}: {len(rows)} SASS lines, {tot_i:.3e} warp-instructions executed, "
              f"{tot_s:.0f} stall samples")
        st = Counter({h: sum(num(r[col[h]]) for r in rows) for h in stall_cols})
        sst = sum(st.values()) or 1.0
        print("stall reasons: " + ", ".join(f"{h[6:]} {v / sst * 100:.1f}%" for h, v in st.most_common(10)))
        ops = Counter()
        for r in rows:
            ops[opcode(r[1])] += num(r[inst])
        print("instructions: " + ", ".join(f"{o} {v / tot_i * 100:.1f}%" for o, v in ops.most_common(24)))
        print(f"top {a.top} lines by stall samples:")
        for r in sorted(rows, key=lambda r: num(r[samp]), reverse=True)[:a.top]:
            reasons = sorted(((num(r[col[h]]), h[6:]) for h in stall_cols), reverse=True)[:2]
            why = ", ".join(f"{n} {v:.0f}" for v, n in reasons if v > 0)
            print(f"  {num(r[samp]) / tot_s * 100:5.1f}%  {r[0]:>6} {r[1].strip()[:70]:70s} [{why}]")
        print("regions (SASS lines by how often each ran):")
        for n, lines, i_share, s_share, top in regions(rows, samp, inst)[:6]:
            print(f"  run {n:>9.0f} times: {lines:5d} lines, {i_share * 100:5.1f}% of instructions, "
                  f"{s_share * 100:5.1f}% of samples; " + ", ".join(f"{o} {c:.0f}" for o, c in top))
        print()


def regions(rows, samp, inst):
    """(times run, lines, share of instructions, share of samples, top opcodes by lines) per group of
    SASS lines run equally often, most instructions first."""
    groups = {}
    for r in rows:
        g = groups.setdefault(num(r[inst]), [0, 0.0, 0.0, Counter()])
        g[0] += 1
        g[1] += num(r[inst])
        g[2] += num(r[samp])
        g[3][opcode(r[1])] += 1
    tot_i = sum(g[1] for g in groups.values()) or 1.0
    tot_s = sum(g[2] for g in groups.values()) or 1.0
    out = [(n, g[0], g[1] / tot_i, g[2] / tot_s, g[3].most_common(5)) for n, g in groups.items()]
    return sorted(out, key=lambda t: t[2], reverse=True)


if __name__ == "__main__":
    main()
