"""Entry point of the ``forge-optim`` console script.

    forge-optim train [flags]   train a small Llama-style LM on CPU or GPU (see ``train --help``)
    forge-optim bench           step time and peak memory, FORGE against its peers (``bench --help``)
    forge-optim tune            tune the fused kernel on a model's whole weights, on this GPU (``tune --help``)

``main(argv)`` returns the exit status; the console script passes it to ``sys.exit``.
Heavy imports (torch, transformers) happen only inside the subcommand that needs them.
"""
from __future__ import annotations

import argparse
import difflib
import sys
import time


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except where the help already says or there is no value to show."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h or action.default is None or isinstance(action.default, bool):
            return h
        return super()._get_help_string(action)


def _bench(ns: argparse.Namespace) -> int:  # reached only through build_parser() users
    from .bench import main as bench_main
    return bench_main(ns.bench_args)


def _tune(ns: argparse.Namespace) -> int:
    from .tune import run_parsed
    return run_parsed(ns)


def _train(ns: argparse.Namespace) -> int:
    from .train import run_parsed
    return run_parsed(ns)


def _check_train(ns: argparse.Namespace) -> str | None:
    from .train import check_args
    return check_args(ns)


def no_cuda_reason() -> str:
    """Why torch has no CUDA device here, for the --device cuda errors of train and bench."""
    import torch

    return "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"


def unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """argparse's message for unknown arguments, with the nearest flag of ``parser`` for a typo."""
    msg = f"unrecognized arguments: {' '.join(extra)}"
    flags = [s for a in parser._actions for s in a.option_strings]
    for arg in extra:
        if arg.startswith("--"):
            near = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1)
            if near:
                return f"{msg} (did you mean {near[0]}? see {parser.prog} --help)"
    return f"{msg} (see {parser.prog} --help)"


def build_parser() -> argparse.ArgumentParser:
    from .train import add_arguments

    p = argparse.ArgumentParser(prog="forge-optim", description="FORGE: optimizer updates fused into "
                                "the weight-gradient GEMM of nn.Linear layers.")
    sub = p.add_subparsers(dest="command", metavar="{train,bench,tune}")
    sub.required = True
    t = sub.add_parser("train", formatter_class=_HelpFormatter, help="train a small Llama-style causal LM (synthetic data, no download)",
                       description="Train a small Llama-style causal LM with a forge_optim optimizer "
                       "(or the torch.optim.AdamW baseline) and write metrics.jsonl, loss.png and "
                       "config.json to a run folder.")
    add_arguments(t)
    # _parser: errors about train's flags print train's usage; _check: validation before any work
    t.set_defaults(func=_train, _parser=t, _check=_check_train)
    b = sub.add_parser("bench", add_help=False, help="step time and peak memory, FORGE against the peers "
                       "(forge-optim bench --help)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)
    from .tune import add_arguments as tune_arguments

    u = sub.add_parser("tune", formatter_class=_HelpFormatter, help="time the fused kernel's configs on a "
                       "model's whole weights on this GPU and write the table later runs read",
                       description="Time every candidate config of the fused kernel on a model's whole "
                       "weights on this GPU; later runs on this GPU take the winners (kernels/tuned.py).")
    tune_arguments(u)
    u.set_defaults(func=_tune, _parser=u)
    return p


def main(argv: list[str] | None = None) -> int:
    t_start = time.time()  # before torch is imported, so that reported wall times include it
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark owns its whole argument list (and its --help)
        from .bench import main as bench_main
        return bench_main(argv[1:])
    p = build_parser()
    # parse_known_args: with parse_args, a subcommand's unknown flag is reported by the top-level parser,
    # with the top-level usage; the subcommand's own parser says it here, with its usage and flags
    ns, extra = p.parse_known_args(argv)
    sub = getattr(ns, "_parser", p)
    if extra:
        sub.error(unrecognized(sub, extra))
    check = getattr(ns, "_check", None)
    msg = check(ns) if check else None
    if msg:
        sub.error(msg)  # usage + "error: ...", exit status 2, before any model or data is built
    ns.t_start = t_start
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
