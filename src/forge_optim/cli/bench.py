"""``forge-optim bench``: end-to-end training-step benchmark, FORGE against its peers (issue 5).

    forge-optim bench --model Llama-3.1-8B --batch-size 1 --seq-len 512
    python3 -m forge_optim.cli.bench --methods none,forge-bf16,torch-fused-adamw --compile

Protocol
- Each method runs in its own Python process, so ``torch.cuda.max_memory_allocated`` is that
  method's peak and no allocator or compile cache state leaks from one method to the next.
- The model is built from its config with random weights, directly on the device, in bf16
  (BF16-everywhere: weights, optimizer states and gradients are bf16 for the baselines).
- A fresh random token batch every step (drawn before the step's clock starts); ``--warmup``
  un-timed steps, then ``--steps`` timed forward+backward+step iterations, each timed on the wall
  clock between two ``torch.cuda.synchronize()`` calls. Reported: median and IQR of ms/step. Then
  ``--steps`` more steps back to back with one clock and no synchronize between them (``b2b ms``,
  the mean): the step time of a loop that does not read the loss every step, where the host's
  dispatch of one step overlaps the GPU's work on the previous one.
- GPU time per step: the sum of GPU activity (kernels, memcpy, memset) recorded by torch.profiler
  over ``--profile-steps`` further steps, divided by their number. It does not depend on how fast the
  host dispatches, which bounds the wall step of small models.
- Peak memory: ``torch.cuda.max_memory_allocated`` over the whole process (build, warm-up, steps):
  what must fit. ``peak_steady_gib`` is the same peak over the timed steps only.
- tokens/s = batch*seq / median step time; model TFLOP/s = (6 * N_matmul * tokens
  + 12 * layers * heads * head_dim * seq * tokens) / median step time (the PaLM convention: N_matmul
  counts every GEMM weight, the lm_head included, not an untied input embedding; activation
  recompute is not counted).
- A CUDA out-of-memory error is reported as ``OOM``; a peer that is not installed as
  ``skipped (not installed)``.
- For the methods in ``--timeline-methods`` (eager only), one more instrumented step samples
  ``torch.cuda.memory_allocated`` after every decoder layer's forward, at the start of every decoder
  layer's backward (a hook on its output), and around the optimizer step: the within-step memory
  timeline (paper Figure 2).

Output in ``--out-dir``: ``results.json`` (rewritten after every method, so a failure later loses
nothing), ``bars.png`` (ms/step and peak GiB per method), ``memory_timeline.png``, and the table on
the terminal. Without CUDA the same protocol runs on the CPU with a tiny model: times only, memory
figures need CUDA.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata as _md
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

METHODS = ["none", "forge-bf16", "forge-int8", "forge-fp32", "torch-fused-adamw", "torch-foreach-adamw",
           "optimi-release", "flashoptim", "flashoptim-release", "bnb-adamw8bit", "torchao-adamw8bit"]

# peer method -> (import name checked before the process is started, pip distribution name)
PEERS = {
    "optimi-release": ("optimi", "torch-optimi"),
    "flashoptim": ("flashoptim", "flashoptim"),
    "flashoptim-release": ("flashoptim", "flashoptim"),
    "bnb-adamw8bit": ("bitsandbytes", "bitsandbytes"),
    "torchao-adamw8bit": ("torchao", "torchao"),
}
LABELS = {
    "none": "no optimizer (fwd+bwd)",
    "forge-bf16": "FORGE AdamW, bf16 state",
    "forge-int8": "FORGE AdamW, int8 state",
    "forge-fp32": "FORGE AdamW, fp32 state",
    "torch-fused-adamw": "torch AdamW fused=True",
    "torch-foreach-adamw": "torch AdamW foreach",
    "optimi-release": "optimi AdamW + grad release",
    "flashoptim": "FlashOptim FlashAdamW",
    "flashoptim-release": "FlashOptim + grad release",
    "bnb-adamw8bit": "bitsandbytes AdamW8bit",
    "torchao-adamw8bit": "torchao AdamW8bit",
}
REFERENCE_ORDER = ("torch-fused-adamw", "torch-foreach-adamw")
LOSSES = ("hf", "liger")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
GIB = 2.0 ** 30


# ----------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench_models import model_names

    p.add_argument("--model", default="auto",
                   help=f"one of {', '.join(model_names())}; 'auto' (default): Llama-3.1-8B on CUDA, "
                   "'tiny' on CPU")
    p.add_argument("--config", default=None, help="a Hugging Face config.json to build instead of --model")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (a shallower model)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--methods", default="default",
                   help="comma-separated list from: " + ", ".join(METHODS) + "; 'all', or 'default' "
                   "(all but forge-fp32)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="un-timed warm-up steps (default 5)")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="steps recorded by torch.profiler for GPU time per step (0: off)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="Hugging Face gradient checkpointing (non-reentrant)")
    p.add_argument("--compile", action="store_true", help="torch.compile(model) for every method")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="torch.compile's mode with --compile: 'reduce-overhead' replays CUDA graphs (FORGE's "
                   "ops stay outside them: they run host code every step)")
    p.add_argument("--loss", choices=LOSSES, default="hf",
                   help="the causal-LM loss, the same for every method: 'hf' (default), the model's own (fp32 "
                   "logits, torch cross-entropy); 'liger', Liger-Kernel's cross-entropy on the bf16 logits, "
                   "its gradient written in place (no fp32 logit copies: ~0.8 GiB less at the end of forward "
                   "for Llama-3.1-8B BS=1 SEQ=512; needs CUDA and `pip install liger-kernel`)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="'auto' (cuda if available), 'cuda' or 'cpu'")
    p.add_argument("--timeline-methods", default="forge-bf16,torch-fused-adamw",
                   help="methods whose within-step memory timeline is recorded (eager, CUDA only); '' for none")
    p.add_argument("--out-dir", default=None, help="output folder (default benchmarks/runs/<time>)")
    p.add_argument("--method-timeout", type=float, default=900.0, help="seconds before a method's process is killed")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole run: methods not started in time are reported as skipped")
    p.add_argument("--repeat-reference", action="store_true",
                   help="run the reference method (torch fused AdamW, else foreach) once more after all the "
                        "others and report the drift between its two runs (process order, GPU clocks); the "
                        "ratios *_vs_ref_mean divide by the mean of the two")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--plot-only", default=None, metavar="RESULTS_JSON",
                   help="redraw bars.png and memory_timeline.png from a results.json (into --out-dir or its folder)")
    # internal: run one method in this process
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--timeline", action="store_true", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="forge-optim bench",
                                description="Training-step time and peak memory of FORGE against its "
                                "peers on a Hugging Face causal LM with random weights (issue 5).")
    add_arguments(p)
    return p


def parse_methods(spec: str) -> list[str]:
    if spec in ("all",):
        return list(METHODS)
    if spec in ("default", ""):
        return [m for m in METHODS if m != "forge-fp32"]
    out = []
    for m in (s.strip() for s in spec.split(",")):
        if not m:
            continue
        if m == "forge":
            m = "forge-bf16"
        if m not in METHODS:
            raise SystemExit(f"forge-optim bench: unknown method {m!r}; choose from {', '.join(METHODS)}")
        if m not in out:
            out.append(m)
    return out


def check_loss(loss: str, device: str) -> None:
    """--loss liger needs Liger-Kernel and a GPU (or Triton's interpreter): say so before any method runs."""
    if loss != "liger":
        return
    try:
        found = importlib.util.find_spec("liger_kernel") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise SystemExit("forge-optim bench: --loss liger needs Liger-Kernel: pip install liger-kernel "
                         "(or forge-optim[peers]); or use --loss hf")
    from .._triton import interpreting

    if device != "cuda" and not interpreting():
        raise SystemExit("forge-optim bench: --loss liger runs Triton kernels and needs --device cuda "
                         "(or TRITON_INTERPRET=1 on the CPU); or use --loss hf")


def liger_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                         shift_labels=None, **kwargs):
    """Hugging Face's ForCausalLMLoss (shift, flatten, mean over non-ignored tokens) computed by
    Liger-Kernel's cross-entropy on the logits as they are (bf16): no fp32 copy, and the gradient is
    written into the logits in place, so the loss adds no logit-sized tensor of its own."""
    import torch.nn.functional as F
    from liger_kernel.transformers.functional import liger_cross_entropy

    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    flat = logits.reshape(-1, vocab_size)
    if num_items_in_batch is None:
        return liger_cross_entropy(flat, target, ignore_index=ignore_index, reduction="mean")
    total = liger_cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum")
    return total / num_items_in_batch.to(total.device) if hasattr(num_items_in_batch, "to") \
        else total / num_items_in_batch


