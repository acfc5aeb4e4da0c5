"""``forge-optim train`` end to end on CPU (tiny model, a few seconds each) and its data module."""
import json
import math

import pytest
import torch

from forge_optim import data as fdata
from forge_optim.cli.main import main

pytest.importorskip("transformers")

TINY = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--intermediate-size", "64",
        "--seq-len", "32", "--batch-size", "8", "--warmup-steps", "2", "--eval-iters", "1",
        "--device", "cpu"]


def run_train(tmp_path, *extra, steps=20, name="run"):
    out = tmp_path / name
    rc = main(["train", *TINY, "--steps", str(steps), "--eval-every", "10", "--out-dir", str(out), *extra])
    return rc, out


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_end_to_end_forge_adamw(tmp_path, capsys):
    rc, out = run_train(tmp_path)
    assert rc == 0
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 21))
    for r in recs:
        assert {"step", "loss", "lr", "tokens_per_s", "elapsed"} <= set(r)
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5, (recs[0]["loss"], recs[-1]["loss"])
    assert "val_loss" in recs[9] and "val_loss" in recs[19]
    assert recs[19]["val_loss"] < recs[9]["val_loss"] + 0.1
    # warm-up then cosine decay, through the optimizer's param_groups
    lrs = [r["lr"] for r in recs]
    assert lrs[0] < lrs[1] < lrs[2] and lrs[-1] < lrs[2]
    assert (out / "loss.png").stat().st_size > 1000
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["optimizer"] == "forge-adamw" and cfg["steps"] == 20
    assert len(cfg["extra"]["fused_modules"]) == 2 * 7 + 1  # q k v o gate up down per layer, lm_head
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fused_modules"] == 15 and summary["final_loss"] < summary["first_loss"]
    assert summary["final_val_loss"] < summary["first_val_loss"]
    text = capsys.readouterr().out
    assert "tokens/s" in text and "peak process RSS" in text and "fused  15 modules" in text


def test_train_torch_adamw(tmp_path, capsys):
    rc, out = run_train(tmp_path, "--optimizer", "torch-adamw", "--no-progress")
    assert rc == 0
    recs = read_metrics(out)
    assert len(recs) == 20 and recs[-1]["loss"] < recs[0]["loss"] - 0.5
    assert json.loads((out / "summary.json").read_text())["fused_modules"] == 0
    assert (out / "loss.png").exists()
    assert "torch baseline" in capsys.readouterr().out


