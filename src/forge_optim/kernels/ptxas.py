"""Registers and spills of a compiled kernel from Triton's bundled ``ptxas -v`` (no GPU needed)."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile


def _bin(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_usage(ptx: str, arch: str = "sm_90a", sass: bool = False) -> dict:
    """{"registers", "spill_bytes", "stack_bytes"} (and "sass", the cuobjdump text, if asked)."""
    with tempfile.TemporaryDirectory() as d:
        p, o = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(p, "w") as f:
            f.write(ptx)
        out = subprocess.run([_bin("ptxas"), f"-arch={arch}", "-v", p, "-o", o], capture_output=True,
                             text=True, check=True).stderr
        num = lambda pat: int(m.group(1)) if (m := re.search(pat, out)) else None  # noqa: E731
        res = dict(registers=num(r"Used (\d+) registers"), spill_bytes=num(r"(\d+) bytes spill stores"),
                   stack_bytes=num(r"(\d+) bytes stack frame"))
        if sass:
            res["sass"] = subprocess.run([_bin("cuobjdump"), "--dump-sass", o], capture_output=True,
                                         text=True).stdout
    return res
