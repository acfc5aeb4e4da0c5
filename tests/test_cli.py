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
    rc, _ = run_train(tmp_path, "--data", str(tmp_path / "missing.txt"), steps=2)
    assert rc == 2
    assert "data file not found" in capsys.readouterr().err


def test_bench_subcommand_reaches_the_benchmark(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    assert "--methods" in capsys.readouterr().out


def test_no_subcommand_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


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
