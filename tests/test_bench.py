"""``forge-optim bench`` on CPU: a tiny model, one process per method, results.json schema, plots."""
import json

import pytest

from forge_optim import bench_models
from forge_optim.cli import bench

pytest.importorskip("transformers")


def test_model_configs_have_published_shapes():
    for name, billions in bench_models.PUBLISHED_PARAMS_B.items():
        c = bench_models.count_params(bench_models.config_dict(name))
        assert abs(c["total"] / 1e9 - billions) / billions < 0.01, (name, c["total"])
    # the released Qwen3 0.6B / 1.7B / 4B tie lm_head to the embedding; the others do not
    tied = {n for n in bench_models.PUBLISHED_PARAMS_B if bench_models.MODELS[n]["tie_word_embeddings"]}
    assert tied == {"Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B"}
    assert bench_models.config_dict("Qwen3-8B", layers=2)["num_hidden_layers"] == 2


def test_custom_config_file(tmp_path):
    cfg = dict(bench_models.MODELS["tiny"], hidden_size=32, intermediate_size=48)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    assert bench_models.config_dict(config_path=str(path))["hidden_size"] == 32
    with pytest.raises(ValueError):
        bench_models.config_dict("no-such-model")


def test_parse_methods():
    assert bench.parse_methods("forge,none") == ["forge-bf16", "none"]
    assert "forge-fp32" not in bench.parse_methods("default")
    assert bench.parse_methods("all") == bench.METHODS
    with pytest.raises(SystemExit):
        bench.parse_methods("sgd")


