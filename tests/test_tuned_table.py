"""The shipped tables of configs tuned on the whole weight (kernels/tuned.py, kernels/tuned/*.json)."""
import ast
import json

import pytest
import torch
import torch.nn as nn

import forge_optim
from forge_optim.backends.triton_backend import launch_kwargs, tuning_key
from forge_optim.kernels import launch as launch_mod
from forge_optim.kernels import pingpong as PP
from forge_optim.kernels import tuned
from forge_optim.kernels.launch import (ELEMENTWISE_CONFIGS, LARGE_BT_CONFIGS, MID_BT_CONFIGS, SMALL_BT_CONFIGS,
                                        KernelConfig, Tuner)

SHIPPED = sorted(tuned.TABLE_DIR.glob("*.json"))
ALL_CANDIDATES = set(SMALL_BT_CONFIGS + MID_BT_CONFIGS + LARGE_BT_CONFIGS + ELEMENTWISE_CONFIGS)


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """An empty table directory in place of the shipped one, an empty user directory beside it (and
    no cached tables)."""
    monkeypatch.setattr(tuned, "TABLE_DIR", tmp_path)
    monkeypatch.setenv("FORGE_TUNED_DIR", str(tmp_path / "user"))
    tuned.load_table.cache_clear()
    yield tmp_path
    tuned.load_table.cache_clear()


def _write(dirpath, device, entries):
    path = dirpath / tuned.table_path(device).name
    path.write_text(json.dumps(dict(device=device, entries=entries)))
    return path


KEY = ((4096, 4096), 512, "torch.bfloat16", "torch.bfloat16", "AdamW", (2, 2, 0), False, True, True, True)
CFG = KernelConfig(128, 256, 64, 16, 3, 8, 1, 8)


def test_table_path_is_the_device_name_in_lower_snake_case():
    assert tuned.table_path("NVIDIA H200").name == "nvidia_h200.json"
    assert tuned.table_path("NVIDIA GeForce RTX 4090").name == "nvidia_geforce_rtx_4090.json"


def test_lookup_answers_only_the_exact_key_on_the_named_device(table_dir, monkeypatch):
    from dataclasses import asdict

    _write(table_dir, "Dev X", [dict(key=tuned.key_text(KEY), config=asdict(CFG))])
    assert tuned.lookup(KEY, "Dev X") == CFG
    assert tuned.lookup(KEY, "Dev Y") is None  # no table for that device
    other = (KEY[0], 8192) + KEY[2:]
    assert tuned.lookup(other, "Dev X") is None  # another BT regime
    monkeypatch.setenv("FORGE_TUNED_TABLE", "0")
    assert tuned.lookup(KEY, "Dev X") is None  # turned off


def test_lookup_reads_a_pingpong_entry_as_its_config(table_dir):
    """An entry whose config names the Gluon ping-pong kernel comes back as a PingPongConfig (the backend
    launches that kernel for the key), not as a Triton KernelConfig."""
    want = PP.CANDIDATES[-1]
    _write(table_dir, "Dev X", [dict(key=tuned.key_text(KEY), config=PP.table_dict(want))])
    got = tuned.lookup(KEY, "Dev X")
    assert isinstance(got, PP.PingPongConfig) and got == want


def test_a_stale_or_foreign_table_is_ignored_with_a_warning(table_dir):
    path = _write(table_dir, "Dev X", [dict(key=tuned.key_text(KEY), config=dict(BM=128, BN=100))])
    with pytest.warns(UserWarning, match="no longer valid"):
        assert tuned.lookup(KEY, "Dev X") is None  # BN not a multiple of 64: KernelConfig refuses it
    path.write_text(json.dumps(dict(device="Dev Z", entries=[])))
    tuned.load_table.cache_clear()
    with pytest.warns(UserWarning, match="ignoring the tuned-config table"):
        assert tuned.lookup(KEY, "Dev X") is None  # the file's device is not the one asked for
    path.write_text("{not json")
    tuned.load_table.cache_clear()
    with pytest.warns(UserWarning, match="ignoring"):
        assert tuned.lookup(KEY, "Dev X") is None