def kernel_configs(opt) -> dict:
    """Which fused-kernel config ran for each tuning key of ``opt``'s Triton backends, and where it came
    from: ``table`` (tuned on the whole weight, kernels/tuned/), ``sub-problem`` (timed at run time on
    clones of <= 4096 rows), ``only candidate``. Empty where the torch backend ran (CPU)."""
    from ..kernels.launch import TABLE_NOTE

    out = {}
    for be in getattr(opt, "_backends", {}).values():
        tuner = getattr(be, "tuner", None)
        if tuner is None:
            continue
        for key, cfg in tuner.cache.items():
            notes = tuner.timings.get(key, [])
            if any(TABLE_NOTE in str(n[2]) for n in notes):
                source = "table"
            elif any(isinstance(n[1], float) for n in notes):
                source = "sub-problem"
            else:
                source = "only candidate"
            out[repr(key)] = {"config": cfg.short(), "source": source}
    return out


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(spec: str) -> str:
    if spec == "auto":
        return "cuda" if _cuda_available() else "cpu"
    return spec


def _model_error(ns: argparse.Namespace) -> str | None:
    """--model / --config: a known name, or a Hugging Face config.json that config_dict can read."""
    from ..bench_models import config_dict, model_names

    if ns.config:
        if not os.path.isfile(ns.config):
            return f"--config {ns.config}: file not found (pass a Hugging Face config.json)"
        try:
            config_dict(None, ns.config)
        except (ValueError, OSError) as err:  # not JSON, or no model_type
            return f"--config {ns.config}: {err}"
        return None
    if ns.model != "auto" and ns.model not in model_names():
        hint = (f"; for a config file use --config {ns.model}" if ns.model.endswith(".json")
                or os.path.isfile(ns.model) else " (or pass --config path/to/config.json)")
        return f"unknown --model {ns.model!r}; choose from auto, {', '.join(model_names())}{hint}"
    return None


