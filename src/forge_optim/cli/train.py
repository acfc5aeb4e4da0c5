"""``forge-optim train``: train a small Llama-style causal LM with a forge_optim optimizer.

nanoGPT style: one config dataclass, then ``train(cfg)`` reads top to bottom (data, model,
optimizer, schedule, loop, eval, report). The default run (0.9M parameters, byte-level addition
problems, 2 CPU cores) finishes in about a minute and a half and its loss falls from ln(256) = 5.5.

The run folder (``--out-dir``, default ``runs/<timestamp>``) gets ``config.json``,
``metrics.jsonl`` (one JSON object per logged step), ``loss.png`` and ``summary.json``.

Notes
- Fused nn.Linear weights are updated inside ``loss.backward()``; their gradient never exists as a
  tensor. So there is no gradient clipping here (there is no global gradient norm to clip by).
- Gradient accumulation with a forge optimizer runs the non-final micro-steps under
  ``opt.accumulate()`` (exact: the update sees the summed gradient).
- The LR schedule is linear warm-up then cosine to ``min_lr_ratio * lr``, via LambdaLR, so it goes
  through the optimizer's param_groups, which the fused update reads at backward time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .. import data as fdata

# name -> (forge_optim class name or None for torch.optim.AdamW, default lr, default weight decay,
#          takes betas, default betas). Coupled-L2 rules default to no weight decay.
OPTIMIZERS: dict[str, tuple[str | None, float, float, bool, tuple[float, float] | None]] = {
    "forge-adamw": ("AdamW", 3e-3, 0.1, True, (0.9, 0.95)),
    "forge-adam": ("Adam", 3e-3, 0.0, True, (0.9, 0.95)),
    "forge-nadam": ("NAdam", 3e-3, 0.0, True, (0.9, 0.95)),
    "forge-radam": ("RAdam", 3e-3, 0.0, True, (0.9, 0.95)),
    "forge-lion": ("Lion", 3e-4, 1.0, True, (0.9, 0.99)),
    "forge-rmsprop": ("RMSprop", 1e-3, 0.0, False, None),
    "forge-adagrad": ("Adagrad", 2e-2, 0.0, False, None),
    "forge-sgd": ("SGD", 3e-2, 0.0, False, None),  # momentum 0.9; 0.3 diverges here
    "torch-adamw": (None, 3e-3, 0.1, True, (0.9, 0.95)),
}

# dense peak TFLOP/s by CUDA device name fragment, for MFU: (bf16, fp32 without TF32)
PEAK_TFLOPS = {"H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5),
               "L40S": (362.0, 91.6), "A10G": (70.0, 31.2), "4090": (165.0, 82.6)}


@dataclass
class TrainConfig:
    # data
    data: str = "arith"  # "arith" (built-in, no download) or a path to a .txt / .jsonl file
    seq_len: int = 128
    batch_size: int = 16
    grad_accum: int = 1
    # model (transformers LlamaConfig, random init, byte vocabulary)
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    intermediate_size: int = 384
    dtype: str = "fp32"  # model weights: fp32 | bf16
    # optimizer
    optimizer: str = "forge-adamw"
    lr: float | None = None  # None: the optimizer's default in OPTIMIZERS
    weight_decay: float | None = None  # None: the optimizer's default (on matrices only)
    beta1: float | None = None
    beta2: float | None = None
    momentum: float | None = None  # SGD (default 0.9) and RMSprop (default 0)
    state_dtype: str | None = None  # fp32 | bf16 | int8; None: the weight's dtype
    accumulate_dtype: str = "fp32"  # the fused layers' gradient buffer across --grad-accum micro-steps
    stochastic_rounding: bool | None = None  # None: forge_optim's default (on for bf16)
    backend: str = "auto"  # auto | torch | triton
    compile: bool = False  # torch.compile(model) for the training steps (evaluation stays eager)
    # schedule
    steps: int = 300
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    # eval, logging, system
    eval_every: int = 50
    eval_iters: int = 4
    log_every: int = 1  # metrics.jsonl gets one line every log_every steps
    seed: int = 1337
    device: str | None = None  # None: cuda if available, else cpu
    out_dir: str | None = None  # None: runs/<timestamp>
    peak_tflops: float | None = None  # for MFU; None: looked up for known GPUs
    progress: bool = True
    extra: dict = field(default_factory=dict)  # resolved values, filled in by train()


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    g = p.add_argument_group("data")
    g.add_argument("--data", default=d.data, help="'arith' (built-in synthetic addition problems) "
                   "or a path to a .txt file or a .jsonl file with a 'text' field")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens (bytes) per sequence")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per micro-step")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-steps per optimizer step")
    g = p.add_argument_group("model (Llama-style, random init, byte vocabulary of 256)")
    g.add_argument("--hidden-size", type=int, default=d.hidden_size, help="model width")
    g.add_argument("--layers", type=int, default=d.layers, help="decoder layers")
    g.add_argument("--heads", type=int, default=d.heads, help="attention heads (no GQA)")
    g.add_argument("--intermediate-size", type=int, default=d.intermediate_size, help="MLP width")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default=d.dtype, help="model weights")
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=list(OPTIMIZERS), default=d.optimizer,
                   help="forge-*: forge_optim (linear weights updated inside backward); torch-adamw: the baseline")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default: per optimizer)")
    g.add_argument("--weight-decay", type=float, default=None,
                   help="on matrices only; norms and biases get none (default: per optimizer)")
    g.add_argument("--beta1", type=float, default=None, help="default: 0.9")
    g.add_argument("--beta2", type=float, default=None, help="default: 0.95 (Lion: 0.99)")
    g.add_argument("--momentum", type=float, default=None, help="SGD (default 0.9) and RMSprop (default 0)")
    g.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"], default=None,
                   help="optimizer state precision (default: the weight's dtype)")
    # --accumulate-dtype and --backend default to None (TrainConfig's value fills in): a value in the
    # namespace then means the user set it, which check_args needs for the forge-only flags
    g.add_argument("--accumulate-dtype", choices=["fp32", "bf16"], default=None,
                   help=f"gradient buffer of the fused layers across --grad-accum micro-steps (bf16: half the "
                   f"memory; default: {d.accumulate_dtype})")
    g.add_argument("--no-stochastic-rounding", dest="stochastic_rounding", action="store_const",
                   const=False, default=None, help="round-to-nearest for bf16 weights and states")
    g.add_argument("--backend", choices=["auto", "torch", "triton"], default=None,
                   help=f"forge_optim backend (default: {d.backend}: triton on CUDA, torch otherwise)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model for training steps (FORGE's fused linears are traced as custom ops; "
                   "evaluation stays eager)")
    g = p.add_argument_group("schedule")
    g.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up, then cosine")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine floor as a fraction of --lr")
    g = p.add_argument_group("eval, logging, system")
    g.add_argument("--eval-every", type=int, default=d.eval_every, help="0: only at the end")
    g.add_argument("--eval-iters", type=int, default=d.eval_iters, help="held-out batches per eval")
    g.add_argument("--log-every", type=int, default=d.log_every, help="steps between metrics.jsonl lines")
    g.add_argument("--seed", type=int, default=d.seed, help="model init, data and batches")
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    g.add_argument("--out-dir", default=None, help="run folder (default: runs/<timestamp>)")
    g.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: known GPUs)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    fields = TrainConfig.__dataclass_fields__
    names = set(fields) - {"extra"}
    # a flag left unset (None) where TrainConfig has a value takes that value
    return TrainConfig(**{k: v for k, v in vars(ns).items()
                          if k in names and not (v is None and fields[k].default is not None)})


# flags that only forge_optim optimizers read (namespace dest -> flag); each defaults to None in
# add_arguments, so a value means the user set it
FORGE_ONLY_FLAGS = {"state_dtype": "--state-dtype", "stochastic_rounding": "--no-stochastic-rounding",
                    "backend": "--backend", "accumulate_dtype": "--accumulate-dtype"}
DATA_SUFFIXES = (".txt", ".jsonl")  # what data.load_dataset reads besides "arith"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_device(spec: str) -> str | None:
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        return f"--device {spec!r} is not a device; use cpu or cuda (cuda:N for one GPU of several)"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            from .main import no_cuda_reason

            return (f"--device {spec}: CUDA is not available ({no_cuda_reason()}); omit --device (it picks cuda when "
                    "available, else cpu) or pass --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return (f"--device {spec}: there are only {torch.cuda.device_count()} CUDA device(s) "
                    f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            return f"--device {spec}: MPS is not available; omit --device or pass --device cpu"
    elif dev.type != "cpu":
        return f"--device {spec}: training runs on cpu or cuda (cuda:N); omit --device to pick one"
    return None


def _check_triton(cfg: TrainConfig) -> str | None:
    """--backend triton: the same test the optimizer makes (backends.triton_available), before any work."""
    from .._triton import HAS_TRITON, interpreting
    from ..backends import triton_available

    fix = "omit --backend (auto picks the torch backend without CUDA) or pass --backend torch"
    ok, why = triton_available()
    if not ok and not HAS_TRITON:
        return f"--backend triton needs Triton ({why}); or {fix}"
    if not ok:
        return (f"--backend triton needs a CUDA GPU, and none is visible; {fix}, or set TRITON_INTERPRET=1 "
                "to run the Triton kernels on the CPU interpreter (slow; for testing)")
    on_cpu = cfg.device is not None and torch.device(cfg.device).type != "cuda"
    if on_cpu and not interpreting():  # a GPU is there, but the model is put on the CPU
        return (f"--backend triton runs its kernels on CUDA tensors, not --device {cfg.device}; pass --backend "
                "torch (or auto), or drop --device, or set TRITON_INTERPRET=1 (CPU interpreter, for testing)")
    return None


def _heads_hint(hidden: int, heads: int) -> str:
    """The head counts nearest to ``heads`` that split ``hidden`` into even head dims."""
    ok = [k for k in range(1, hidden + 1) if hidden % k == 0 and (hidden // k) % 2 == 0]
    near = sorted(sorted(ok, key=lambda k: (abs(k - heads), k))[:2])
    return " or ".join(f"--heads {k}" for k in near) if near else "an even --hidden-size"


def check_config(cfg: TrainConfig) -> str | None:
    """The first problem with ``cfg`` as a command-line message (flag, value, fix), or None. Cheap: it
    builds no model and reads no data, so train() and the CLI run it before any work starts."""
    if cfg.optimizer not in OPTIMIZERS:
        return f"unknown optimizer {cfg.optimizer!r}; choose from {', '.join(OPTIMIZERS)}"
    for name in ("hidden_size", "layers", "heads", "intermediate_size", "seq_len", "batch_size", "grad_accum",
                 "steps", "eval_iters", "log_every"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v < 1:
            return f"{_flag(name)} must be a positive integer, got {v}"
    for name in ("warmup_steps", "eval_every"):  # 0 is meaningful: no warm-up; eval only at the end
        v = getattr(cfg, name)
        if not isinstance(v, int) or v < 0:
            return f"{_flag(name)} must be an integer >= 0, got {v}"
    if cfg.hidden_size % cfg.heads:
        return (f"--hidden-size {cfg.hidden_size} is not divisible by --heads {cfg.heads} (each head gets "
                f"hidden-size / heads dimensions); use {_heads_hint(cfg.hidden_size, cfg.heads)}, or change "
                "--hidden-size")
    if (cfg.hidden_size // cfg.heads) % 2:  # rotary embeddings rotate pairs of dimensions
        return (f"--hidden-size {cfg.hidden_size} / --heads {cfg.heads} = {cfg.hidden_size // cfg.heads} "
                f"dimensions per head, which must be even (rotary embeddings); use "
                f"{_heads_hint(cfg.hidden_size, cfg.heads)}, or change --hidden-size")
    if cfg.lr is not None and not (math.isfinite(cfg.lr) and cfg.lr > 0):
        return f"--lr must be a positive number, got {cfg.lr}"
    if cfg.weight_decay is not None and not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        return f"--weight-decay must be a number >= 0, got {cfg.weight_decay}"
    for name in ("beta1", "beta2", "momentum"):
        v = getattr(cfg, name)
        if v is not None and not 0 <= v < 1:  # also false for NaN
            return f"{_flag(name)} must be in [0, 1), got {v}"
    takes_betas = OPTIMIZERS[cfg.optimizer][3]
    given = [_flag(n) for n in ("beta1", "beta2") if getattr(cfg, n) is not None]
    if given and not takes_betas:
        return (f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to {cfg.optimizer} (it has "
                f"no betas); drop {'it' if len(given) == 1 else 'them'}")
    if cfg.momentum is not None and cfg.optimizer not in ("forge-sgd", "forge-rmsprop"):
        return f"--momentum applies to forge-sgd and forge-rmsprop only, not {cfg.optimizer}; drop --momentum"
    if not 0 <= cfg.min_lr_ratio <= 1:
        return f"--min-lr-ratio is the cosine floor as a fraction of --lr and must be in [0, 1], got {cfg.min_lr_ratio}"
    if cfg.peak_tflops is not None and not (math.isfinite(cfg.peak_tflops) and cfg.peak_tflops > 0):
        return f"--peak-tflops must be a positive number, got {cfg.peak_tflops}"
    if not 0 <= cfg.seed < 2**62:  # torch generators take 64 bits; eval and samples use seed + offsets
        return f"--seed must be an integer in [0, 2**62), got {cfg.seed}"
    if cfg.data != "arith":
        if not cfg.data.endswith(DATA_SUFFIXES):
            return (f"--data {cfg.data!r}: not a data set this command reads; pass 'arith' (built-in addition "
                    "problems), a .txt file, or a .jsonl file with a 'text' field")
        if not os.path.isfile(cfg.data):
            return f"data file not found: {cfg.data} (--data takes 'arith' or a path to a .txt / .jsonl file)"
    if cfg.device is not None:
        msg = _check_device(cfg.device)
        if msg:
            return msg
    if cfg.backend == "triton" and cfg.optimizer.startswith("forge-"):
        msg = _check_triton(cfg)
        if msg:
            return msg
    if cfg.out_dir is not None and os.path.exists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
        return f"--out-dir {cfg.out_dir} is a file, not a folder; pass a folder path (created if missing)"
    return None


def check_args(ns: argparse.Namespace) -> str | None:
    """check_config for parsed flags, plus what only the namespace tells: which flags the user set."""
    if not ns.optimizer.startswith("forge-"):
        given = [flag for dest, flag in FORGE_ONLY_FLAGS.items() if getattr(ns, dest, None) is not None]
        if given:
            return (f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to the forge-* optimizers only, "
                    f"not {ns.optimizer}; drop {' and '.join(given)} or pick a forge optimizer (e.g. --optimizer "
                    "forge-adamw)")
    return check_config(config_from_args(ns))


# ---------------------------------------------------------------------------------------------
# helpers

def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Multiplier of the peak LR at scheduler step s: linear warm-up, then cosine to min_ratio."""
    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return f


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings); none on norms and biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, lr: float, wd: float, device: torch.device):
    cls_name, _, _, takes_betas, default_betas = OPTIMIZERS[cfg.optimizer]
    groups = param_groups(model, wd)
    kw: dict = {"lr": lr}
    if takes_betas:
        kw["betas"] = (cfg.beta1 if cfg.beta1 is not None else default_betas[0],
                       cfg.beta2 if cfg.beta2 is not None else default_betas[1])
    if cls_name is None:  # the torch baseline
        return torch.optim.AdamW(groups, fused=True if device.type == "cuda" else None, **kw)
    if cls_name == "SGD":
        kw["momentum"] = 0.9 if cfg.momentum is None else cfg.momentum
    elif cls_name == "RMSprop" and cfg.momentum is not None:
        kw["momentum"] = cfg.momentum
    import forge_optim
    cls = getattr(forge_optim, cls_name)
    return cls(model, params=groups, state_dtype=cfg.state_dtype, stochastic_rounding=cfg.stochastic_rounding,
               backend=cfg.backend, accumulate_dtype=cfg.accumulate_dtype, **kw)