def test_tuner_takes_the_shipped_config_after_one_trial_launch(table_dir, monkeypatch):
    """A table hit launches the config once on clones (compiles it, proves it fits) and times nothing."""
    from dataclasses import asdict

    _write(table_dir, "Dev X", [dict(key=tuned.key_text(KEY), config=asdict(CFG))])
    monkeypatch.setattr(launch_mod, "_INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Dev X")
    launched = []
    t = Tuner()
    t.forced = None
    cfg = t.pick(KEY, 512, lambda c: (lambda: launched.append(c)))
    assert cfg == CFG and launched == [CFG]
    assert "whole weight" in t.timings[KEY][0][2]
    assert t.pick(KEY, 512, lambda c: (lambda: launched.append(c))) == CFG and launched == [CFG]  # cached


def test_tuner_falls_back_when_the_shipped_config_fails(table_dir, monkeypatch):
    from dataclasses import asdict

    _write(table_dir, "Dev X", [dict(key=tuned.key_text(KEY), config=asdict(CFG))])
    monkeypatch.setattr(launch_mod, "_INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Dev X")
    only = SMALL_BT_CONFIGS[1]
    monkeypatch.setattr(launch_mod, "candidate_configs", lambda bt: (only,))  # one candidate: no timing

    def run_on_clones(c):
        def fn():
            if c == CFG:
                raise RuntimeError("out of shared memory")
        return fn

    t = Tuner()
    t.forced = None
    assert t.pick(KEY, 512, run_on_clones) == only
    assert "shipped config failed" in t.timings[KEY][0][2]


def _optimizer_key(state_dtype, monkeypatch, M=64, N=128, BT=16):
    """The tuning key the optimizer's update of one bf16 Linear makes (CPU: the torch backend's
    update is spied on, the job then keyed as TritonBackend would key it)."""
    from forge_optim.backends.torch_backend import TorchBackend

    caught = []
    orig = TorchBackend.update

    def spy(self, job, dy, x):
        caught.append((job, dy, x))
        return orig(self, job, dy, x)

    monkeypatch.setattr(TorchBackend, "update", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(N, M, bias=False).to(torch.bfloat16))
    forge_optim.AdamW(model, lr=1e-3, state_dtype=state_dtype, backend="torch")
    model(torch.randn(BT, N, dtype=torch.bfloat16)).float().square().mean().backward()
    job, dy, x = caught[0]
    return tuning_key(job, dy, launch_kwargs(job, dy, x))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_table_keys_are_the_keys_the_optimizer_makes(path, monkeypatch):
    """Every entry of a shipped table is reachable: apart from its shape and BT regime, its key is the
    one forge_optim.AdamW's default update (bf16 weight, stochastic rounding, non-finite count) makes
    for its state mode; its config is one of the tuner's candidates, and a ping-pong one runs as named
    (it fits in shared memory with bf16 W and two bf16 states, so the launch does not shrink it)."""
    data = json.loads(path.read_text())
    assert data["device"] and data["entries"]
    made = {mode: _optimizer_key(mode, monkeypatch) for mode in ("bf16", "int8")}
    for e in data["entries"]:
        key = ast.literal_eval(e["key"])
        mode = e["states"]
        assert key[0] == tuple(int(v) for v in e["shape"].split("x"))
        assert key[1] == launch_mod.bt_regime(e["BT"])
        assert key[2:] == made[mode][2:], (e["key"], made[mode])
        if e["config"].get("kernel") == "pingpong":  # the Gluon kernel: bf16/fp32 states only
            cfg = PP.from_table(e["config"])
            assert mode == "bf16" and cfg in PP.CANDIDATES and PP.fit_config(cfg, 2, 4) == cfg, e
        else:
            assert KernelConfig(**e["config"]) in ALL_CANDIDATES


