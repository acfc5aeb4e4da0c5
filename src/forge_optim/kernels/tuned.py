"""Configs tuned offline on the whole weight, per device: the tuner's answer for shapes it knows.

The runtime tuner (launch.Tuner) times candidates on clones of at most ``TUNE_ROWS`` rows, so that
tuning never copies a weight-sized tensor. That sub-problem does not always rank the candidates as
the whole weight does: on the H200 its picks ran 1-9% slower on the whole weight than the best
candidate there, and a prefetch config that ties on 4096 rows of the lm_head runs 1.24x slower on
all 128256 (benchmarks/tuner_fidelity.py, results/tuner-fidelity-2026-12-03.json).
``benchmarks/tune_shapes.py`` times every candidate on the whole weight for the common shapes and
writes ``tuned/<device>.json``; the tuner takes an entry from it when the device name and the tuning
key match exactly, and times sub-problems as before for everything else.
A user's own tables (``forge-optim tune``: their GPU, their model's shapes) live in ``user_table_dir()``
(``$FORGE_TUNED_DIR``, else ``~/.cache/forge_optim/tuned``) and take precedence over the shipped ones.
``FORGE_TUNED_TABLE=0`` turns the tables off (A/B runs, or after a kernel change that left a table stale).
"""
from __future__ import annotations

import json
import os
import re
import warnings
from functools import lru_cache
from pathlib import Path

TABLE_DIR = Path(__file__).resolve().parent / "tuned"


def table_name(device_name: str) -> str:
    """``NVIDIA H200`` -> nvidia_h200.json"""
    return re.sub(r"[^0-9a-z]+", "_", device_name.lower()).strip("_") + ".json"


def table_path(device_name: str) -> Path:
    """The shipped table of ``device_name`` (kernels/tuned/<name>.json)."""
    return TABLE_DIR / table_name(device_name)


def user_table_dir() -> Path:
    if os.environ.get("FORGE_TUNED_DIR"):
        return Path(os.environ["FORGE_TUNED_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "forge_optim" / "tuned"


def user_table_path(device_name: str) -> Path:
    """Where ``forge-optim tune`` writes ``device_name``'s table; read before the shipped one."""
    return user_table_dir() / table_name(device_name)


def key_text(key: tuple) -> str:
    """The tuning key as the tables store it (its repr: dtypes are strings, the rest ints/bools)."""
    return repr(key)


@lru_cache(maxsize=None)
def load_table(device_name: str) -> dict:
    """{key text: config dict} for ``device_name``: the shipped table, then the user's (which wins on
    a key both hold); empty when there is none. An unreadable table is ignored with a warning."""
    out = {}
    for path in (table_path(device_name), user_table_path(device_name)):
        out.update(_read(path, device_name))
    return out


def _read(path: Path, device_name: str) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("device") != device_name:
            raise ValueError(f"table is for {data.get('device')!r}")
        return {e["key"]: dict(e["config"]) for e in data["entries"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"forge_optim: ignoring the tuned-config table {path} ({err}); "
                      "configs are tuned at run time instead", stacklevel=3)
        return {}


def enabled() -> bool:
    return os.environ.get("FORGE_TUNED_TABLE", "1") != "0"


def is_pingpong(cfg) -> bool:
    """Whether ``cfg`` is the Gluon ping-pong kernel's config (by type name: importing kernels.pingpong needs
    Gluon, which the Triton kernel's callers should not pay for)."""
    return type(cfg).__name__ == "PingPongConfig"


def config_dict(cfg) -> dict:
    """``cfg`` as a table stores it (``lookup`` reads it back): a KernelConfig's fields, or the ping-pong
    kernel's named form."""
    if is_pingpong(cfg):
        from . import pingpong

        return pingpong.table_dict(cfg)
    from dataclasses import asdict

    return asdict(cfg)


def lookup(key: tuple, device_name: str):
    """The config tuned for ``key`` on ``device_name`` (a KernelConfig, or a pingpong.PingPongConfig for an
    entry whose config names ``"kernel": "pingpong"``), or None."""
    if not enabled():
        return None
    cfg = load_table(device_name).get(key_text(key))
    if cfg is None:
        return None
    from .launch import KernelConfig

    try:
        if cfg.get("kernel") == "pingpong":
            from . import pingpong

            return pingpong.from_table(cfg)
        return KernelConfig(**cfg)
    except (TypeError, ValueError, ImportError) as err:  # a table written by another version of KernelConfig
        warnings.warn(f"forge_optim: tuned config {cfg} no longer valid ({err}); tuning at run time",
                      stacklevel=2)
        return None
