"""Name the Gluon ping-pong kernel in a shipped tuned table where pp_sweep.py measured it faster.

For every row of a pp_sweep.json (whole weight, bf16 W/m/v, AdamW, SR, non-finite count: the key
forge_optim.AdamW's default bf16-state update makes) whose best ping-pong schedule beat the best Triton
tile of the same run by more than --margin, the table's bf16 entry for that shape and BT regime gets the
ping-pong config ({"kernel": "pingpong", ...}); its Triton timings stay in the entry, beside the sweep's.
Rows where it did not win leave the entry as it is. Appends a line to the table's 'merged' note.

A schedule is eligible if it is one of ``pingpong.CANDIDATES`` (the GPU bit tests run those), or if the sweep ran with
--check-bits and found its bytes equal to the Triton reference tile's (``bits_equal``); its config is then read from
the sweep's row. A schedule whose check failed is never tabled. The shipped-table test also wants every tabled
schedule in ``CANDIDATES``: a new one must be added there (and to the tests' configs) before its table ships.

  python3 benchmarks/pp_table.py TABLE.json SWEEP.json [SWEEP.json ...] --why "..." [--margin 0.03] [--dry-run]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from forge_optim.kernels import pingpong as PP  # noqa: E402
from forge_optim.kernels.launch import bt_regime  # noqa: E402

BY_NAME = {c.short(): c for c in PP.CANDIDATES}


def bf16_key(M: int, N: int, BT: int) -> str:
    return repr(((M, N), bt_regime(BT), "torch.bfloat16", "torch.bfloat16", "AdamW", (2, 2, 0), False, True, True, True))


def eligible(row: dict, name: str) -> bool:
    """May ``name`` (a ping-pong schedule timed in ``row``) be tabled? Never if the sweep's bit check failed for it;
    a CANDIDATES schedule otherwise; any other only where the check ran and passed, and the row holds its config."""
    checked = row.get("bits_equal", {}).get(name)
    if checked is not None and checked is not True:
        return False
    if name in BY_NAME:
        return True
    return checked is True and name in row.get("configs", {})


def schedule(row: dict, name: str):
    return BY_NAME[name] if name in BY_NAME else PP.from_table(row["configs"][name])


def apply(table: dict, sweeps: list[dict], why: str, margin: float) -> tuple[dict, list[str]]:
    entries = {e["key"]: e for e in table["entries"]}
    order = [e["key"] for e in table["entries"]]
    changes = []
    for sw in sweeps:
        if sw["device"] != table["device"]:
            raise SystemExit(f"device mismatch: table {table['device']!r}, sweep {sw['device']!r}")
        for row in sw["rows"]:
            if row.get("states", "bf16") != "bf16":  # the int8 ping-pong is slower (NOTES thirtieth session)
                continue
            M, N = map(int, row["shape"].split("x"))
            t = {k: v for k, v in row["ms"].items() if isinstance(v, float)}
            pp = {k: v for k, v in t.items() if eligible(row, k)}
            tr = {k: v for k, v in t.items() if k.startswith("triton ")}
            if not pp or not tr:
                continue
            best_pp = min(pp, key=pp.get)
            best_tr = min(tr, key=tr.get)
            ratio = pp[best_pp] / tr[best_tr]
            key = bf16_key(M, N, row["BT"])
            if ratio > 1 - margin:
                changes.append(f"{row['shape']} BT={row['BT']}: kept ({best_pp} {ratio:.3f}x of {best_tr})")
                continue
            e = entries.get(key)
            e = dict(e) if e is not None else dict(key=key, shape=row["shape"], BT=row["BT"], states="bf16",
                                                   timings_ms={})
            # what runs with bf16 W and two bf16 states (a schedule too large for them is shrunk at launch)
            e["config"] = PP.table_dict(PP.fit_config(schedule(row, best_pp), 2, 4))
            e["ms"] = pp[best_pp]
            e["timings_ms"] = dict(e.get("timings_ms", {}), **{f"sweep {k}": v for k, v in t.items()})
            e["pingpong"] = dict(sweep=sw.get("command", "?"), date=sw.get("date", "?"), ratio=round(ratio, 4),
                                 against=best_tr)
            if key not in entries:
                order.append(key)
            entries[key] = e
            changes.append(f"{row['shape']} BT={row['BT']}: -> {best_pp} ({pp[best_pp]:.4f} ms, {ratio:.3f}x of "
                           f"{best_tr} {tr[best_tr]:.4f})"
                           + ("" if best_pp in BY_NAME else " [not in pingpong.CANDIDATES: add it there and to the "
                                                             "tests' configs before this table ships]"))
    out = dict(table)
    out["entries"] = [entries[k] for k in order]
    line = f"{sweeps[0].get('date', '?')[:10]}: ping-pong entries from {len(sweeps)} pp_sweep run(s): {why}"
    out["merged"] = (table["merged"] + " | " + line) if table.get("merged") else line
    return out, changes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("sweeps", nargs="+")
    ap.add_argument("--why", required=True)
    ap.add_argument("--margin", type=float, default=0.03)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    table = json.loads(Path(a.table).read_text())
    out, changes = apply(table, [json.loads(Path(p).read_text()) for p in a.sweeps], a.why, a.margin)
    print("\n".join(changes))
    if not a.dry_run:
        Path(a.table).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.table}")


if __name__ == "__main__":
    main()