def check_args(ns: argparse.Namespace) -> str | None:
    """The first problem with the driver's flags as a command-line message, or None. Cheap (no model
    is built, no method process started): main runs it before any work."""
    for name, low in (("batch_size", 1), ("seq_len", 1), ("steps", 1), ("warmup", 0), ("profile_steps", 0)):
        v = getattr(ns, name)
        if v < low:
            return f"--{name.replace('_', '-')} must be an integer >= {low}, got {v}"
    if ns.layers is not None and ns.layers < 1:
        return f"--layers must be a positive integer (or omitted for the model's own depth), got {ns.layers}"
    if not (ns.lr > 0 and ns.lr != float("inf")):  # also false for NaN
        return f"--lr must be a positive number, got {ns.lr}"
    if not (ns.weight_decay >= 0 and ns.weight_decay != float("inf")):
        return f"--weight-decay must be a number >= 0, got {ns.weight_decay}"
    if not ns.method_timeout > 0:
        return f"--method-timeout must be a positive number of seconds, got {ns.method_timeout}"
    if ns.time_budget is not None and not ns.time_budget > 0:
        return f"--time-budget must be a positive number of seconds, got {ns.time_budget}"
    if ns.plot_only:
        return None if os.path.isfile(ns.plot_only) else f"--plot-only {ns.plot_only}: file not found (a results.json)"
    msg = _model_error(ns)
    if msg:
        return msg
    for flag, spec in (("--methods", ns.methods), ("--timeline-methods", ns.timeline_methods)):
        try:
            parse_methods(spec) if spec else None
        except SystemExit as err:  # parse_methods' message, for the usage error
            return f"{flag}: {str(err).removeprefix('forge-optim bench: ')}"
    if ns.device == "cuda" and not _cuda_available():
        from .main import no_cuda_reason

        return (f"--device cuda: CUDA is not available ({no_cuda_reason()}); omit --device (auto: cpu here, with the tiny "
                "model) or pass --device cpu")
    try:
        check_loss(ns.loss, resolve_device(ns.device))
    except SystemExit as err:
        return str(err).removeprefix("forge-optim bench: ")
    return None


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    if ns.worker:  # started by the driver with flags it checked
        return worker_main(ns)
    msg = check_args(ns)
    if msg:
        p.error(msg)  # usage + "error: ...", exit status 2, before any method process starts
    if ns.plot_only:
        res = json.loads(Path(ns.plot_only).read_text())
        out = Path(ns.out_dir) if ns.out_dir else Path(ns.plot_only).parent
        out.mkdir(parents=True, exist_ok=True)
        print(format_table(res))
        plot_bars(res, out / "bars.png")
        if any(r.get("timeline") for r in res["methods"].values()):
            plot_timeline(res, out / "memory_timeline.png")
        return 0
    return run_parsed(ns, argv)


