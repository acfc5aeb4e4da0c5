"""Compare the trees of an ``epilogue_ab.py`` A/B: one table of ms per (shape, BT, states, config) and tree.

    python3 benchmarks/ab_compare.py DIR [--base main] [--out summary.json]

DIR holds ``ab-<tree>-r<round>.json`` files (``fence_ab.sh`` writes them). Each cell takes the faster of a
tree's rounds (drift between rounds shows as the spread, printed too); ratios are to the base tree. The
bits column says whether every tree wrote the same digest for that cell (it should, where a change keeps
bit identity). A last block gives each tree's best config per (shape, BT, states), which is what a
re-tuned table would ship.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(d: Path):
    cells = defaultdict(lambda: defaultdict(list))  # (shape, BT, states, config) -> tree -> [row]
    for f in sorted(d.glob("ab-*.json")):
        for r in json.loads(f.read_text())["rows"]:
            tree = r["label"].rsplit("-r", 1)[0]
            cells[(r["shape"], r["BT"], r["states"], r["config"])][tree].append(r)
    return cells


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--base", default="main")
    ap.add_argument("--out")
    a = ap.parse_args()
    cells = load(Path(a.dir))
    trees = sorted({t for c in cells.values() for t in c}, key=lambda t: (t != a.base, t))
    summary = []
    print(f"{'shape':12s} {'BT':>4} {'st':4s} {'config':40s} " + " ".join(f"{t:>14s}" for t in trees) + "  bits")
    for key in sorted(cells):
        by = cells[key]
        best = {t: min(r["ms"] for r in rows) for t, rows in by.items()}
        spread = {t: (max(r["ms"] for r in rows) / best[t] - 1) if len(rows) > 1 else 0.0 for t, rows in by.items()}
        digests = {r["bits"] for rows in by.values() for r in rows}
        base = best.get(a.base)
        cols = []
        for t in trees:
            if t not in best:
                cols.append(f"{'-':>14s}")
            elif t == a.base or base is None:
                cols.append(f"{best[t]:8.4f}±{spread[t] * 100:3.0f}% ")
            else:
                cols.append(f"{best[t] / base:6.3f}x±{spread[t] * 100:3.0f}%  ")
        same = "same" if len(digests) == 1 else f"DIFFER({len(digests)})"
        print(f"{key[0]:12s} {key[1]:>4} {key[2]:4s} {key[3]:40s} " + " ".join(cols) + "  " + same)
        summary.append(dict(shape=key[0], BT=key[1], states=key[2], config=key[3], best_ms=best,
                            spread=spread, ratio_to_base={t: best[t] / base for t in best} if base else None,
                            bits_equal=len(digests) == 1))
    print("\nbest config per (shape, BT, states):")
    groups = defaultdict(dict)
    for s in summary:
        for t, ms in s["best_ms"].items():
            g = groups[(s["shape"], s["BT"], s["states"])]
            if t not in g or ms < g[t][0]:
                g[t] = (ms, s["config"])
    for key in sorted(groups):
        g = groups[key]
        base = g.get(a.base, (None,))[0]
        line = "  ".join(f"{t}: {ms:.4f} {cfg}" + (f" ({ms / base:.3f}x)" if base and t != a.base else "")
                         for t, (ms, cfg) in sorted(g.items(), key=lambda kv: (kv[0] != a.base, kv[0])))
        print(f"{key[0]:12s} {key[1]:>4} {key[2]:4s} {line}")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(cells=summary, best={"|".join(map(str, k)): v
                                                                    for k, v in groups.items()}), indent=1) + "\n")


if __name__ == "__main__":
    main()
