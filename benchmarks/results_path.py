"""Where a benchmark script writes its JSON: $OUT/<name> on the device (what $OUT holds comes back), else
benchmarks/results/<stem>-<date>.json here."""
from __future__ import annotations

import datetime as dt
import os
from pathlib import Path


def result_path(name: str, stem: str) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / name
    return Path(__file__).resolve().parent / "results" / f"{stem}-{dt.date.today().isoformat()}.json"