def _gpu_adam_job(M, N, seed=3, step=5):
    """A bf16-state AdamW update of a random [M, N] bf16 weight on the GPU (the optimizer's defaults)."""
    from forge_optim import precision
    from forge_optim.backends.base import StateView, UpdateJob
    from forge_optim.rules import RULES

    rule = RULES["AdamW"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(M, N, device="cuda", generator=g) * 0.02).bfloat16()
    views = [StateView(sp, (torch.randn(M, N, device="cuda", generator=g) * 1e-3).abs().bfloat16())
             for sp in rule.state_specs(dict(rule.defaults))]
    return UpdateJob(weight=w, rule=rule, coeffs=rule.padded(rule.coefficients(dict(rule.defaults), {}, step)),
                     states=views, stochastic_weight=True, stochastic_state=True,
                     key_weight=precision.stream_key(1, 2, step, 0),
                     key_states=(precision.stream_key(1, 2, step, 1), precision.stream_key(1, 2, step, 2), 0),
                     nonfinite=torch.zeros((), dtype=torch.int64, device="cuda"))


@pytest.mark.gpu
def test_gpu_backend_takes_the_shipped_config_on_a_tabled_shape():
    """On a device with a shipped table, the first update of a tabled shape runs the table's config
    (no sub-problem timing), and writes what the same config writes when forced."""
    from forge_optim.backends.triton_backend import TritonBackend

    name = torch.cuda.get_device_name()
    table = tuned.load_table(name)
    if not table:
        pytest.skip(f"no shipped table for {name}")
    M, N, BT = 4096, 4096, 512
    gen = torch.Generator(device="cuda").manual_seed(3)
    dy = torch.randn(BT, M, device="cuda", generator=gen).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=gen).bfloat16()
    a, b = _gpu_adam_job(M, N), _gpu_adam_job(M, N)
    key = tuning_key(a, dy, launch_kwargs(a, dy, x))
    if tuned.key_text(key) not in table:
        pytest.skip(f"{name}'s table has no entry for {key}")
    be = TritonBackend()
    be.update(a, dy, x)
    want = tuned.lookup(key, name)
    assert be.tuner.cache[key] == want
    assert "whole weight" in be.tuner.timings[key][0][2]
    forced = TritonBackend(config=want)
    forced.update(b, dy, x)
    torch.cuda.synchronize()
    assert torch.equal(a.weight, b.weight)
    assert all(torch.equal(va.data, vb.data) for va, vb in zip(a.states, b.states))


def test_a_user_table_overrides_the_shipped_one(table_dir):
    from dataclasses import asdict

    other = KernelConfig(128, 128, 64, 8, 3, 8, 1, 4)
    _write(table_dir, "Dev X", [dict(key=tuned.key_text(KEY), config=asdict(CFG))])
    assert tuned.lookup(KEY, "Dev X") == CFG
    user = tuned.user_table_path("Dev X")
    assert user.parent == table_dir / "user"
    user.parent.mkdir()
    _write(user.parent, "Dev X", [dict(key=tuned.key_text(KEY), config=asdict(other))])
    tuned.load_table.cache_clear()
    assert tuned.lookup(KEY, "Dev X") == other


