"""Merge a re-tune's entries into a shipped tuned-config table (src/forge_optim/kernels/tuned/<device>.json).

`tune_shapes.py --out` writes a table of the keys it timed; this replaces the shipped entries with the same
keys, keeps the others, and appends a line to the table's 'merged' note saying what replaced what and where
the figures are. Entries whose winner did not change are still replaced (their timings are the newer run's).

  python3 benchmarks/merge_tuned.py SHIPPED.json RETUNE.json --why "text for the note" [--dry-run]
"""
import argparse
import json
from pathlib import Path


def merge(shipped: dict, retune: dict, why: str) -> tuple[dict, list[str]]:
    if shipped.get("device") != retune.get("device"):
        raise SystemExit(f"device mismatch: shipped table is {shipped.get('device')!r}, re-tune ran on "
                         f"{retune.get('device')!r}; merge only a re-tune from the table's own device")
    new = {e["key"]: e for e in retune["entries"]}
    changes = []
    entries = []
    for e in shipped["entries"]:
        n = new.pop(e["key"], None)
        if n is None:
            entries.append(e)
            continue
        old_cfg = min(e["timings_ms"], key=e["timings_ms"].get)
        new_cfg = min(n["timings_ms"], key=n["timings_ms"].get)
        changes.append(f"{e['shape']} BT={e['BT']} {e['states']}: {old_cfg} ({e['ms']:.4f} ms then) -> "
                       f"{new_cfg} ({n['ms']:.4f} ms; the old winner {n['timings_ms'].get(old_cfg, float('nan')):.4f})")
        entries.append(n)
    for n in new.values():  # keys the shipped table did not have
        changes.append(f"{n['shape']} BT={n['BT']} {n['states']}: new key -> "
                       f"{min(n['timings_ms'], key=n['timings_ms'].get)} ({n['ms']:.4f} ms)")
        entries.append(n)
    out = dict(shipped)
    line = (f"{retune.get('date', '?')[:10]}: {len(retune['entries'])} entries replaced by "
            f"{retune.get('command', '?')} (source_digest {retune.get('source_digest', '?')}): {why}")
    out["merged"] = (shipped["merged"] + " | " + line) if shipped.get("merged") else line
    out["entries"] = entries
    return out, changes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shipped")
    ap.add_argument("retune")
    ap.add_argument("--why", required=True, help="what the re-tune was for and where its figures are")
    ap.add_argument("--dry-run", action="store_true", help="print the changes, write nothing")
    a = ap.parse_args()
    shipped = json.loads(Path(a.shipped).read_text())
    out, changes = merge(shipped, json.loads(Path(a.retune).read_text()), a.why)
    print("\n".join(changes))
    if not a.dry_run:
        Path(a.shipped).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.shipped}")


if __name__ == "__main__":
    main()