# ------------------------------------------------------------------------------------------- driver
def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[3]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def source_digest() -> str:
    """sha256 (12 hex digits) of the package's .py sources: which code ran, even where the checkout's
    git metadata is stale or absent (a copied tree on a lent machine). ``git ls-tree``-independent:
    compare with this function's value on a checkout."""
    import hashlib

    pkg = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def host_cpu_sample() -> dict:
    """CPU time of this process's threads (Linux /proc; empty elsewhere), of the whole machine, and the
    wall clock: ``host_cpu_delta`` turns two samples into where the host's time went during the timed
    steps (a busy second thread, or other processes, slow the step's dispatch: NOTES.md, int8)."""
    out = {"wall": time.perf_counter(), "threads": {}, "machine": None}
    task = Path("/proc/self/task")
    if not task.is_dir():
        return out
    for t in task.iterdir():
        try:
            stat = (t / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            out["threads"][t.name] = ((t / "comm").read_text().strip(), int(fields[11]) + int(fields[12]))
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    try:
        cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        vals = [int(v) for v in cpu]
        out["machine"] = (sum(vals), vals[3] + (vals[4] if len(vals) > 4 else 0))  # (total, idle + iowait)
    except (OSError, ValueError, IndexError):
        pass
    return out


def host_cpu_delta(a: dict, b: dict) -> dict:
    """Seconds of CPU per thread between two samples (the 6 busiest), and the machine's busy share."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    wall = b["wall"] - a["wall"]
    busy = []
    for tid, (name, ticks) in b["threads"].items():
        d = ticks - a["threads"].get(tid, (name, 0))[1]
        if d > 0:
            busy.append({"thread": f"{name}:{tid}", "cpu_s": round(d / hz, 3)})
    busy.sort(key=lambda x: -x["cpu_s"])
    out = {"wall_s": round(wall, 3), "process_cpu_s": round(sum(x["cpu_s"] for x in busy), 3),
           "threads": busy[:6], "cpus": os.cpu_count()}
    if a["machine"] and b["machine"]:
        tot, idle = b["machine"][0] - a["machine"][0], b["machine"][1] - a["machine"][1]
        out["machine_busy_share"] = round(1 - idle / tot, 3) if tot > 0 else None
    return out


def _peer_installed(method: str) -> bool:
    mod = PEERS[method][0]
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def _worker_argv(ns, method: str, result_file: Path, timeline: bool) -> list[str]:
    a = [sys.executable, "-m", "forge_optim.cli.bench", "--worker", method, "--result-file", str(result_file),
         "--batch-size", str(ns.batch_size), "--seq-len", str(ns.seq_len), "--steps", str(ns.steps),
         "--warmup", str(ns.warmup), "--profile-steps", str(ns.profile_steps), "--lr", str(ns.lr),
         "--weight-decay", str(ns.weight_decay), "--device", ns.device]
    if ns.config:
        a += ["--config", str(ns.config)]
    else:
        a += ["--model", ns.model]
    if ns.layers is not None:
        a += ["--layers", str(ns.layers)]
    if ns.activation_checkpointing:
        a.append("--activation-checkpointing")
    if ns.compile:
        a += ["--compile", "--compile-mode", ns.compile_mode]
    if ns.loss != "hf":
        a += ["--loss", ns.loss]
    if timeline:
        a.append("--timeline")
    return a


def _child_env() -> dict:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the folder that holds forge_optim/
    parts = [src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != src]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_parsed(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    from ..bench_models import config_dict, count_params

    t_start = time.time()
    ns.device = resolve_device(ns.device)
    if ns.model == "auto":
        ns.model = "Llama-3.1-8B" if ns.device == "cuda" else "tiny"
    methods = parse_methods(ns.methods)
    check_loss(ns.loss, ns.device)
    cfg = config_dict(None if ns.config else ns.model, ns.config, ns.layers)
    counts = count_params(cfg)
    model_name = Path(ns.config).stem if ns.config else ns.model
    if ns.layers is not None:
        model_name += f" ({ns.layers} layers)"
    stamp = _dt.datetime.now(_dt.timezone.utc)
    out = Path(ns.out_dir) if ns.out_dir else Path("benchmarks/runs") / stamp.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    timeline_for = set(parse_methods(ns.timeline_methods)) if ns.timeline_methods else set()
    if ns.compile or ns.device != "cuda":
        timeline_for = set()  # memory needs CUDA; hooks inside a compiled graph would change what is measured

    cmd_argv = sys.argv[1:] if argv is None else list(argv)
    results = {
        "schema": 1,
        "date": stamp.isoformat(timespec="seconds"),
        "command": "forge-optim bench " + " ".join(shlex.quote(a) for a in cmd_argv),
        "host": platform.node(),
        "python": platform.python_version(),
        "versions": {k: _version(d) for k, d in (("torch", "torch"), ("triton", "triton"),
                                                  ("transformers", "transformers"), ("forge_optim", "forge-optim"),
                                                  ("torch-optimi", "torch-optimi"), ("flashoptim", "flashoptim"),
                                                  ("bitsandbytes", "bitsandbytes"), ("torchao", "torchao"))},
        "git_commit": _git_commit(),
        "source_digest": source_digest(),
        "device": None,  # filled from the first worker (the driver never initializes CUDA)
        "device_type": ns.device,
        "model": model_name,
        "config": cfg,
        "params": counts,
        "batch_size": ns.batch_size,
        "seq_len": ns.seq_len,
        "tokens_per_step": ns.batch_size * ns.seq_len,
        "steps": ns.steps,
        "warmup": ns.warmup,
        "profile_steps": ns.profile_steps,
        "compile": bool(ns.compile),
        "compile_mode": ns.compile_mode if ns.compile else None,
        "activation_checkpointing": bool(ns.activation_checkpointing),
        "loss": ns.loss,
        "dtype": "bfloat16",
        "methods": {},
        "notes": [],
    }
    if ns.device != "cuda":
        results["notes"].append("no CUDA: times only (CPU wall clock); peak memory and GPU time need CUDA")
    if ns.compile:
        results["notes"].append(f"torch.compile(model, mode={ns.compile_mode!r}) for every method; no memory "
                                "timeline under compile")
    if ns.loss == "liger":
        results["notes"].append("loss: Liger-Kernel cross-entropy on the bf16 logits, gradient in place "
                                "(every method)")
    res_path = out / "results.json"

    def save():
        res_path.write_text(json.dumps(results, indent=1, default=str) + "\n")

    print(f"forge-optim bench: {model_name} ({counts['total'] / 1e9:.3f}B params"
          f"{', tied embeddings' if counts['tied'] else ''}), BS={ns.batch_size} SEQ={ns.seq_len}, "
          f"{ns.warmup}+{ns.steps} steps, device {ns.device}{f', compiled ({ns.compile_mode})' if ns.compile else ''}"
          f"{', activation checkpointing' if ns.activation_checkpointing else ''} -> {out}", flush=True)
    save()
    if ns.device == "cuda" and any(m.startswith("forge-") for m in methods):
        t0 = time.time()
        failed = precompile_forge_kernels([m for m in methods if m.startswith("forge-")],
                                          ns.batch_size * ns.seq_len)
        results["precompile_s"] = round(time.time() - t0, 1)
        results["notes"] += [f"precompile: {line}" for line in failed]
        print(f"precompiled the forge kernel variants in {results['precompile_s']} s"
              f"{f' ({len(failed)} failed)' if failed else ''}", flush=True)
    for m in methods:
        r: dict
        if m in PEERS and not _peer_installed(m):
            r = {"status": "skipped (not installed)", "package": PEERS[m][1]}
        elif m in PEERS and ns.device != "cuda":
            r = {"status": "skipped (needs CUDA)"}
        elif ns.time_budget is not None and ns.time_budget - (time.time() - t_start) < 20:
            r = {"status": "skipped (time budget)"}
        else:
            r = _run_method(ns, m, out, m in timeline_for, t_start)
        r["method"] = m
        r["label"] = LABELS[m]
        if results["device"] is None and r.get("device"):
            results["device"] = r["device"]
        results["methods"][m] = r
        _add_ratios(results)
        save()
        print(_row(m, r, results), flush=True)
    ref = _ref(results)
    if ns.repeat_reference and ref:
        if ns.time_budget is not None and ns.time_budget - (time.time() - t_start) < 20:
            results["reference_repeat"] = {"method": ref, "status": "skipped (time budget)"}
        else:
            results["reference_repeat"] = _reference_repeat(ref, results["methods"][ref],
                                                            _run_method(ns, ref, out, False, t_start))
        line = _repeat_line(results["reference_repeat"])
        results["notes"].append(line.strip())
        print(line, flush=True)
    results["elapsed_s"] = round(time.time() - t_start, 1)
    _add_ratios(results)
    save()
    print()
    print(format_table(results))
    if not ns.no_plots:
        try:
            plot_bars(results, out / "bars.png")
            if any(r.get("timeline") for r in results["methods"].values()):
                plot_timeline(results, out / "memory_timeline.png")
        except Exception as e:  # a plot must not lose the numbers
            print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"\nwrote {res_path}")
    ok = [r for r in results["methods"].values() if r["status"] in ("ok", "OOM") or r["status"].startswith("skipped")]
    return 0 if len(ok) == len(results["methods"]) else 1


def precompile_forge_kernels(forge_methods: list[str], tokens: int) -> list[str]:
    """Compile, side by side in worker processes, every kernel variant the autotuner of these forge
    methods will try (the fused linears at ``tokens`` rows, and the BT=0 step of the unfused
    parameters), so the methods' first steps read Triton's disk cache instead of compiling one
    variant after another. Returns the lines of the variants that failed to compile."""
    from ..kernels import fused
    from ..kernels.launch import candidate_configs, precompile

    specs = []
    for m in forge_methods:  # forge-<state dtype>
        kinds = fused.ADAM_STATE_KINDS[m.split("-", 1)[1]]
        specs += [dict(config=c, kinds=kinds) for c in candidate_configs(tokens)]
        specs += [dict(config=c, kinds=kinds, grad_buffer=True) for c in candidate_configs(0)]
    return [line for line in precompile(specs) if line.startswith("FAILED")]


def _run_method(ns, m: str, out: Path, timeline: bool, t_start: float) -> dict:
    rf = out / f".result-{m}.json"
    if rf.exists():
        rf.unlink()
    timeout = ns.method_timeout
    if ns.time_budget is not None:
        timeout = max(20.0, min(timeout, ns.time_budget - (time.time() - t_start)))
    t0 = time.time()
    try:
        proc = subprocess.run(_worker_argv(ns, m, rf, timeline), env=_child_env(), timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        rc, log = proc.returncode, proc.stdout
        timed_out = False
    except subprocess.TimeoutExpired as e:
        rc, timed_out = None, True
        log = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    wall = round(time.time() - t0, 1)
    r = None
    if rf.exists():
        try:
            r = json.loads(rf.read_text())
        except json.JSONDecodeError:
            r = None
        rf.unlink()
    if r is None:
        r = {"status": f"timeout after {timeout:.0f} s" if timed_out else "error",
             "error": f"worker exit code {rc}, no result"}
    elif timed_out:
        if r.get("status") == "ok":  # the timed steps were saved before the process was stopped
            r["killed_in_phase"] = r.get("phase")
            r["note"] = f"stopped after {timeout:.0f} s in phase '{r.get('phase')}'; the timed steps are complete"
        else:
            r["status"] = f"timeout after {timeout:.0f} s"
    r["process_s"] = wall
    if r["status"] != "ok":
        r["log_tail"] = log[-3000:]
    if r["status"] == "error" or r["status"].startswith("timeout"):
        sys.stdout.write(f"--- {m}: {r['status']}; last lines of its output:\n{log[-2000:]}\n")
    return r


def _ref(results: dict) -> str | None:
    for k in REFERENCE_ORDER:
        r = results["methods"].get(k)
        if r and r.get("status") == "ok":
            return k
    return None


_REPEAT_KEYS = ("ms_median", "gpu_ms_per_step", "peak_gib")


def _reference_repeat(ref: str, first: dict, again: dict) -> dict:
    """The reference method's second run (after every other method) beside its first: the drift
    between the two is what the run order alone moved (GPU clocks, host state)."""
    rep = {"method": ref, "status": again.get("status")}
    for k in _REPEAT_KEYS:
        rep[k] = again.get(k)
        rep[f"first_{k}"] = first.get(k)
        d = _div(again.get(k), first.get(k))
        rep[f"drift_{k}"] = None if d is None else round(d - 1.0, 4)
    return rep


def _repeat_line(rep: dict) -> str:
    if rep.get("status") != "ok":
        return f"  reference again ({rep['method']}): {rep.get('status')}"
    parts = [f"ms/step={_fmt(rep['ms_median'])} (first {_fmt(rep['first_ms_median'])}, "
             f"drift {rep['drift_ms_median']:+.1%})"]
    if rep.get("drift_gpu_ms_per_step") is not None:
        parts.append(f"GPU ms={_fmt(rep['gpu_ms_per_step'])} (drift {rep['drift_gpu_ms_per_step']:+.1%})")
    return f"  reference again ({rep['method']}, run last): " + "  ".join(parts)


def _add_ratios(results: dict) -> None:
    ms = results["methods"]
    ref = _ref(results)
    results["reference"] = ref
    none = ms.get("none") if ms.get("none", {}).get("status") == "ok" else None
    rep = results.get("reference_repeat")
    rep = rep if rep and rep.get("status") == "ok" and rep.get("method") == ref else None
    for r in ms.values():
        if r.get("status") != "ok":
            continue
        rat = {}
        if ref:
            rr = ms[ref]
            rat["ms_vs_ref"] = _div(r.get("ms_median"), rr.get("ms_median"))
            rat["b2b_vs_ref"] = _div(r.get("ms_back_to_back"), rr.get("ms_back_to_back"))
            rat["gpu_ms_vs_ref"] = _div(r.get("gpu_ms_per_step"), rr.get("gpu_ms_per_step"))
            rat["peak_vs_ref"] = _div(r.get("peak_gib"), rr.get("peak_gib"))
            if rep:  # against the mean of the reference's first and last runs (order-neutral)
                for k, name in (("ms_median", "ms_vs_ref_mean"), ("gpu_ms_per_step", "gpu_ms_vs_ref_mean")):
                    if rr.get(k) is not None and rep.get(k) is not None:
                        rat[name] = _div(r.get(k), (rr[k] + rep[k]) / 2)
        if none:
            rat["ms_vs_none"] = _div(r.get("ms_median"), none.get("ms_median"))
            rat["gpu_ms_vs_none"] = _div(r.get("gpu_ms_per_step"), none.get("gpu_ms_per_step"))
        r["ratios"] = rat


def _div(a, b):
    if a is None or b is None or not b:
        return None
    return round(a / b, 4)


def _fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


COLUMNS = ["method", "status", "ms/step", "IQR ms", "b2b ms", "GPU ms", "peak GiB", "tok/s", "TFLOP/s",
           "ms/ref", "b2b/ref", "ms/none", "GPU/ref", "GiB/ref"]


def _cells(m: str, r: dict) -> list[str]:
    if r.get("status") != "ok":
        st = r.get("status", "?")
        extra = []
        if st == "OOM" and r.get("peak_gib") is not None:
            extra = ["", "", "", "", f">{r['peak_gib']:.1f}"]  # under "peak GiB"
        return [m, st] + extra + [""] * (len(COLUMNS) - 2 - len(extra))
    q = r.get("ms_iqr") or [None, None]
    rat = r.get("ratios", {})
    return [m, "ok", _fmt(r.get("ms_median")), f"{_fmt(q[0])}-{_fmt(q[1])}", _fmt(r.get("ms_back_to_back")),
            _fmt(r.get("gpu_ms_per_step")),
            _fmt(r.get("peak_gib"), ".2f"), _fmt(r.get("tokens_per_s"), ".0f"), _fmt(r.get("tflops"), ".1f"),
            _fmt(rat.get("ms_vs_ref"), ".3f"), _fmt(rat.get("b2b_vs_ref"), ".3f"), _fmt(rat.get("ms_vs_none"), ".3f"),
            _fmt(rat.get("gpu_ms_vs_ref"), ".3f"), _fmt(rat.get("peak_vs_ref"), ".3f")]


def _row(m: str, r: dict, results: dict) -> str:
    c = _cells(m, r)
    return "  " + "  ".join(f"{h}={v}" for h, v in zip(COLUMNS, c) if v not in ("", "-")) + \
        (f"  ({r['process_s']:.0f} s)" if r.get("process_s") is not None else "")


def format_table(results: dict) -> str:
    rows = [COLUMNS] + [_cells(m, r) for m, r in results["methods"].items()]
    w = [max(len(str(row[i])) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for j, row in enumerate(rows):
        lines.append(" | ".join(str(v).ljust(w[i]) if i < 2 else str(v).rjust(w[i]) for i, v in enumerate(row)))
        if j == 0:
            lines.append("-+-".join("-" * x for x in w))
    head = (f"{results['model']} BS={results['batch_size']} SEQ={results['seq_len']} "
            f"{'compiled' if results['compile'] else 'eager'}"
            f"{' +act-ckpt' if results['activation_checkpointing'] else ''}"
            f"{' +liger-loss' if results.get('loss') == 'liger' else ''} on {results.get('device') or results['device_type']}"
            f"; ref = {results.get('reference')}")
    notes = "".join(f"\nnote: {n}" for n in results.get("notes", []))
    return head + "\n" + "\n".join(lines) + notes


def markdown_table(results: dict) -> str:
    rows = [_cells(m, r) for m, r in results["methods"].items()]
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(v if v else " " for v in row) + " |" for row in rows]
    return "\n".join(out)


# -------------------------------------------------------------------------------------------- plots
def plot_bars(results: dict, path: Path, title: str | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = list(results["methods"].items())
    names = [m for m, _ in items]
    colors = ["tab:red" if m.startswith("forge") else ("tab:gray" if m == "none" else "tab:blue") for m in names]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(names) + 1.8))
    y = list(range(len(names)))
    for ax, key, unit in ((axes[0], "ms_median", "ms / step (median, IQR)"), (axes[1], "peak_gib", "peak GiB allocated")):
        vals, errs = [], [[], []]
        for m, r in items:
            v = r.get(key) if r.get("status") == "ok" else None
            vals.append(v or 0.0)
            if key == "ms_median" and v is not None and r.get("ms_iqr"):
                errs[0].append(max(0.0, v - r["ms_iqr"][0]))
                errs[1].append(max(0.0, r["ms_iqr"][1] - v))
            else:
                errs[0].append(0.0)
                errs[1].append(0.0)
        ax.barh(y, vals, color=colors, xerr=errs if key == "ms_median" else None, capsize=2)
        top = max(v + e for v, e in zip(vals, errs[1])) if any(vals) else 1.0
        for i, (m, r) in enumerate(items):
            v = r.get(key) if r.get("status") == "ok" else None
            if v is not None:
                x = v + (errs[1][i] if key == "ms_median" else 0.0)
                ax.text(x + 0.01 * top, i, f"{v:.1f}", va="center", fontsize=8)
            else:
                st = r.get("status", "")
                if key == "peak_gib" and r.get("status") == "ok":
                    st = "needs CUDA"
                ax.text(0.01 * top, i, st, va="center", fontsize=8, color="dimgray")
        ax.set_yticks(y)
        ax.set_yticklabels([LABELS.get(m, m) for m in names] if ax is axes[0] else [])
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.set_xlim(0, top * 1.18)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title or (f"{results['model']}, BS={results['batch_size']}, SEQ={results['seq_len']}, "
                           f"{'torch.compile' if results['compile'] else 'eager'}, "
                           f"{results.get('device') or results['device_type']} ({results['date'][:10]})"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    styles = {"forge-bf16": "tab:red", "forge-int8": "darkred", "torch-fused-adamw": "tab:blue"}
    for m, r in results["methods"].items():
        tl = r.get("timeline")
        if not tl:
            continue
        t = [p["t_ms"] for p in tl]
        g = [p["gib"] for p in tl]
        ax.plot(t, g, "-", marker=".", ms=3, lw=1.3, color=styles.get(m), label=f"{LABELS.get(m, m)} (peak {max(g):.1f} GiB)")
        # phase boundaries of this method
        for phase, ls in (("backward", "--"), ("step", ":")):
            ts = [p["t_ms"] for p in tl if p["phase"] == phase]
            if ts:
                ax.axvline(ts[0], color=styles.get(m, "k"), ls=ls, lw=0.8, alpha=0.6)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time within one training step (ms; samples synchronize the device)")
    ax.set_ylabel("torch.cuda.memory_allocated (GiB)")
    ax.set_title(f"Within-step memory: {results['model']}, BS={results['batch_size']}, SEQ={results['seq_len']} "
                 f"(dashed: backward starts, dotted: optimizer step)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=9, framealpha=0.95)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- worker
def _kernel_category(name: str) -> str:
    n = name.lower()
    if "forge" in n:
        return "forge fused wgrad+update"
    if "adam" in n or "multi_tensor_apply" in n:
        return "optimizer (multi-tensor)"
    if "optim" in n or "8bit" in n or "blockwise" in n:
        return "optimizer (other)"
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "matmul", "wgmma")):
        return "GEMM"
    if "triton" in n:
        return "triton (inductor / other)"
    return "elementwise/other"


def gpu_activity(events) -> list:
    """The GPU kernels, memcpys and memsets among torch.profiler ``events``. record_function ranges
    (e.g. 'Optimizer.step#AdamW.step') also appear as GPU-side user annotations spanning their
    kernels: those are left out, or their kernels would be counted twice.

    Kineto marks those annotations (``is_user_annotation``). Telling them apart by name (a GPU event
    named like a CPU event) also dropped every Triton kernel that inductor generates: inductor wraps
    each launch in a range named after the kernel, so compiled runs lost their fused elementwise
    kernels and a compiled optimizer step (torchao's) vanished entirely. The name test stays only for
    a torch whose events lack the flag."""
    from torch.autograd import DeviceType

    gpu = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("ProfilerStep")]
    if all(getattr(e, "is_user_annotation", None) is not None for e in gpu):
        return [e for e in gpu if not e.is_user_annotation]
    cpu_names = {e.name for e in events if e.device_type != DeviceType.CUDA}
    return [e for e in gpu if e.name not in cpu_names]


def _profile_gpu(step, batches, n: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            step(batches(i))
        torch.cuda.synchronize()
    by_name: dict[str, list] = {}
    total = 0.0
    for e in gpu_activity(prof.events()):
        us = e.time_range.elapsed_us()
        total += us
        s = by_name.setdefault(e.name, [0.0, 0])
        s[0] += us
        s[1] += 1
    cats: dict[str, float] = {}
    for name, (us, _) in by_name.items():
        c = _kernel_category(name)
        cats[c] = cats.get(c, 0.0) + us
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "gpu_ms_per_step": round(total / 1e3 / n, 3),
        "gpu_categories_ms": {k: round(v / 1e3 / n, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "gpu_top_kernels": [{"name": k[:160], "ms_per_step": round(us / 1e3 / n, 3), "calls_per_step": c / n}
                            for k, (us, c) in top],
        "gpu_kernel_launches_per_step": sum(c for _, c in by_name.values()) / n,
    }


def _make_method(m: str, model, lr: float, wd: float, device: str):
    """Returns (optimizer-or-None, after_backward(), info)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    info: dict = {}
    if m == "none":
        return None, lambda: model.zero_grad(set_to_none=True), info
    if m.startswith("forge-"):
        import forge_optim

        opt = forge_optim.AdamW(model, lr=lr, weight_decay=wd, state_dtype=m.split("-", 1)[1])
        info["fused_modules"] = len(opt.fused_modules())
        info["unfused_linears"] = {k: str(v) for k, v in opt.unfused_linears().items()}
        info["backend"] = opt.backend_name
    elif m == "torch-fused-adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=True)
    elif m == "torch-foreach-adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, foreach=True)
    elif m == "optimi-release":
        import optimi

        opt = optimi.AdamW(params, lr=lr, weight_decay=wd, gradient_release=True)
        optimi.prepare_for_gradient_release(model, opt)
        return opt, lambda: None, info  # hooks step and free each gradient inside backward
    elif m in ("flashoptim", "flashoptim-release"):
        import flashoptim

        opt = flashoptim.FlashAdamW(params, lr=lr, weight_decay=wd)
        if m == "flashoptim-release":
            info["handle"] = flashoptim.enable_gradient_release(model, opt)
            return opt, lambda: None, info
    elif m == "bnb-adamw8bit":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(params, lr=lr, weight_decay=wd)
    elif m == "torchao-adamw8bit":
        from torchao.optim import AdamW8bit

        opt = AdamW8bit(params, lr=lr, weight_decay=wd)
    else:
        raise ValueError(m)

    def after():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt, after, info


def _decoder_layers(model):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    return list(layers) if layers is not None else []


def _timeline(model, fwd, after, ids, cuda: bool) -> list[dict]:
    """One instrumented step: memory_allocated after each decoder layer's forward, at the start of
    each decoder layer's backward, and around the optimizer step."""
    import torch

    pts: list[dict] = []
    t0 = [0.0]

    def rec(phase, label):
        if cuda:
            torch.cuda.synchronize()
            mem = torch.cuda.memory_allocated() / GIB
        else:
            mem = None
        pts.append({"t_ms": round((time.perf_counter() - t0[0]) * 1e3, 3), "phase": phase, "label": label,
                    "gib": None if mem is None else round(mem, 4)})

    handles = []

    def attach(mod, label):
        def fhook(_m, _inp, out):
            in_bwd = torch._C._current_graph_task_id() != -1
            rec("recompute" if in_bwd else "forward", label)
            o = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
            if isinstance(o, torch.Tensor) and o.requires_grad and not in_bwd:
                o.register_hook(lambda g: rec("backward", label))
        handles.append(mod.register_forward_hook(fhook))

    emb = model.get_input_embeddings()
    attach(emb, "embedding")
    for i, layer in enumerate(_decoder_layers(model)):
        attach(layer, f"layer {i}")
    head = model.get_output_embeddings()
    if head is not None:
        attach(head, "lm_head")
    try:
        if cuda:
            torch.cuda.synchronize()
        t0[0] = time.perf_counter()
        rec("start", "start")
        loss = fwd(input_ids=ids, labels=ids).loss
        rec("loss", "loss")
        loss.backward()
        rec("step", "backward done")
        after()
        rec("step", "step done")
    finally:
        for h in handles:
            h.remove()
    return pts


def worker_main(ns: argparse.Namespace) -> int:
    m = ns.worker
    r: dict = {"status": "error"}
    rf = Path(ns.result_file) if ns.result_file else None

    def save():
        if rf is not None:
            rf.write_text(json.dumps(r, default=str))

    try:
        _worker(ns, m, r, save)
    except ImportError as e:
        r["status"] = "skipped (import failed)"
        r["error"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        import torch

        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        r["status"] = "OOM" if oom else "error"
        r["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            r["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        if not oom:
            import traceback
            r["traceback"] = traceback.format_exc()[-3000:]
            traceback.print_exc()
    save()
    return 0 if r["status"] in ("ok", "OOM") or r["status"].startswith("skipped") else 1


def _worker(ns, m: str, r: dict, save) -> None:
    import resource
    import statistics

    import torch

    from ..bench_models import build_model, config_dict, count_params

    device = resolve_device(ns.device)
    cuda = device == "cuda"
    if ns.model == "auto":
        ns.model = "Llama-3.1-8B" if cuda else "tiny"
    torch.manual_seed(0)
    cfgd = config_dict(None if ns.config else ns.model, ns.config, ns.layers)
    r["phase"] = "build"
    if cuda:
        r["device"] = torch.cuda.get_device_name()
        r["cuda_version"] = torch.version.cuda
    else:
        r["device"] = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    t = time.perf_counter()
    model = build_model(cfgd, device, torch.bfloat16)
    if cuda:
        torch.cuda.synchronize()
    r["build_s"] = round(time.perf_counter() - t, 2)
    r["model_gib"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / GIB, 3)
    if ns.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if ns.loss == "liger":
        model.loss_function = liger_causal_lm_loss
    opt, after, info = _make_method(m, model, ns.lr, ns.weight_decay, device)
    info.pop("handle", None)
    r.update(info)
    fwd = torch.compile(model, mode=None if ns.compile_mode == "default" else ns.compile_mode) if ns.compile else model
    graphs = ns.compile and ns.compile_mode == "reduce-overhead"
    r["compile_mode"] = ns.compile_mode if ns.compile else None  # what this process compiled with
    vocab = model.config.vocab_size
    B, S = ns.batch_size, ns.seq_len
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)

    def batch(_i=None):
        return torch.randint(0, vocab, (B, S), device=device, generator=gen)

    def step(ids):
        if graphs:  # the last step's graph outputs are dead: let CUDA-graph trees reuse their memory
            torch.compiler.cudagraph_mark_step_begin()
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        after()
        return loss

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed_step():
        ids = batch()
        sync()
        t = time.perf_counter()
        loss = step(ids)
        sync()
        return (time.perf_counter() - t) * 1e3, loss

    r["phase"] = "warmup"
    warm = []
    for _ in range(ns.warmup):
        ms, _loss = timed_step()
        warm.append(round(ms, 2))
    r["warmup_ms"] = warm
    if cuda:
        r["mem_after_warmup_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
        r["peak_warmup_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)  # build + warm-up
        torch.cuda.reset_peak_memory_stats()  # steady-state peak from here
    r["phase"] = "measure"
    times, losses = [], []
    cpu0 = host_cpu_sample()
    for _ in range(ns.steps):
        ms, loss = timed_step()
        times.append(ms)
        # a copy: under CUDA graphs the loss is a graph output the next replay overwrites (without it every
        # entry read as the last step's loss, loss_first == loss_last)
        losses.append(loss.detach().clone())
    r["host_cpu"] = host_cpu_delta(cpu0, host_cpu_sample())
    med = statistics.median(times)
    qs = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [med, med, med]
    tokens = B * S
    counts = count_params(cfgd)
    L = cfgd["num_hidden_layers"]
    hd = cfgd.get("head_dim") or cfgd["hidden_size"] // cfgd["num_attention_heads"]
    flops = 6 * counts["matmul"] * tokens + 12 * L * cfgd["num_attention_heads"] * hd * S * tokens
    r.update({
        "ms_median": round(med, 3), "ms_iqr": [round(qs[0], 3), round(qs[2], 3)],
        "ms_mean": round(statistics.fmean(times), 3), "ms_min": round(min(times), 3),
        "ms_all": [round(x, 3) for x in times],
        "tokens_per_s": round(tokens / (med / 1e3), 1),
        "tflops": float(f"{flops / (med / 1e3) / 1e12:.4g}"), "flops_per_step": flops,
        "loss_first": float(losses[0]) if losses else None, "loss_last": float(losses[-1]) if losses else None,
        "first_step_ms": warm[0] if warm else None,
    })
    if m.startswith("forge"):
        r["kernel_configs"] = kernel_configs(opt)
    if cuda:
        r["peak_steady_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        r["mem_steady_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
        r["peak_gib"] = max(r["peak_steady_gib"], r["peak_warmup_gib"])  # build + warm-up + timed steps
    # Back to back: the same number of steps with no synchronize between them, as a training loop that
    # does not read the loss every step runs: the host may dispatch step i+1's forward while the GPU
    # still runs step i's backward or optimizer step. Mean ms per step (one clock over all of them).
    sync()
    t = time.perf_counter()
    for _ in range(ns.steps):
        step(batch())
    sync()
    r["ms_back_to_back"] = round((time.perf_counter() - t) * 1e3 / max(1, ns.steps), 3)
    r["status"] = "ok"
    r["phase"] = "profile" if cuda and ns.profile_steps > 0 else "timeline"
    save()  # the timed numbers are safe from here on
    if cuda and ns.profile_steps > 0:
        r["phase"] = "profile"
        try:
            r.update(_profile_gpu(step, batch, ns.profile_steps))
        except Exception as e:  # noqa: BLE001
            r["profile_error"] = f"{type(e).__name__}: {e}"
        save()
    if ns.timeline and not ns.compile:
        r["phase"] = "timeline"
        try:
            r["timeline"] = _timeline(model, fwd, after, batch(), cuda)
        except Exception as e:  # noqa: BLE001
            r["timeline_error"] = f"{type(e).__name__}: {e}"
        save()
    if cuda:  # the profiled and instrumented steps, separately (not part of peak_gib)
        r["peak_after_timed_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    r["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    r["phase"] = "done"
    if not cuda:
        r["memory"] = "needs CUDA"


if __name__ == "__main__":
    sys.exit(main())