def compress_names(names: list[str]) -> list[str]:
    """'model.layers.0.mlp.up_proj', 'model.layers.1.mlp.up_proj' -> 'model.layers.*.mlp.up_proj x2'."""
    counts = Counter(re.sub(r"\.\d+\.", ".*.", n) for n in names)
    return [f"{k} x{v}" if v > 1 else k for k, v in counts.items()]


def peak_memory(device: torch.device) -> tuple[float, str]:
    """(MiB, label): CUDA max allocated, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "peak CUDA memory allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "peak process RSS (CPU)"


def default_peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (bf16, fp32) in PEAK_TFLOPS.items():
        if key in name:
            return bf16 if dtype == torch.bfloat16 else fp32
    return None


@torch.no_grad()
def evaluate(model, batches, is_arith: bool) -> dict:
    model.eval()
    losses, correct, total = [], 0, 0
    for x, y in batches:
        logits = model(input_ids=x).logits.float()
        losses.append(F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).item())
        if is_arith:
            m = fdata.answer_mask(x, y)
            correct += ((logits.argmax(-1) == y) & m).sum().item()
            total += m.sum().item()
    model.train()
    out = {"val_loss": sum(losses) / len(losses)}
    if is_arith and total:
        out["val_answer_acc"] = correct / total
    return out


@torch.no_grad()
def solve(model, prompts: list[str], device, max_new: int = 6) -> list[str]:
    """Greedy completion of each prompt up to a newline (no KV cache: the model is tiny)."""
    model.eval()
    outs = []
    for prompt in prompts:
        ids = fdata.bytes_to_tensor(prompt.encode()).long()[None].to(device)
        new = []
        for _ in range(max_new):
            nxt = model(input_ids=ids).logits[0, -1].argmax().item()
            if nxt == fdata.NL:
                break
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
        outs.append(fdata.decode(new))
    model.train()
    return outs


def save_plot(path: str, records: list[dict], evals: list[dict], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 1))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], lw=0.8, alpha=0.8, label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="held-out loss")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    ax_lr.plot(steps, [r["lr"] for r in records], color="gray")
    ax_lr.set_ylabel("lr")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------

def train(cfg: TrainConfig, t_start: float | None = None) -> dict:
    """Train, write the run folder, return a summary. ``t_start``: when the command started
    (before torch was imported), for the wall time in the report."""
    t_start = t_start or time.time()
    from tqdm.auto import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    msg = check_config(cfg)  # the CLI ran it already (check_args); here for callers of train(cfg)
    if msg:
        raise ValueError(msg)
    is_forge = cfg.optimizer.startswith("forge-")
    if not is_forge and (cfg.state_dtype or cfg.stochastic_rounding is not None or cfg.backend != "auto"):
        print(f"note: --state-dtype/--no-stochastic-rounding/--backend do not apply to {cfg.optimizer}; ignored")
    _, default_lr, default_wd, _, _ = OPTIMIZERS[cfg.optimizer]
    lr = default_lr if cfg.lr is None else cfg.lr
    wd = default_wd if cfg.weight_decay is None else cfg.weight_decay
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
    out_dir = cfg.out_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # ---- data: a flat stream of byte tokens, random windows of seq_len + 1
    ds = fdata.load_dataset(cfg.data, cfg.seq_len, seed=cfg.seed)
    is_arith = cfg.data == "arith"
    gen = torch.Generator().manual_seed(cfg.seed)
    eval_gen = torch.Generator().manual_seed(cfg.seed + 1)
    eval_batches = [fdata.get_batch(ds.val, cfg.batch_size, cfg.seq_len, eval_gen, device)
                    for _ in range(cfg.eval_iters)]  # the same held-out batches at every eval

    # ---- model: Llama-style, random init
    mcfg = LlamaConfig(vocab_size=fdata.VOCAB_SIZE, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.layers,
                       num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
                       max_position_embeddings=max(cfg.seq_len, 64), use_cache=False,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    mcfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(mcfg).to(device=device, dtype=dtype)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.get_input_embeddings().weight.numel()
    # FLOPs per token, forward + backward (nanoGPT / PaLM appendix B): 6 N + 12 L d T
    flops_per_token = 6 * (n_params - n_embed) + 12 * cfg.layers * cfg.hidden_size * cfg.seq_len
    peak_tflops = cfg.peak_tflops or default_peak_tflops(device, dtype)

    # ---- optimizer and LR schedule (through param_groups, which fused layers read at backward time)
    opt = build_optimizer(cfg, model, lr, wd, device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
    fused = sorted(opt.fused_modules()) if is_forge else []
    # compiled after the optimizer patched the model (README, torch.compile); evaluation and sampling run
    # the eager module under no_grad, so no compiled forward is left without its backward
    step_model = torch.compile(model) if cfg.compile else model

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    cfg.extra.update(device=str(device), lr=lr, weight_decay=wd, out_dir=out_dir, params=n_params,
                     flops_per_token=flops_per_token, tokens_per_step=tokens_per_step,
                     peak_tflops=peak_tflops, fused_modules=fused, data=ds.describe(),
                     versions={"python": platform.python_version(), "torch": torch.__version__,
                               "transformers": __import__("transformers").__version__},
                     device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine())
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=2)

    print(f"forge-optim train: {cfg.optimizer} on {device} ({cfg.extra['device_name']}), run folder {out_dir}")
    print(f"data   {ds.describe()}")
    print(f"model  Llama {cfg.layers}L d{cfg.hidden_size} h{cfg.heads} ff{cfg.intermediate_size}, "
          f"{n_params / 1e6:.2f}M params, {cfg.dtype} weights; {flops_per_token / 1e6:.1f} MFLOP/token")
    opt_desc = f"lr {lr:g} wd {wd:g}"
    if "betas" in opt.defaults:
        opt_desc += f" betas {tuple(opt.defaults['betas'])}"
    if opt.defaults.get("momentum"):
        opt_desc += f" momentum {opt.defaults['momentum']:g}"
    if is_forge:
        opt_desc += f", state_dtype {cfg.state_dtype or 'weight dtype'}, backend {cfg.backend}"
        if cfg.stochastic_rounding is False:
            opt_desc += ", round-to-nearest"
    print(f"optim  {cfg.optimizer}: {opt_desc}; warm-up {cfg.warmup_steps} + cosine to {cfg.min_lr_ratio:g}x")
    if cfg.compile:
        print("compile torch.compile(model) for the training steps (the first step compiles)")
    print(f"batch  {cfg.batch_size} x {cfg.seq_len} tokens x {cfg.grad_accum} micro-steps = "
          f"{tokens_per_step:,} tokens/step, {cfg.steps} steps")
    if is_forge:
        shown = compress_names(fused)
        print(f"fused  {len(fused)} modules updated inside backward: {', '.join(shown) if shown else '(none)'}")
    else:
        print("fused  0 modules (torch baseline: separate optimizer step)")

    # ---- training loop
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    metrics_f = open(metrics_path, "w")
    records: list[dict] = []
    evals: list[dict] = []
    step_times: list[float] = []
    t0 = time.time()
    bar = tqdm(range(1, cfg.steps + 1), desc="train", dynamic_ncols=True, disable=not cfg.progress,
               mininterval=0.5, file=sys.stderr)

    def do_eval(step: int, rec: dict | None = None) -> dict:
        r = {"step": step, **evaluate(model, eval_batches, is_arith)}
        evals.append(r)
        msg = f"step {step:5d}"
        if rec is not None:
            recent = step_times[-cfg.eval_every:] if cfg.eval_every else step_times
            tps = tokens_per_step * len(recent) / sum(recent)
            msg += f" | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | {tps:,.0f} tok/s"
            if peak_tflops:
                msg += f" | MFU {tps * flops_per_token / (peak_tflops * 1e12):.2%}"
        msg += f" | held-out loss {r['val_loss']:.4f}"
        if "val_answer_acc" in r:
            msg += f", answer-token acc {r['val_answer_acc']:.1%}"
        bar.write(msg) if cfg.progress else print(msg)
        return r

    do_eval(0)
    try:
        for step in bar:
            ts = time.time()
            cur_lr = opt.param_groups[0]["lr"]
            loss_sum = 0.0
            for micro in range(cfg.grad_accum):
                x, y = fdata.get_batch(ds.train, cfg.batch_size, cfg.seq_len, gen, device)
                logits = step_model(input_ids=x).logits
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)) / cfg.grad_accum
                if is_forge and micro < cfg.grad_accum - 1:
                    with opt.accumulate():  # fused layers add into an fp32 buffer, no update yet
                        loss.backward()
                else:
                    loss.backward()  # fused layers update here, tile by tile
                loss_sum += loss.item()
            opt.step()  # the rest: embeddings, norms, unfused weights
            opt.zero_grad(set_to_none=True)
            sched.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.time() - ts
            step_times.append(dt)
            tps = tokens_per_step / dt
            rec = {"step": step, "loss": loss_sum, "lr": cur_lr, "tokens_per_s": tps,
                   "elapsed": time.time() - t0}
            if peak_tflops:
                rec["mfu"] = tps * flops_per_token / (peak_tflops * 1e12)
            if not math.isfinite(loss_sum):
                bar.write(f"step {step}: loss is {loss_sum}; stopping")
                records.append(rec)
                metrics_f.write(json.dumps(rec) + "\n")
                break
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                rec.update({k: v for k, v in do_eval(step, rec).items() if k != "step"})
            if step % cfg.log_every == 0 or "val_loss" in rec or step == cfg.steps:
                records.append(rec)
                metrics_f.write(json.dumps(rec) + "\n")
                metrics_f.flush()
            bar.set_postfix(loss=f"{loss_sum:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
    finally:
        bar.close()
        metrics_f.close()
    train_time = time.time() - t0

    # ---- report
    warm = step_times[min(3, len(step_times) - 1):] if step_times else []
    mean_tps = tokens_per_step * len(warm) / sum(warm) if warm else float("nan")
    mem_mib, mem_label = peak_memory(device)
    last = records[-min(10, len(records)):]
    summary = {
        "optimizer": cfg.optimizer, "steps": len(step_times), "first_loss": records[0]["loss"],
        "final_loss": sum(r["loss"] for r in last) / len(last), "first_val_loss": evals[0]["val_loss"],
        "final_val_loss": evals[-1]["val_loss"], "tokens_per_s": mean_tps,
        "model_tflops_per_s": mean_tps * flops_per_token / 1e12,
        "mfu": mean_tps * flops_per_token / (peak_tflops * 1e12) if peak_tflops else None,
        "peak_memory_mib": mem_mib, "peak_memory_kind": mem_label, "train_seconds": train_time,
        "wall_seconds": time.time() - t_start, "fused_modules": len(fused),
    }
    if is_arith:
        summary["final_val_answer_acc"] = evals[-1].get("val_answer_acc")
        rng = __import__("random").Random(cfg.seed + 7)
        probs = [(rng.randrange(1000), rng.randrange(1000)) for _ in range(4)]
        got = solve(model, [f"\n{a}+{b}=" for a, b in probs], device)
        summary["samples"] = [f"{a}+{b}={g}" + (" (ok)" if g == str(a + b) else f" (want {a + b})")
                              for (a, b), g in zip(probs, got)]
    if is_forge and hasattr(opt, "nonfinite_counts"):
        bad = {k: v for k, v in opt.nonfinite_counts().items() if v}
        summary["nonfinite_skipped"] = bad
    save_plot(os.path.join(out_dir, "loss.png"), records, evals,
              f"{cfg.optimizer} | Llama {cfg.layers}L d{cfg.hidden_size} | {ds.name} | {device}")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)

    mfu = f", MFU {summary['mfu']:.2%}" if summary["mfu"] is not None else " (MFU: no peak known for this device; --peak-tflops)"
    print(f"loss   {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} (train, mean of last {len(last)} steps); "
          f"held-out {summary['first_val_loss']:.4f} -> {summary['final_val_loss']:.4f}")
    if is_arith:
        print(f"answer-token accuracy (held-out, teacher-forced) {summary['final_val_answer_acc']:.1%}; "
              f"greedy: {'; '.join(summary['samples'])}")
    print(f"speed  {mean_tps:,.0f} tokens/s, {summary['model_tflops_per_s'] * 1e3:.2f} model GFLOP/s{mfu}; "
          f"{len(step_times)} steps in {train_time:.1f} s ({summary['wall_seconds']:.1f} s wall incl. model setup, data and eval)")
    print(f"memory {mem_label}: {mem_mib:,.1f} MiB")
    print(f"fused  {len(fused)} modules" + (f"; non-finite gradient coordinates skipped: {summary['nonfinite_skipped']}"
                                           if summary.get("nonfinite_skipped") else ""))
    print(f"wrote  {metrics_path}, {os.path.join(out_dir, 'loss.png')}, config.json, summary.json")
    return summary


def run(argv: list[str] | None = None, prog: str = "forge-optim train") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    ns = p.parse_args(argv)
    msg = check_args(ns)
    if msg:
        p.error(msg)  # usage + message, exit status 2, before any work
    return run_parsed(ns)


def run_parsed(ns: argparse.Namespace) -> int:
    cfg = config_from_args(ns)
    try:
        summary = train(cfg, getattr(ns, "t_start", None))
    except (ValueError, FileNotFoundError) as e:
        print(f"forge-optim train: error: {e}", file=sys.stderr)
        return 2
    return 0 if math.isfinite(summary["final_loss"]) else 1


if __name__ == "__main__":
    sys.exit(run())
