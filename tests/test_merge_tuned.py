"""CPU tests of benchmarks/merge_tuned.py, the script that merges a re-tune into a shipped config table."""
import pytest

from helpers import load_benchmark

merge_tuned = load_benchmark("merge_tuned")


def _entry(key, timings):
    best = min(timings, key=timings.get)
    return dict(key=key, shape="4096x4096", BT=512, states="int8", config=dict(name=best), ms=timings[best],
                timings_ms=timings)


def test_merge_replaces_same_keys_keeps_others_and_notes_it():
    shipped = dict(device="Dev X", merged="earlier merge",
                   entries=[_entry("a", {"c1": 1.0, "c2": 1.1}), _entry("b", {"c1": 2.0})])
    retune = dict(device="Dev X", date="2026-12-07T03:00:00", command="tune_shapes.py --bts 512",
                  source_digest="abc", entries=[_entry("a", {"c1": 1.05, "c2": 0.9}), _entry("z", {"c3": 3.0})])
    out, changes = merge_tuned.merge(shipped, retune, "why")
    assert [e["key"] for e in out["entries"]] == ["a", "b", "z"]  # order kept, the new key appended
    assert out["entries"][0]["config"] == dict(name="c2") and out["entries"][1] is shipped["entries"][1]
    assert out["merged"].startswith("earlier merge | 2026-12-07: 2 entries replaced by tune_shapes.py")
    assert "c1 (1.0000 ms then) -> c2 (0.9000 ms; the old winner 1.0500)" in changes[0]
    assert "new key" in changes[1]
    assert shipped["entries"][0]["config"] == dict(name="c1")  # the input is not modified


def test_merge_refuses_another_devices_retune():
    with pytest.raises(SystemExit, match="device mismatch"):
        merge_tuned.merge(dict(device="Dev X", entries=[]), dict(device="Dev Y", entries=[]), "why")
