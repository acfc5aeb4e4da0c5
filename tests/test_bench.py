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
                     "--steps", "3", "--warmup", "1", "--methods", "none,forge,torch-foreach-adamw,flashoptim",
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
        assert r["ms_median"] > 0 and len(r["ms_all"]) == 3 and r["ms_iqr"][0] <= r["ms_median"] <= r["ms_iqr"][1]
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0
        assert r["memory"] == "needs CUDA" and "peak_gib" not in r
        hc = r["host_cpu"]  # where the host's time went during the timed steps (Linux /proc)
        assert hc["wall_s"] > 0 and hc["threads"] and hc["process_cpu_s"] > 0
        assert 0 <= hc["machine_busy_share"] <= 1
    assert res["methods"]["forge-bf16"]["fused_modules"] == 2 * 7 + 1
    assert res["methods"]["flashoptim"]["status"] == "skipped (not installed)"
    assert res["reference"] == "torch-foreach-adamw"
    assert res["methods"]["forge-bf16"]["ratios"]["ms_vs_ref"] > 0
    assert any("memory" in n and "CUDA" in n for n in res["notes"])
    assert (out / "bars.png").stat().st_size > 5000
    text = capsys.readouterr().out
    assert "skipped (not installed)" in text and "forge-bf16" in text and "ms/step" in text


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