def test_user_table_dir_defaults_to_the_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("FORGE_TUNED_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuned.user_table_path("NVIDIA H200") == tmp_path / "forge_optim" / "tuned" / "nvidia_h200.json"


def test_linear_shapes_are_the_fused_linears_of_the_published_configs():
    from forge_optim.bench_models import config_dict
    from forge_optim.kernels.tune import linear_shapes

    assert linear_shapes(config_dict("Llama-3.1-8B")) == [(4096, 4096), (1024, 4096), (14336, 4096),
                                                         (4096, 14336), (128256, 4096)]
    # Qwen3-0.6B ties its lm_head to the embedding (not fused: patch.py); 16 heads of 128 > hidden 1024
    assert linear_shapes(config_dict("Qwen3-0.6B")) == [(2048, 1024), (1024, 1024), (1024, 2048), (3072, 1024),
                                                       (1024, 3072)]
    assert (151936, 5120) in linear_shapes(config_dict("Qwen3-14B"))


def test_write_table_merges_with_this_devices_entries(tmp_path, monkeypatch):
    from forge_optim.kernels import tune

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Dev X")
    path = tmp_path / "t.json"
    e1 = dict(key="k1", shape="8x64", BT=512, states="bf16", config={"BM": 128}, ms=1.0, timings_ms={})
    e2 = dict(e1, key="k2")
    tune.write_table([e1, e2], path)
    tune.write_table([dict(e1, ms=0.5)], path)  # re-tuned k1: replaced; k2 kept
    data = json.loads(path.read_text())
    assert data["device"] == "Dev X" and data["source_digest"]
    assert sorted((e["key"], e["ms"]) for e in data["entries"]) == [("k1", 0.5), ("k2", 1.0)]
    tune.write_table([e2], path, merge=False)
    assert [e["key"] for e in json.loads(path.read_text())["entries"]] == ["k2"]


def test_tune_cli_refuses_bad_input_and_a_machine_without_a_gpu(monkeypatch, capsys):
    from forge_optim.cli.main import main

    for argv, msg in ((["--states", "fp8"], "--states takes bf16"), (["--bts", "512,x"], "--bts takes"),
                      (["--bts", "0"], "--bts takes"), (["--model", "no-such"], "no-such")):
        with pytest.raises(SystemExit, match=msg):
            main(["tune"] + argv)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["tune", "--model", "Qwen3-0.6B"])


@pytest.mark.gpu
def test_gpu_tune_writes_a_table_that_the_next_update_takes(tmp_path, monkeypatch):
    """forge-optim tune on one small shape: the winner lands in the user table, and a fresh backend's
    first update of that shape runs it without timing sub-problems."""
    from forge_optim.backends.triton_backend import TritonBackend
    from forge_optim.kernels import tune

    monkeypatch.setenv("FORGE_TUNED_DIR", str(tmp_path))
    tuned.load_table.cache_clear()
    M, N, BT = 1024, 4096, 512
    entries = tune.tune_entries([(M, N)], [BT], ["bf16"], rep=10)
    name = torch.cuda.get_device_name()
    tune.write_table(entries, tuned.user_table_path(name))
    assert len(entries) == 1 and entries[0]["ms"] > 0
    job = _gpu_adam_job(M, N, seed=0)
    g = torch.Generator(device="cuda").manual_seed(1)
    dy = torch.randn(BT, M, device="cuda", generator=g).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=g).bfloat16()
    be = TritonBackend()
    be.update(job, dy, x)
    key = tuning_key(job, dy, launch_kwargs(job, dy, x))
    assert be.tuner.cache[key] == tuned.lookup(key, name)  # a KernelConfig, or the ping-pong kernel's
    assert "whole weight" in be.tuner.timings[key][0][2]
    if torch.cuda.get_device_capability()[0] == 9:  # the ping-pong schedules were timed beside the Triton tiles
        assert any(k.startswith("pingpong") for k in entries[0]["timings_ms"])
    tuned.load_table.cache_clear()


def test_tune_adds_the_pingpong_kernel_where_it_can_run(monkeypatch):
    """bf16 states, 0 < BT <= 2048, Hopper: the ping-pong schedules join the candidates (and are stored in
    their named table form); int8 states, BT=0, large BT, other GPUs, or FORGE_TUNE_PINGPONG=0: they do not."""
    from dataclasses import asdict

    from forge_optim.kernels import tune

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert tune.pingpong_candidates(512, "bf16") == PP.CANDIDATES
    assert tune.pingpong_candidates(2048, "bf16") == PP.CANDIDATES
    for bt, mode in ((512, "int8"), (0, "bf16"), (4096, "bf16")):
        assert tune.pingpong_candidates(bt, mode) == []
    monkeypatch.setenv("FORGE_TUNE_PINGPONG", "0")
    assert tune.pingpong_candidates(512, "bf16") == []
    monkeypatch.delenv("FORGE_TUNE_PINGPONG")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert tune.pingpong_candidates(512, "bf16") == []
    assert tuned.config_dict(PP.CANDIDATES[0]) == PP.table_dict(PP.CANDIDATES[0])
    assert tuned.config_dict(CFG) == asdict(CFG)