def test_torch_and_forge_adamw_agree(tmp_path):
    """fp32 weights and fp32 state: forge AdamW follows torch.optim.AdamW's trajectory."""
    _, a = run_train(tmp_path, "--optimizer", "torch-adamw", "--no-progress", steps=8, name="torch")
    _, b = run_train(tmp_path, "--optimizer", "forge-adamw", "--state-dtype", "fp32", "--no-progress",
                     steps=8, name="forge")
    la, lb = [r["loss"] for r in read_metrics(a)], [r["loss"] for r in read_metrics(b)]
    assert la == pytest.approx(lb, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("opt", ["forge-adam", "forge-nadam", "forge-radam", "forge-lion",
                                 "forge-rmsprop", "forge-adagrad", "forge-sgd"])
def test_train_each_forge_optimizer(tmp_path, opt):
    rc, out = run_train(tmp_path, "--optimizer", opt, "--no-progress", steps=15)
    assert rc == 0
    losses = [r["loss"] for r in read_metrics(out)]
    # RAdam's first steps are un-adapted momentum SGD, so the bar is low; the default run goes further
    assert sum(losses[-3:]) / 3 < losses[0] - 0.1, (opt, losses)


def test_train_grad_accum_and_bf16_int8(tmp_path):
    rc, out = run_train(tmp_path, "--grad-accum", "2", "--no-progress", steps=6, name="accum")
    assert rc == 0 and len(read_metrics(out)) == 6
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["extra"]["tokens_per_step"] == 8 * 32 * 2 and cfg["accumulate_dtype"] == "fp32"
    rc, out = run_train(tmp_path, "--grad-accum", "2", "--accumulate-dtype", "bf16", "--no-progress", steps=3,
                        name="accum-bf16")
    assert rc == 0 and json.loads((out / "config.json").read_text())["accumulate_dtype"] == "bf16"
    rc, out = run_train(tmp_path, "--dtype", "bf16", "--state-dtype", "int8", "--no-progress",
                        steps=15, name="bf16")
    assert rc == 0
    recs = read_metrics(out)
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.3
    rc, out = run_train(tmp_path, "--dtype", "bf16", "--state-dtype", "bf16", "--no-stochastic-rounding",
                        "--no-progress", steps=4, name="bf16rn")
    assert rc == 0 and json.loads((out / "config.json").read_text())["stochastic_rounding"] is False


def test_train_on_text_and_jsonl_files(tmp_path):
    txt = tmp_path / "corpus.txt"
    txt.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    rc, out = run_train(tmp_path, "--data", str(txt), "--no-progress", steps=10, name="txt")
    assert rc == 0
    recs = read_metrics(out)
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5
    js = tmp_path / "corpus.jsonl"
    js.write_text("\n".join(json.dumps({"text": f"line {i}: hello world", "id": i}) for i in range(300)))
    rc, out = run_train(tmp_path, "--data", str(js), "--no-progress", steps=4, name="jsonl")
    assert rc == 0 and len(read_metrics(out)) == 4


def test_bad_data_path_is_a_clear_error(tmp_path, capsys):
    # a usage error now (checked before any work): argparse's SystemExit(2), the usage line and the message
    with pytest.raises(SystemExit) as e:
        run_train(tmp_path, "--data", str(tmp_path / "missing.txt"), steps=2)
    assert e.value.code == 2
    assert "data file not found" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # no run folder: nothing started


def test_bench_subcommand_reaches_the_benchmark(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    assert "--methods" in capsys.readouterr().out


def test_no_subcommand_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


# ---- bad flags: a usage error (exit status 2), before any model or data is built ----------------

@pytest.fixture
def no_training(monkeypatch):
    """Replaces train(): a flag that passes the checks records its config instead of training, so these
    tests stay fast and a check that lets a bad flag through fails the test rather than starting work."""
    from forge_optim.cli import train as train_mod

    seen = []

    def fake_train(cfg, t_start=None):
        seen.append(cfg)
        return {"final_loss": 1.0}
    monkeypatch.setattr(train_mod, "train", fake_train)
    return seen


def usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("usage: forge-optim train")  # train's usage, not the top-level one
    assert "forge-optim train: error: " in err
    return err.split("error: ", 1)[1]


@pytest.mark.parametrize("argv, want", [
    (["--heads", "3"], ["--hidden-size 128 is not divisible by --heads 3", "--heads 2 or --heads 4"]),
    (["--hidden-size", "30", "--heads", "2"], ["15 dimensions per head, which must be even"]),
    (["--hidden-size", "0"], ["--hidden-size must be a positive integer, got 0"]),
    (["--layers", "0"], ["--layers must be a positive integer, got 0"]),
    (["--heads", "-2"], ["--heads must be a positive integer, got -2"]),
    (["--intermediate-size", "0"], ["--intermediate-size must be a positive integer"]),
    (["--seq-len", "0"], ["--seq-len must be a positive integer"]),
    (["--batch-size", "-1"], ["--batch-size must be a positive integer"]),
    (["--grad-accum", "0"], ["--grad-accum must be a positive integer"]),
    (["--steps", "0"], ["--steps must be a positive integer"]),
    (["--eval-iters", "0"], ["--eval-iters must be a positive integer"]),
    (["--log-every", "0"], ["--log-every must be a positive integer"]),
    (["--warmup-steps", "-1"], ["--warmup-steps must be an integer >= 0, got -1"]),
    (["--eval-every", "-5"], ["--eval-every must be an integer >= 0"]),
    (["--lr", "0"], ["--lr must be a positive number, got 0.0"]),
    (["--lr", "nan"], ["--lr must be a positive number, got nan"]),
    (["--weight-decay", "-0.1"], ["--weight-decay must be a number >= 0"]),
    (["--beta1", "1"], ["--beta1 must be in [0, 1), got 1.0"]),
    (["--beta2", "-0.5"], ["--beta2 must be in [0, 1)"]),
    (["--optimizer", "forge-sgd", "--momentum", "1.5"], ["--momentum must be in [0, 1)"]),
    (["--optimizer", "forge-sgd", "--beta1", "0.9"], ["--beta1 does not apply to forge-sgd"]),
    (["--momentum", "0.9"], ["--momentum applies to forge-sgd and forge-rmsprop only, not forge-adamw"]),
    (["--min-lr-ratio", "2"], ["--min-lr-ratio", "must be in [0, 1], got 2.0"]),
    (["--peak-tflops", "0"], ["--peak-tflops must be a positive number"]),
    (["--seed", "-1"], ["--seed must be an integer in [0, 2**62)"]),
    (["--device", "foo"], ["--device 'foo' is not a device; use cpu or cuda"]),
])
def test_bad_numbers_and_sizes_are_usage_errors(capsys, no_training, argv, want):
    msg = usage_error(capsys, ["train", *argv])
    for w in want:
        assert w in msg, msg
    assert not no_training


def test_device_cuda_without_cuda(capsys, no_training, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    msg = usage_error(capsys, ["train", "--device", "cuda"])
    assert "CUDA is not available" in msg and "omit --device" in msg and "--device cpu" in msg
    assert not no_training


def test_backend_triton_without_cuda(capsys, no_training, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    msg = usage_error(capsys, ["train", "--backend", "triton"])
    assert "--backend triton needs" in msg and "--backend torch" in msg
    if "needs Triton" not in msg:  # triton installed: the missing GPU is the problem
        assert "needs a CUDA GPU" in msg and "TRITON_INTERPRET=1" in msg
    assert not no_training


def test_backend_triton_is_allowed_under_the_interpreter(monkeypatch, no_training):
    """TRITON_INTERPRET=1: forge_optim's own triton_available() says yes, and so does the CLI."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["train", "--backend", "triton", "--device", "cpu"]) == 0
    assert no_training[0].backend == "triton"


def test_typo_flag_gets_the_train_usage_and_a_suggestion(capsys):
    msg = usage_error(capsys, ["train", "--lrr", "1e-3"])
    assert "unrecognized arguments: --lrr 1e-3" in msg and "did you mean --lr?" in msg


def test_forge_only_flags_with_torch_adamw(capsys, no_training):
    msg = usage_error(capsys, ["train", "--optimizer", "torch-adamw", "--state-dtype", "int8"])
    assert "--state-dtype applies to the forge-* optimizers only, not torch-adamw" in msg
    msg = usage_error(capsys, ["train", "--optimizer", "torch-adamw", "--backend", "auto", "--accumulate-dtype", "fp32",
                               "--no-stochastic-rounding"])
    for flag in ("--backend", "--accumulate-dtype", "--no-stochastic-rounding"):
        assert flag in msg
    assert not no_training
    # defaults never count as set: torch-adamw on its own, and forge flags with a forge optimizer, pass
    assert main(["train", "--optimizer", "torch-adamw"]) == 0
    assert main(["train", "--backend", "torch", "--accumulate-dtype", "bf16", "--state-dtype", "int8"]) == 0
    assert no_training[0].backend == "auto" and no_training[0].accumulate_dtype == "fp32"
    assert no_training[1].backend == "torch" and no_training[1].accumulate_dtype == "bf16"


def test_data_must_be_arith_or_an_existing_txt_or_jsonl(tmp_path, capsys, no_training):
    py = tmp_path / "foo.py"
    py.write_text("print('hi')\n")
    for spec in ("foo.py", str(py), "arth"):
        msg = usage_error(capsys, ["train", "--data", spec])
        assert "not a data set this command reads" in msg and "'arith'" in msg and ".jsonl" in msg
    msg = usage_error(capsys, ["train", "--data", str(tmp_path / "missing.jsonl")])
    assert "data file not found" in msg
    msg = usage_error(capsys, ["train", "--out-dir", str(py)])
    assert "is a file, not a folder" in msg
    assert not no_training


def test_default_train_command_passes_the_checks(no_training):
    """`forge-optim train` as the README runs it: the checks accept the defaults, and flags left unset
    keep TrainConfig's values."""
    from forge_optim.cli.train import TrainConfig

    assert main(["train"]) == 0
    cfg = no_training[0]
    cfg.extra = {}
    assert cfg == TrainConfig()


def test_train_module_entry_and_train_function_check_too(capsys):
    from forge_optim.cli import train as train_mod

    with pytest.raises(SystemExit) as e:  # python -m forge_optim.cli.train
        train_mod.run(["--heads", "3"])
    assert e.value.code == 2 and "not divisible by --heads 3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--steps must be a positive integer"):  # train(cfg) from Python
        train_mod.train(train_mod.TrainConfig(steps=0))


# ---- data -----------------------------------------------------------------------------------

def test_arith_problems_are_correct_and_seeded():
    probs = fdata.arith_problems(500, seed=3)
    assert probs == fdata.arith_problems(500, seed=3)
    assert probs != fdata.arith_problems(500, seed=4)
    for p in probs:
        assert p.endswith("\n")
        lhs, c = p[:-1].split("=")
        a, b = lhs.split("+")
        assert int(a) + int(b) == int(c)
        assert 1 <= len(a) <= 3 and 1 <= len(b) <= 3
    toks = fdata.arith_tokens(50, seed=3)
    assert toks.dtype == torch.uint8
    assert fdata.decode(toks) == "".join(fdata.arith_problems(50, seed=3))
    ds = fdata.load_dataset("arith", seq_len=32, seed=0, n_train_problems=200, n_val_problems=50)
    assert ds.train.numel() > 1000 and ds.val.numel() > 200 and not torch.equal(ds.train[:200], ds.val[:200])


def test_get_batch_and_answer_mask():
    data = fdata.bytes_to_tensor(b"12+3=15\n7+80=87\n" * 10)
    g = torch.Generator().manual_seed(0)
    x, y = fdata.get_batch(data, 4, 16, g)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x = fdata.bytes_to_tensor(b"12+3=15\n7+80=87")[None].long()
    y = fdata.bytes_to_tensor(b"2+3=15\n7+80=87\n")[None].long()
    m = fdata.answer_mask(x, y)
    assert fdata.decode(y[m]) == "15\n87\n"


def test_load_text_and_jsonl(tmp_path):
    t = tmp_path / "a.txt"
    t.write_bytes("héllo\nworld\n".encode())
    assert fdata.load_file(str(t)) == "héllo\nworld\n".encode()
    j = tmp_path / "a.jsonl"
    j.write_text('{"text": "first"}\n\n{"text": "sécond", "meta": 1}\n')
    assert fdata.load_file(str(j)) == "first\nsécond\n".encode()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="no 'text' field"):
        fdata.load_file(str(bad))
    with pytest.raises(FileNotFoundError):
        fdata.load_file(str(tmp_path / "nope.txt"))
    # a file large enough gets a held-out tail; a small one reuses its bytes for eval, and says so
    big = tmp_path / "big.txt"
    big.write_bytes(bytes(range(256)) * 20)
    ds = fdata.load_dataset(str(big), seq_len=64)
    assert ds.train.numel() + ds.val.numel() == 5120 and ds.val.numel() == 512
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 100)
    ds = fdata.load_dataset(str(small), seq_len=64)
    assert ds.val is ds.train and "reuses" in ds.note
    with pytest.raises(ValueError, match="too short"):
        fdata.load_dataset(str(small), seq_len=128)


def test_train_compiled_follows_the_eager_run(tmp_path):
    """--compile: the training steps run through torch.compile (FORGE's ops traced, CPU inductor), and
    fp32 weights and states follow the eager run's losses to compile round-off, with accumulation too."""
    common = ("--optimizer", "forge-adamw", "--state-dtype", "fp32", "--grad-accum", "2", "--no-progress")
    _, a = run_train(tmp_path, *common, steps=6, name="eager")
    rc, b = run_train(tmp_path, *common, "--compile", steps=6, name="compiled")
    assert rc == 0
    assert json.loads((b / "config.json").read_text())["compile"] is True
    la, lb = [r["loss"] for r in read_metrics(a)], [r["loss"] for r in read_metrics(b)]
    assert la == pytest.approx(lb, rel=1e-4, abs=1e-4)
    assert la[0] != pytest.approx(la[-1], rel=1e-3)  # the weights moved: the comparison is not vacuous