def test_bench_cpu_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "_peer_installed", lambda m: False)  # peers: reported, never run
    out = tmp_path / "run"
    rc = bench.main(["--device", "cpu", "--model", "tiny", "--batch-size", "2", "--seq-len", "32",
                     "--steps", "25", "--warmup", "1", "--methods", "none,forge,torch-foreach-adamw,flashoptim",
                     "--out-dir", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    for key in ("date", "device", "versions", "command", "model", "batch_size", "seq_len", "methods", "params"):
        assert key in res
    assert res["versions"]["torch"] and res["versions"]["transformers"]
    assert res["source_digest"] == bench.source_digest() and len(res["source_digest"]) == 12  # which code ran
    assert res["device"].startswith("cpu") and res["model"] == "tiny"
    assert list(res["methods"]) == ["none", "forge-bf16", "torch-foreach-adamw", "flashoptim"]
    for m in ("none", "forge-bf16", "torch-foreach-adamw"):
        r = res["methods"][m]
        assert r["status"] == "ok", r
        assert r["ms_median"] > 0 and len(r["ms_all"]) == 25 and r["ms_iqr"][0] <= r["ms_median"] <= r["ms_iqr"][1]
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0
        assert r["ms_back_to_back"] > 0  # the same steps with no synchronize between them
        assert r["memory"] == "needs CUDA" and "peak_gib" not in r
        hc = r["host_cpu"]  # where the host's time went during the timed steps (Linux /proc)
        # CPU time is counted in clock ticks (10 ms): 25 steps, so that the timed window spans several
        # (three tiny steps sometimes gained none)
        assert hc["wall_s"] > 0 and hc["threads"] and hc["process_cpu_s"] > 0, hc
        assert 0 <= hc["machine_busy_share"] <= 1
    assert res["methods"]["forge-bf16"]["fused_modules"] == 2 * 7 + 1
    assert res["methods"]["forge-bf16"]["kernel_configs"] == {}  # the torch backend ran: no kernel configs
    assert res["methods"]["flashoptim"]["status"] == "skipped (not installed)"
    assert res["reference"] == "torch-foreach-adamw"
    assert res["methods"]["forge-bf16"]["ratios"]["ms_vs_ref"] > 0
    assert res["methods"]["forge-bf16"]["ratios"]["b2b_vs_ref"] > 0
    assert any("memory" in n and "CUDA" in n for n in res["notes"])
    assert (out / "bars.png").stat().st_size > 5000
    text = capsys.readouterr().out
    assert "skipped (not installed)" in text and "forge-bf16" in text and "ms/step" in text and "b2b ms" in text


def test_repeat_reference_reports_the_drift_of_the_run_order(tmp_path, capsys):
    """--repeat-reference runs the reference once more after the other methods: results.json keeps both
    runs and their drift, and each method gets ratios to the mean of the two (order-neutral)."""
    out = tmp_path / "run"
    rc = bench.main(["--device", "cpu", "--model", "tiny", "--layers", "1", "--batch-size", "1", "--seq-len", "16",
                     "--steps", "2", "--warmup", "1", "--methods", "torch-foreach-adamw,forge",
                     "--repeat-reference", "--no-plots", "--out-dir", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    rep = res["reference_repeat"]
    first = res["methods"]["torch-foreach-adamw"]
    assert rep["method"] == "torch-foreach-adamw" and rep["status"] == "ok"
    assert rep["first_ms_median"] == first["ms_median"] and rep["ms_median"] > 0
    assert rep["drift_ms_median"] == round(rep["ms_median"] / first["ms_median"] - 1, 4)
    mean = (first["ms_median"] + rep["ms_median"]) / 2
    assert res["methods"]["forge-bf16"]["ratios"]["ms_vs_ref_mean"] == round(
        res["methods"]["forge-bf16"]["ms_median"] / mean, 4)
    assert list(res["methods"]) == ["torch-foreach-adamw", "forge-bf16"]  # the repeat is not a method row
    assert "reference again (torch-foreach-adamw, run last)" in capsys.readouterr().out


@pytest.mark.slow
def test_compile_mode_reaches_the_worker_and_the_results(tmp_path, capsys):
    """--compile-mode is passed to each method's process (its torch.compile) and recorded; on CPU,
    reduce-overhead has no CUDA graphs to replay and must still train."""
    out = tmp_path / "run"
    rc = bench.main(["--device", "cpu", "--model", "tiny", "--layers", "1", "--batch-size", "1", "--seq-len", "16",
                     "--steps", "1", "--warmup", "1", "--methods", "forge", "--compile", "--compile-mode",
                     "reduce-overhead", "--no-plots", "--out-dir", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["compile"] is True and res["compile_mode"] == "reduce-overhead"
    assert res["methods"]["forge-bf16"]["status"] == "ok"
    assert res["methods"]["forge-bf16"]["compile_mode"] == "reduce-overhead"  # the worker's own record
    assert "mode='reduce-overhead'" in " ".join(res["notes"])
    assert "compiled (reduce-overhead)" in capsys.readouterr().out


def test_failures_are_reported_not_lost(tmp_path):
    """A worker that dies leaves an error row; the others' numbers stay in results.json."""
    results = {"methods": {"none": {"status": "ok", "ms_median": 10.0},
                           "torch-fused-adamw": {"status": "ok", "ms_median": 20.0, "peak_gib": 2.0},
                           "forge-bf16": {"status": "OOM", "peak_gib": 1.5},
                           "forge-int8": {"status": "error", "error": "boom"}},
               "model": "tiny", "batch_size": 1, "seq_len": 8, "compile": False, "activation_checkpointing": False,
               "device_type": "cpu", "date": "2026-12-02T00:00:00+00:00"}
    bench._add_ratios(results)
    assert results["reference"] == "torch-fused-adamw"
    assert results["methods"]["none"]["ratios"]["ms_vs_ref"] == 0.5
    table = bench.format_table(results)
    assert "OOM" in table and ">1.5" in table and "error" in table
    bench.plot_bars(results, tmp_path / "b.png")
    tl = [{"t_ms": 0.0, "phase": "start", "label": "start", "gib": 1.0},
          {"t_ms": 1.0, "phase": "backward", "label": "layer 0", "gib": 2.0},
          {"t_ms": 2.0, "phase": "step", "label": "step done", "gib": 1.5}]
    results["methods"]["torch-fused-adamw"]["timeline"] = tl
    bench.plot_timeline(results, tmp_path / "t.png")
    assert (tmp_path / "b.png").exists() and (tmp_path / "t.png").exists()


def test_loss_liger_is_refused_with_the_fix_named(monkeypatch):
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install liger-kernel"):
        bench.check_loss("liger", "cuda")
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit, match="needs --device cuda"):
        bench.check_loss("liger", "cpu")
    bench.check_loss("liger", "cuda")  # found, on a GPU: accepted
    bench.check_loss("hf", "cpu")
    with pytest.raises(SystemExit):  # argparse: not a loss we know
        bench.build_parser().parse_args(["--loss", "chunked"])


_LIGER_VS_HF = r"""
import torch
from transformers.loss.loss_utils import ForCausalLMLoss
from forge_optim.cli.bench import liger_causal_lm_loss
torch.manual_seed(0)
V = 300
labels = torch.randint(0, V, (2, 9)); labels[0, 3] = -100; labels[1, 5:] = -100
# bf16 logits for the mean (the bench's call: loss.backward() with grad 1); the sum / num_items path in
# fp32, because its backward scales the bf16 gradient in a Triton kernel, and bf16 arithmetic is wrong
# under the interpreter (DESIGN.md), not on the GPU
for n_items, dtype in ((None, torch.bfloat16), (torch.tensor(11), torch.float32)):
    base = torch.randn(2, 9, V).to(dtype)
    a = base.clone().requires_grad_(); b = base.clone().requires_grad_()
    la = ForCausalLMLoss(a * 1, labels, V, num_items_in_batch=n_items)   # * 1: a non-leaf, like lm_head's output
    lb = liger_causal_lm_loss(b * 1, labels, V, num_items_in_batch=n_items)
    la.backward(); lb.backward()
    assert b.grad.dtype == dtype
    rel = abs(lb.float().item() - la.item()) / la.item()
    gerr = (a.grad.float() - b.grad.float()).abs().max().item() / a.grad.float().abs().max().item()
    assert rel < 8e-3 and gerr < 1e-2, (n_items, rel, gerr)
    print("ok", n_items, rel, gerr)
"""


def test_liger_loss_matches_hugging_face_causal_lm_loss():
    """--loss liger computes the model's own loss (shift, ignore_index, mean or sum / num_items) and its
    gradient, to bf16 round-off; run under Triton's interpreter in a child process (it must be set
    before triton is imported)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("liger_kernel", reason="Liger-Kernel is in the [test] extra")
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = str(Path(bench.__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-c", _LIGER_VS_HF], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == 2


def test_kernel_configs_say_which_config_ran_and_where_it_came_from():
    from types import SimpleNamespace

    from forge_optim.kernels.launch import SMALL_BT_CONFIGS, Tuner

    t = Tuner()
    k1, k2, k3 = ((8, 64), 512), ((16, 64), 512), ((32, 64), 512)
    t.cache = {k1: SMALL_BT_CONFIGS[0], k2: SMALL_BT_CONFIGS[1], k3: SMALL_BT_CONFIGS[2]}
    t.timings = {k1: [(SMALL_BT_CONFIGS[0].short(), None, "tuned on the whole weight: nvidia_h200.json")],
                 k2: [(SMALL_BT_CONFIGS[1].short(), 0.1, ""), (SMALL_BT_CONFIGS[0].short(), 0.2, "")]}
    opt = SimpleNamespace(_backends={"cuda:0": SimpleNamespace(tuner=t), "cpu": SimpleNamespace()})
    got = bench.kernel_configs(opt)
    assert got == {repr(k1): {"config": SMALL_BT_CONFIGS[0].short(), "source": "table"},
                   repr(k2): {"config": SMALL_BT_CONFIGS[1].short(), "source": "sub-problem"},
                   repr(k3): {"config": SMALL_BT_CONFIGS[2].short(), "source": "only candidate"}}


def test_gpu_activity_keeps_inductor_kernels_and_drops_annotations():
    """Inductor names a range after each Triton kernel it launches; the kernel must still count as
    GPU time (a name-based filter dropped every compiled elementwise kernel and torchao's compiled
    step), while GPU-side user annotations (record_function ranges) must not count twice."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name, dev, annotation):
        return SimpleNamespace(name=name, device_type=dev, is_user_annotation=annotation)

    events = [
        ev("triton_poi_fused_add_0", DeviceType.CPU, True),        # inductor's range around the launch
        ev("triton_poi_fused_add_0", DeviceType.CUDA, False),      # the kernel itself
        ev("Optimizer.step#AdamW.step", DeviceType.CPU, True),
        ev("Optimizer.step#AdamW.step", DeviceType.CUDA, True),    # GPU-side annotation spanning kernels
        ev("multi_tensor_apply_kernel", DeviceType.CUDA, False),
        ev("ProfilerStep#1", DeviceType.CUDA, False),
    ]
    kept = [e.name for e in bench.gpu_activity(events)]
    assert kept == ["triton_poi_fused_add_0", "multi_tensor_apply_kernel"]
    # a torch whose events carry no annotation flag: the name test is all there is
    old = [SimpleNamespace(name=e.name, device_type=e.device_type, is_user_annotation=None) for e in events]
    assert [e.name for e in bench.gpu_activity(old)] == ["multi_tensor_apply_kernel"]


# ---- bad flags: a usage error (exit status 2), before any model is built or method started -------

@pytest.fixture
def no_run(monkeypatch):
    """run_parsed records its namespace instead of benchmarking: a check that lets a bad flag through
    fails the test rather than starting method processes."""
    seen = []
    monkeypatch.setattr(bench, "run_parsed", lambda ns, argv=None: seen.append(ns) or 0)
    return seen


def bench_usage_error(capsys, argv, entry=None) -> str:
    with pytest.raises(SystemExit) as e:
        (entry or bench.main)(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("usage: forge-optim bench")
    return err.split("forge-optim bench: error: ", 1)[1]


def test_unknown_model_lists_the_names(capsys, no_run):
    from forge_optim.cli.main import main as cli_main

    for entry, argv in ((bench.main, ["--model", "Llama-3"]), (cli_main, ["bench", "--model", "Llama-3"])):
        msg = bench_usage_error(capsys, argv, entry)
        assert "unknown --model 'Llama-3'" in msg and "--config" in msg
        for name in bench_models.model_names():
            assert name in msg
    assert "use --config cfg.json" in bench_usage_error(capsys, ["--model", "cfg.json"])
    assert not no_run


def test_config_file_is_still_accepted_and_checked(tmp_path, capsys, no_run):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(bench_models.MODELS["tiny"]))
    assert bench.main(["--config", str(path), "--device", "cpu"]) == 0
    assert no_run[0].config == str(path)
    assert "file not found" in bench_usage_error(capsys, ["--config", str(tmp_path / "nope.json")])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    assert "needs 'model_type'" in bench_usage_error(capsys, ["--config", str(bad)])
    assert len(no_run) == 1


@pytest.mark.parametrize("argv, want", [
    (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be an integer >= 0, got -1"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--seq-len", "-4"], "--seq-len must be an integer >= 1"),
    (["--profile-steps", "-1"], "--profile-steps must be an integer >= 0"),
    (["--layers", "0"], "--layers must be a positive integer"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--weight-decay", "-1"], "--weight-decay must be a number >= 0"),
    (["--method-timeout", "0"], "--method-timeout must be a positive number"),
    (["--time-budget", "-5"], "--time-budget must be a positive number"),
    (["--methods", "forge,sgd"], "--methods: unknown method 'sgd'; choose from none, forge-bf16"),
    (["--timeline-methods", "adam"], "--timeline-methods: unknown method 'adam'"),
    (["--plot-only", "nope/results.json"], "--plot-only nope/results.json: file not found"),
])
def test_bad_bench_flags_are_usage_errors(capsys, no_run, argv, want):
    assert want in bench_usage_error(capsys, ["--device", "cpu", "--model", "tiny", *argv])
    assert not no_run


def test_bench_device_cuda_without_cuda(capsys, no_run, monkeypatch):
    monkeypatch.setattr(bench, "_cuda_available", lambda: False)
    msg = bench_usage_error(capsys, ["--device", "cuda"])
    assert "CUDA is not available" in msg and "--device cpu" in msg
    bench_usage_error(capsys, ["--device", "gpu"])  # argparse: not one of auto, cuda, cpu
    assert not no_run
