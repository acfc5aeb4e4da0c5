"""Byte-level training data for ``forge-optim train``: a built-in synthetic set and user files.

Everything is a flat stream of byte tokens (vocab 256), nanoGPT style: a batch is ``batch_size``
random windows of ``seq_len + 1`` bytes, the input is the first ``seq_len``, the target the last.

- ``arith``: addition problems such as ``"12+345=357\\n"``, generated from a seed, no download.
  The operands are random, so most of the loss that remains after training sits in the operand
  digits; the answer digits are what a model can learn (``answer_mask`` marks them for eval).
- a ``.txt`` file: its bytes as they are.
- a ``.jsonl`` file: the ``"text"`` field of each line, joined with ``"\\n"``.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import torch

VOCAB_SIZE = 256
EQ = ord("=")
NL = ord("\n")


def arith_problems(n: int, seed: int = 0, max_digits: int = 3) -> list[str]:
    """``n`` addition problems ``"a+b=c\\n"``; each operand has 1..max_digits digits (uniform)."""
    if max_digits < 1:
        raise ValueError(f"max_digits must be >= 1, got {max_digits}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randrange(10 ** (rng.randint(1, max_digits)))
        b = rng.randrange(10 ** (rng.randint(1, max_digits)))
        out.append(f"{a}+{b}={a + b}\n")
    return out


def bytes_to_tensor(data: bytes) -> torch.Tensor:
    """A byte string as a 1-D uint8 tensor of token ids."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def decode(tokens) -> str:
    """Token ids back to text (invalid UTF-8 is replaced)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def arith_tokens(n_problems: int, seed: int = 0, max_digits: int = 3) -> torch.Tensor:
    return bytes_to_tensor("".join(arith_problems(n_problems, seed, max_digits)).encode("ascii"))


def load_text(path: str) -> bytes:
    """The bytes of a text file."""
    with open(path, "rb") as f:
        return f.read()


def load_jsonl(path: str, field: str = "text") -> bytes:
    """The ``field`` of every JSON line, UTF-8 encoded, joined with newlines. Blank lines are skipped."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or field not in obj:
                raise ValueError(f"{path}:{lineno}: no {field!r} field")
            texts.append(str(obj[field]))
    if not texts:
        raise ValueError(f"{path}: no lines with a {field!r} field")
    return "\n".join(texts).encode("utf-8") + b"\n"


def load_file(path: str) -> bytes:
    """A ``.jsonl`` file's ``text`` fields, or any other file's bytes."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    if path.endswith(".jsonl"):
        return load_jsonl(path)
    return load_text(path)


@dataclass
class Dataset:
    name: str
    train: torch.Tensor  # 1-D uint8 token stream
    val: torch.Tensor
    note: str = ""

    def describe(self) -> str:
        s = f"{self.name}: {self.train.numel():,} train / {self.val.numel():,} val byte tokens"
        return s + (f" ({self.note})" if self.note else "")


def load_dataset(spec: str, seq_len: int, seed: int = 0, n_train_problems: int = 100_000,
                 n_val_problems: int = 5_000, val_fraction: float = 0.1) -> Dataset:
    """``spec`` is ``"arith"`` or a path to a ``.txt`` / ``.jsonl`` file."""
    if spec == "arith":
        # train and val come from different seeds: two independent streams of problems
        train = arith_tokens(n_train_problems, seed=seed)
        val = arith_tokens(n_val_problems, seed=seed + 1_000_003)
        return Dataset("arith", train, val)
    tokens = bytes_to_tensor(load_file(spec))
    need = seq_len + 1
    if tokens.numel() < need + 1:
        raise ValueError(f"{spec}: {tokens.numel()} bytes is too short for --seq-len {seq_len} "
                         f"(need at least {need + 1})")
    n_val = int(tokens.numel() * val_fraction)
    if n_val < need or tokens.numel() - n_val < need:
        return Dataset(os.path.basename(spec), tokens, tokens,
                       note="file too small for a held-out split: eval reuses the training bytes")
    return Dataset(os.path.basename(spec), tokens[:-n_val], tokens[-n_val:])


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows: inputs ``x`` and next-byte targets ``y`` (int64, [B, T])."""
    if data.numel() < seq_len + 1:
        raise ValueError(f"data has {data.numel()} tokens, need at least seq_len + 1 = {seq_len + 1}")
    ix = torch.randint(data.numel() - seq_len, (batch_size,), generator=generator)
    offs = torch.arange(seq_len + 1)
    chunk = data[ix[:, None] + offs].long()
    x, y = chunk[:, :-1], chunk[:, 1:]
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def answer_mask(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """True where the target ``y`` is part of an arithmetic answer (the digits after ``=`` and its
    closing newline), judged from the input ``x`` seen so far. Windows start mid-problem, so the
    first, partial problem of a window counts only once its ``=`` is in view."""
    T = x.shape[-1]
    idx = torch.arange(T, device=x.device).expand_as(x)
    neg = torch.full_like(idx, -1)
    last_eq = torch.where(x == EQ, idx, neg).cummax(dim=-1).values
    last_nl = torch.where(x == NL, idx, neg).cummax(dim=-1).values
    return last_eq > last_nl
