"""CPU tests of benchmarks/fidelity.py on tiny settings (the GPU study runs the same code paths)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_benchmark

fidelity = load_benchmark("fidelity")

RULES = ["AdamW", "Adam", "NAdam", "RAdam", "Lion", "RMSprop", "Adagrad", "SGD"]


def _load(d, part):
    return json.loads((Path(d) / f"fidelity-{part}.json").read_text())


def test_exactness_all_rules_fp32(tmp_path):
    fidelity.main(["exactness", "--shapes", "40x72,24x64", "--steps", "3", "--bt", "16", "--backend", "torch",
                   "--device", "cpu", "--out-dir", str(tmp_path)])
    j = _load(tmp_path, "exactness")
    assert j["part"] == "exactness" and j["complete"] and j["meta"]["device"] == "cpu"
    assert {(u["rule"], u["shape"]) for u in j["units"]} == {(r, s) for r in RULES for s in ("40x72", "24x64")}
    for u in j["units"]:
        assert len(u["steps"]) == 3 and [s["step"] for s in u["steps"]] == [1, 2, 3]
        assert all(s["finite"] for s in u["steps"])
        assert u["max_rel"] < 1e-5, (u["rule"], u["shape"], u["max_rel"])
        assert u["max_rel"] == max(s["max_rel"] for s in u["steps"])
    # resume: a second call with the same out-dir recomputes nothing
    fidelity.main(["exactness", "--shapes", "40x72,24x64", "--steps", "3", "--bt", "16", "--backend", "torch",
                   "--device", "cpu", "--out-dir", str(tmp_path)])
    j2 = _load(tmp_path, "exactness")
    assert [u["seconds"] for u in j2["units"]] == [u["seconds"] for u in j["units"]]


def test_exactness_time_budget_keeps_json(tmp_path):
    fidelity.main(["exactness", "--shapes", "8x16", "--rules", "AdamW,SGD", "--steps", "1", "--bt", "4",
                   "--backend", "torch", "--device", "cpu", "--out-dir", str(tmp_path), "--time-budget", "0"])
    j = _load(tmp_path, "exactness")
    assert not j["complete"] and len(j["skipped"]) == 2 and j["units"] == []


def test_stochastic_rounding_dead_zone(tmp_path):
    fidelity.main(["stochastic-rounding", "--shape", "64x128", "--backend", "torch", "--device", "cpu",
                   "--out-dir", str(tmp_path)])
    j = _load(tmp_path, "stochastic-rounding")
    assert j["complete"] and j["ulp"] == 2.0 ** -8 and j["step"] == 2.0 ** -10 and j["steps"] == 100
    exp = j["expected_mean_change"]
    assert exp == pytest.approx(-100 * 2.0 ** -10)
    runs = j["runs"]
    assert runs["fp32-reference"]["mean_change"] == pytest.approx(exp, rel=1e-6)
    assert abs(runs["forge-sr"]["mean_change"] / exp - 1) < 0.02
    assert runs["forge-rne"]["mean_change"] == 0.0 and runs["forge-rne"]["frac_unchanged"] == 1.0
    assert runs["torch-bf16"]["mean_change"] == 0.0
    assert len(runs["forge-sr"]["curve"]) == 100
    assert j["kernel_cost"]["measured"] is False and "CPU" in j["kernel_cost"]["reason"]


def test_corpus_split_by_file_is_deterministic_and_disjoint():
    paths = fidelity.list_stdlib_files()
    assert len(paths) > 100 and paths == sorted(paths) and paths == fidelity.list_stdlib_files()
    assert not any("site-packages" in p for p in paths)
    train, val = fidelity.split_files(paths, 5.0)
    train2, val2 = fidelity.split_files(list(reversed(paths)), 5.0)
    assert sorted(train) == sorted(train2) and sorted(val) == sorted(val2)  # independent of order
    assert not set(train) & set(val) and set(train) | set(val) == set(paths)
    assert 0.02 < len(val) / len(paths) < 0.09
    # the split is a function of the path alone (same on every machine)
    assert fidelity.is_held_out("os.py", 5.0) == fidelity.is_held_out("os.py", 5.0)
    assert fidelity.split_files(["a.py", "b/c.py", "d.py"], 100.0) == ([], ["a.py", "b/c.py", "d.py"])
    assert fidelity.split_files(["a.py", "b/c.py"], 0.0) == (["a.py", "b/c.py"], [])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("fid")
    fidelity.main(["convergence", "--preset", "tiny", "--steps", "6", "--eval-every", "3", "--warmup", "2",
                   "--methods", "fp32-master,forge-bf16-sr,bnb-adamw8bit", "--extra-seeds", "", "--device", "cpu",
                   "--out-dir", str(out), "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2"])
    return out


def test_convergence_schema_and_checkpoint(trained):
    j = _load(trained, "convergence")
    assert j["part"] == "convergence" and j["smoke"] and j["complete"]
    assert j["corpus"]["n_val_files"] > 0 and j["corpus"]["val_bytes"] > 0
    runs = {r["method"]: r for r in j["runs"]}
    assert set(runs) == {"fp32-master", "forge-bf16-sr", "bnb-adamw8bit"}
    for m in ("fp32-master", "forge-bf16-sr"):
        r = runs[m]
        assert r["complete"] and r["steps_done"] == 6 and [s for s, _ in r["train"]] == list(range(1, 7))
        assert [s for s, _ in r["eval"]] == [0, 3, 6]
        assert r["final_eval"] == r["eval"][-1][1] and r["final_eval"] < r["eval"][0][1] + 0.5
        assert j["summary"][m]["n"] == 1
    # same init and same held-out windows: step-0 held-out losses agree up to the bf16 cast
    assert runs["fp32-master"]["eval"][0][1] == pytest.approx(runs["forge-bf16-sr"]["eval"][0][1], abs=0.02)
    assert runs["forge-bf16-sr"]["optimizer"]["fused_modules"] > 0
    if not fidelity.method_available("bnb-adamw8bit", fidelity.torch.device("cpu")) is None:
        assert runs["bnb-adamw8bit"]["skipped"]
    assert (trained / "ckpt-fp32-master-s0.pt").exists()


def test_low_lr_and_report(trained, tmp_path):
    fidelity.main(["low-lr", "--preset", "tiny", "--steps-low", "4", "--eval-every-low", "2", "--device", "cpu",
                   "--out-dir", str(trained), "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2",
                   "--methods", "fp32-master,forge-bf16-sr,forge-bf16-rne"])
    j = _load(trained, "low-lr")
    assert j["complete"] and j["lr"] == 1e-5 and j["steps"] == 4
    s = j["summary"]
    assert set(s) == {"fp32-master", "forge-bf16-sr", "forge-bf16-rne"}
    assert s["fp32-master"]["gap_to_fp32_master"] == 0.0
    for m in s.values():
        assert {"start", "final", "gap_pct_of_final", "improvement_pct_of_fp32_master"} <= set(m)
    doc = tmp_path / "docs" / "fidelity.md"
    merged = tmp_path / "fidelity-test.json"
    fidelity.main(["report", "--in-dir", str(trained), "--tag", "test", "--json", str(merged), "--doc", str(doc),
                   "--fig-dir", str(tmp_path / "docs")])
    m = json.loads(merged.read_text())
    assert set(m["parts"]) == {"convergence", "low-lr"}
    text = doc.read_text()
    for block in fidelity.AUTO_BLOCKS:
        assert f"<!-- BEGIN AUTO {block} -->" in text and f"<!-- END AUTO {block} -->" in text
    assert "| fp32-master | " in text and "CPU smoke run" in text and "| forge-bf16-rne |" in text
    assert (tmp_path / "docs" / "fidelity-test-convergence.png").stat().st_size > 1000
    assert (tmp_path / "docs" / "fidelity-test-low-lr.png").exists()
    # a second report keeps hand-written text outside the blocks and replaces the blocks in place
    doc.write_text("# Title\n\nprose\n\n" + text.split("\n", 1)[1])
    fidelity.main(["report", "--results", str(merged), "--doc", str(doc), "--fig-dir", str(tmp_path / "docs")])
    text2 = doc.read_text()
    assert text2.startswith("# Title\n\nprose") and text2.count("<!-- BEGIN AUTO convergence -->") == 1


def test_convergence_records_a_failing_method_and_goes_on(tmp_path, monkeypatch):
    real = fidelity.build_optimizer

    def broken(method, *a, **kw):
        if method == "forge-int8":
            raise RuntimeError("kernel did not compile")
        return real(method, *a, **kw)

    monkeypatch.setattr(fidelity, "build_optimizer", broken)
    fidelity.main(["convergence", "--preset", "tiny", "--steps", "2", "--eval-every", "1", "--warmup", "1",
                   "--methods", "forge-int8,fp32-master", "--extra-seeds", "", "--device", "cpu", "--no-checkpoint",
                   "--out-dir", str(tmp_path), "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1"])
    j = _load(tmp_path, "convergence")
    runs = {r["method"]: r for r in j["runs"]}
    assert "kernel did not compile" in runs["forge-int8"]["error"] and not runs["forge-int8"]["complete"]
    assert runs["fp32-master"]["complete"] and not j["complete"]


def test_convergence_parallel_workers(tmp_path):
    """The device path: runs as subprocess workers, merged into one part file."""
    fidelity.main(["convergence", "--preset", "tiny", "--steps", "3", "--eval-every", "3", "--warmup", "1",
                   "--methods", "fp32-master,forge-bf16-rne", "--extra-seeds", "", "--device", "cpu", "--parallel", "2",
                   "--threads", "1", "--no-checkpoint", "--out-dir", str(tmp_path), "--batch-size", "2",
                   "--seq-len", "16", "--eval-batches", "1"])
    j = _load(tmp_path, "convergence")
    assert j["complete"] and j["parallel"] == 2
    assert sorted(r["method"] for r in j["runs"]) == ["forge-bf16-rne", "fp32-master"]
    assert all(r["steps_done"] == 3 and len(r["eval"]) == 2 for r in j["runs"])


def test_merge_parts_of_two_device_calls():
    a = dict(part="convergence", meta={"command": "a"}, methods=["fp32-master", "forge-bf16-sr"],
             runs=[dict(method="fp32-master", seed=0, complete=True), dict(method="forge-bf16-sr", seed=0, complete=False)])
    b = dict(part="convergence", meta={"command": "b"}, methods=["forge-bf16-sr", "forge-int8"],
             runs=[dict(method="forge-bf16-sr", seed=0, complete=True), dict(method="forge-int8", seed=0, complete=True)])
    m = fidelity.merge_part(a, b)
    assert m["methods"] == ["fp32-master", "forge-bf16-sr", "forge-int8"]
    assert sorted((r["method"], r["complete"]) for r in m["runs"]) == [
        ("forge-bf16-sr", True), ("forge-int8", True), ("fp32-master", True)]
    ea = dict(units=[dict(rule="AdamW", shape="8x8", complete=True)], skipped=[dict(rule="SGD", shape="8x8")])
    eb = dict(units=[dict(rule="SGD", shape="8x8", complete=True)], skipped=[])
    e = fidelity.merge_part(ea, eb)
    assert e["complete"] and len(e["units"]) == 2 and e["skipped"] == []
    e2 = fidelity.merge_part(dict(units=[], skipped=[dict(rule="Lion", shape="8x8")]), eb)
    assert not e2["complete"] and e2["skipped"] == [dict(rule="Lion", shape="8x8")]
