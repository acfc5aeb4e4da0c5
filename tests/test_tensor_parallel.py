"""Tensor and sequence parallelism (DTensor, gloo on CPU): the fused update of each rank's local shard
equals single-process torch.optim.AdamW, and the optimizer state round-trips through
torch.distributed.checkpoint."""
import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import adam_bound

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

TOL = 1e-5
STEPS = 5
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _data(step, vocab=64):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, vocab, (2, 8), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def _loss(model, step):
    idx, tgt = _data(step)
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def _train(model, opt, steps):
    for s in steps:
        _loss(model, s).backward()
        opt.step()
        opt.zero_grad()


def _full(p):
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def _max_rel(model, ref):
    """max over parameters of max|model - ref| / max|ref| (DTensors gathered first)."""
    return max(((_full(a) - _full(r)).abs().max() / _full(r).abs().max()).item()
               for a, r in zip(model.parameters(), ref.parameters()))


def _worker(rank, world, tmp, layout, state_dtype, save_checkpoint):
    import forge_optim
    from torch.distributed.device_mesh import init_device_mesh
    import sys

    sys.path.insert(0, EXAMPLES)
    from tp_llama import TinyLlama, parallelize

    ckpt_dir = os.path.join(tmp, "ckpt") if save_checkpoint else ""
    torch.manual_seed(0)
    base = TinyLlama()
    ref = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize(copy.deepcopy(base), mesh, sequence_parallel=(layout == "sequence"))
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    fused = set(opt.fused_modules())
    assert "layers.0.attention.wq" in fused and "layers.1.feed_forward.w2" in fused and "output" in fused, fused
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    # the noise floor of helpers.adam_bound: torch's own fused-vs-single-tensor gap, and the gap
    # that tensor parallelism alone opens (the same parallelized model stepped by torch.optim)
    ref_fused = copy.deepcopy(base)
    ref_fused_opt = torch.optim.AdamW(ref_fused.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    torch_tp = parallelize(copy.deepcopy(base), mesh, sequence_parallel=(layout == "sequence"))
    torch_tp_opt = torch.optim.AdamW(torch_tp.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)

    _train(model, opt, range(3))
    if ckpt_dir:  # save, continue; then a fresh model + optimizer loads and continues the same way
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt_dir)
    _train(model, opt, range(3, STEPS))
    _train(ref, ref_opt, range(STEPS))
    _train(ref_fused, ref_fused_opt, range(STEPS))
    _train(torch_tp, torch_tp_opt, range(STEPS))
    noise = max(_max_rel(ref_fused, ref), _max_rel(torch_tp, ref))
    same_layout = _max_rel(model, torch_tp)
    worst = _max_rel(model, ref)
    resumed = None
    if ckpt_dir:
        import torch.distributed.checkpoint as dcp

        torch.manual_seed(123)  # different init: everything must come from the checkpoint
        model2 = parallelize(TinyLlama(), mesh, sequence_parallel=(layout == "sequence"))
        opt2 = forge_optim.AdamW(model2, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
        _loss(model2, 0).backward()  # materialize states with the right placements
        opt2.step()
        opt2.zero_grad()
        sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
        dcp.load(sd, checkpoint_id=ckpt_dir)
        model2.load_state_dict(sd["model"])
        opt2.load_state_dict(sd["optim"])
        _train(model2, opt2, range(3, STEPS))
        resumed = 0.0
        for p, p2 in zip(model.parameters(), model2.parameters()):
            resumed = max(resumed, (_full(p) - _full(p2)).abs().max().item())
    return worst, resumed, (noise, same_layout)


def _rank_main(body, rank, world, tmp, *args_and_queue):
    """A spawned rank: joins the gloo group (its store in ``tmp``), runs ``body(rank, world, tmp, *args)``
    and queues ``(rank, its result, None)``, or ``(rank, None, traceback)`` instead of hanging the other
    ranks' assertions."""
    *args, q = args_and_queue
    try:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank,
                                world_size=world)
        q.put((rank, body(rank, world, tmp, *args), None))
    except Exception:
        import traceback

        q.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(body, world, *args):
    """``body(rank, world, tmp, *args)`` on ``world`` spawned ranks sharing the folder ``tmp`` (the gloo
    store, a checkpoint); fails on any rank's exception, else each rank's ``(rank, result)`` in arrival order."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(body, r, world, tmp, *args, q)) for r in range(world)]
        for p in procs:
            p.start()
        results = [q.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    errors = [err for _, _, err in results if err]
    assert not errors, errors[0]
    return [(rank, result) for rank, result, _ in results]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["tensor", "sequence"])
def test_tp_matches_single_process_adamw(world, layout):
    """Weights after 5 steps: against torch.optim on the same parallelized model (same shards, same
    collectives) to 1e-5; against single-process torch.optim within helpers.adam_bound of the gap
    that tensor parallelism alone opens for torch.optim itself."""
    for rank, (worst, _, (noise, same_layout)) in _spawn(_worker, world, layout, "fp32", False):
        print(f"rank {rank}: forge TP vs torch.optim TP {same_layout:.2e}; vs single process {worst:.2e} "
              f"(torch.optim TP vs single process {noise:.2e})")
        assert same_layout <= TOL, (rank, same_layout)
        assert worst <= adam_bound(noise, TOL), (rank, worst, noise)


def test_tp_optimizer_state_round_trips_through_dcp():
    for rank, (worst, resumed, (noise, same_layout)) in _spawn(_worker, 2, "sequence", "fp32", True):
        assert same_layout <= TOL and worst <= adam_bound(noise, TOL) and resumed == 0.0, (rank, worst, resumed)


def test_tp_int8_state_round_trips_through_dcp():
    for rank, (_, resumed, _) in _spawn(_worker, 2, "tensor", "int8", True):
        assert resumed == 0.0, (rank, resumed)


def _mixed_worker(rank, world, tmp):
    import sys

    import forge_optim
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, EXAMPLES)
    from tp_llama import TinyLlama, parallelize

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize(TinyLlama(), mesh["tp"], sequence_parallel=False)
    probe = forge_optim.AdamW(model)  # TP alone: the TP dims are fused
    n_fused = len(probe.fused_modules())
    probe.unpatch()
    fully_shard(model, mesh=mesh["dp"])  # add data parallelism on the other mesh dim
    try:
        forge_optim.AdamW(model)
        return n_fused, "not refused"
    except ValueError as err:
        return n_fused, str(err)


def test_tp_by_dp_mesh_fuses_tp_and_refuses_dp():
    for rank, (n_fused, msg) in _spawn(_mixed_worker, 4):
        assert n_fused == 15, (rank, n_fused, msg)
        assert "FSDP" in msg or "fully_shard" in msg, (rank, msg)


def _checkpoint_worker(rank, world, tmp, layout):
    import sys

    import forge_optim
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.checkpoint import checkpoint

    sys.path.insert(0, EXAMPLES)
    from tp_llama import TinyLlama, parallelize

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = TinyLlama()
    models = [parallelize(copy.deepcopy(base), mesh, sequence_parallel=(layout == "sequence")) for _ in range(2)]
    for block in models[0].layers:  # non-reentrant activation checkpointing of every block
        block.forward = (lambda x, f=block.forward: checkpoint(f, x, use_reentrant=False))
    opts = [forge_optim.AdamW(m, lr=1e-2, weight_decay=0.1) for m in models]
    for m, o in zip(models, opts):
        _train(m, o, range(STEPS))
    same = all(torch.equal(_full(a), _full(b)) for a, b in zip(*(m.parameters() for m in models)))
    clean = all(h.pending_fwd == 0 and h.pending_rec == 0 and h.buffer is None for h in opts[0]._handles.values())
    return same, clean


@pytest.mark.parametrize("layout", ["tensor", "sequence"])
def test_tp_with_activation_checkpointing_steps_as_without(layout):
    """DTensor shards under a non-reentrant checkpoint (the fused linear's operands saved by a separate
    node before its GEMM, so the recompute skips each block's last linear): the same weights, bit for
    bit, as the same TP training without the checkpoint."""
    for rank, (same, clean) in _spawn(_checkpoint_worker, 2, layout):
        assert same and clean, (rank, same, clean)
