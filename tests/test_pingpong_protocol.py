"""The ping-pong kernel's barrier protocol, checked on CPU by exploring every interleaving.

kernels/pingpong.py runs four partitions per program: an operand loader (dY/X tiles through a STAGES-deep
ring), a state loader (W and the states of each tile into one of SLOTS slots) and two consumer warpgroups
that take the program's tiles in turn. They synchronize only through mbarriers waited on by phase parity,
and a parity wait cannot tell phase n from phase n-2: a wrong protocol passes a wait early and reads a
buffer that holds another tile's data, or is still being written. Such a race shows on a GPU only under
some timings (the one-slot race of the thirty-sixth session needed a one-K-step mainloop), and Gluon has no
CPU interpreter, so this file models the protocol instead:

- ``programs`` writes each partition's barrier and buffer operations in the kernel's own order, the waits
  with the kernel's own parities (keep it in step with ``_operand_loader``, ``_state_loader`` and
  ``_consume``);
- ``explore`` runs every interleaving of the four partitions and of the TMA loads' landings (they land in
  any order, at any time after they are issued), with mbarriers that count completed phases, and reports
  the first read of a buffer that does not hold the tile the reader expects, fully landed, the first load
  into a buffer that is still being read or written, and any deadlock.
"""

import ast
import re
from pathlib import Path

import pytest

PINGPONG = Path(__file__).resolve().parents[1] / "src" / "forge_optim" / "kernels" / "pingpong.py"


def programs(T, K, STAGES, SLOTS, *, one_slot_release_wait=True, order_barrier=True):
    """The operations of each partition of one program with T local tiles of K ring steps each.
    The keyword switches remove one safeguard of the kernel each (to show the checker finds the race)."""
    loader, c = [], 0
    for t in range(T):
        for kk in range(K):
            s, ph = c % STAGES, (c // STAGES) & 1
            # a fresh mbarrier counts as having completed the phase before phase 0 (parity 1)
            loader += [("wait", ("empty", s), ph ^ 1), ("load", ("ring", s), (t, kk), ("ready", s))]
            c += 1
    state_loader = []
    for t in range(T):
        slot = t % SLOTS
        state_loader += [("wait", ("st_empty", slot), ((t // SLOTS) & 1) ^ 1),
                         ("load", ("slot", slot), t, ("st_ready", slot))]
    consumers = []
    for cid in (0, 1):
        ops, c, n_done = [], cid * K, 0
        for t in range(cid, T, 2):  # local tile index j = 2 * n_done + cid
            if order_barrier:
                if cid == 0:
                    if n_done > 0:
                        ops.append(("wait", ("order", 0), (n_done - 1) & 1))
                else:
                    ops.append(("wait", ("order", 1), n_done & 1))
            prev = None
            for kk in range(K):
                s, ph = c % STAGES, (c // STAGES) & 1
                ops += [("wait", ("ready", s), ph), ("acquire", ("ring", s), (t, kk))]
                if kk > 0:  # warpgroup_mma_wait(1): the previous stage's wgmma is done reading
                    ops += [("release", ("ring", prev)), ("arrive", ("empty", prev))]
                prev = s
                c += 1
            ops += [("release", ("ring", prev)), ("arrive", ("empty", prev)), ("arrive", ("order", 1 - cid))]
            c += K  # the other consumer's tile in the ring
            slot = t % SLOTS
            if SLOTS == 1 and one_slot_release_wait and t > 0:
                ops.append(("wait", ("st_empty", 0), (t - 1) & 1))
            # the epilogue reads the slot and TMA-stores it; store_wait(0) before the release
            ops += [("wait", ("st_ready", slot), (t // SLOTS) & 1), ("acquire", ("slot", slot), t),
                    ("release", ("slot", slot)), ("arrive", ("st_empty", slot))]
            n_done += 1
        consumers.append(ops)
    return [loader, state_loader] + consumers


class ProtocolError(AssertionError):
    pass


def explore(parts, limit=3_000_000):
    """Every interleaving of ``parts`` (lists of operations) and of the loads' landings, depth first over
    distinct states. Returns the number of states seen; raises ProtocolError at the first violation."""
    bars = sorted({op[1] for ops in parts for op in ops if op[0] in ("wait", "arrive")}
                  | {op[3] for ops in parts for op in ops if op[0] == "load"})
    bufs = sorted({op[1] for ops in parts for op in ops if op[0] in ("load", "acquire", "release")})
    bi = {b: i for i, b in enumerate(bars)}
    ui = {b: i for i, b in enumerate(bufs)}
    # state: (pcs, completed phases per barrier, buffer contents, pending landings, held buffers)
    start = ((0,) * len(parts), (0,) * len(bars), (None,) * len(bufs), frozenset(), frozenset())
    seen, stack = {start}, [start]
    while stack:
        pcs, done, content, pending, held = stack.pop()
        succ = []
        for a, ops in enumerate(parts):
            if pcs[a] == len(ops):
                continue
            op = ops[pcs[a]]
            npcs = pcs[:a] + (pcs[a] + 1,) + pcs[a + 1:]
            kind = op[0]
            if kind == "wait":
                # try_wait.parity(p) passes once the phase of parity p has completed: completed count's
                # parity differs from p (a barrier two phases ahead passes too: the aliasing hazard)
                if done[bi[op[1]]] & 1 != op[2]:
                    succ.append((npcs, done, content, pending, held))
            elif kind == "arrive":
                i = bi[op[1]]
                succ.append((npcs, done[:i] + (done[i] + 1,) + done[i + 1:], content, pending, held))
            elif kind == "load":
                u = ui[op[1]]
                if any(h[0] == u for h in held):
                    raise ProtocolError(f"partition {a} loads {op[2]} into {op[1]} while it is read ({content[u]})")
                if any(p[0] == u for p in pending):
                    raise ProtocolError(f"partition {a} loads {op[2]} into {op[1]} while a load is in flight")
                ncontent = content[:u] + (("in flight", op[2]),) + content[u + 1:]
                succ.append((npcs, done, ncontent, pending | {(u, op[2], bi[op[3]])}, held))
            elif kind == "acquire":
                u = ui[op[1]]
                if content[u] != ("landed", op[2]):
                    raise ProtocolError(f"partition {a} reads {op[1]} for {op[2]} but it holds {content[u]}")
                succ.append((npcs, done, content, pending, held | {(u, a)}))
            elif kind == "release":
                succ.append((npcs, done, content, pending, held - {(ui[op[1]], a)}))
        for p in pending:  # a load lands: its data is in place and its barrier's phase completes
            u, label, i = p
            succ.append((pcs, done[:i] + (done[i] + 1,) + done[i + 1:],
                         content[:u] + (("landed", label),) + content[u + 1:], pending - {p}, held))
        if not succ and any(pc < len(ops) for pc, ops in zip(pcs, parts)):
            stuck = {a: ops[pc] for a, (pc, ops) in enumerate(zip(pcs, parts)) if pc < len(ops)}
            raise ProtocolError(f"deadlock: {stuck}")
        for s in succ:
            if s not in seen:
                seen.add(s)
                stack.append(s)
        if len(seen) > limit:
            raise RuntimeError(f"more than {limit} states: make the case smaller")
    return len(seen)


# (T local tiles, K ring steps per tile, STAGES, SLOTS): the shipped schedules' slot counts (1: the 128x128
# tile; 2: the default; 3-5: the short-mainloop schedules) against rings shorter, equal and longer than a tile
# (K = 1 is the short mainloop of BT <= BK, where the one-slot race showed)
CASES = [(T, K, ST, SL) for (T, K) in ((6, 1), (6, 2), (5, 3)) for ST in (2, 3, 4) for SL in (1, 2, 3)] + [
    (6, 1, 4, 4), (6, 1, 2, 5), (6, 2, 8, 1)]


@pytest.mark.parametrize("T,K,STAGES,SLOTS", CASES)
def test_pingpong_protocol_has_no_race_and_no_deadlock(T, K, STAGES, SLOTS):
    assert explore(programs(T, K, STAGES, SLOTS)) > 0


def test_checker_finds_the_one_slot_race_without_the_release_wait():
    # the bug of the thirty-sixth session's first 128x128 draft: one slot, one-K-step mainloops
    with pytest.raises(ProtocolError, match=r"reads \('slot', 0\) for \d+ but it holds"):
        explore(programs(4, 1, 2, 1, one_slot_release_wait=False))


def test_checker_finds_ring_aliasing_without_the_order_barrier():
    # the consumers' mainloops must take turns: without the order barrier a consumer can pass a parity wait
    # on a ring stage that the other consumer's tile is about to fill
    with pytest.raises(ProtocolError):
        explore(programs(4, 2, 2, 2, order_barrier=False))


def test_checker_reports_a_deadlock():
    parts = programs(2, 1, 2, 2)
    parts[1] = [("wait", ("st_empty", 0), 0)] + parts[1]  # waits for a release that needs its own load first
    with pytest.raises(ProtocolError, match="deadlock"):
        explore(parts)


# The kernel's barrier calls, per partition, in source order, as ``programs`` transcribes them. A change to a
# wait, an arrival or an expect in pingpong.py fails the test below until the model and this list follow it.
KERNEL_SYNC = {
    "_operand_loader": ["wait(empty.index(s), ph ^ 1)", "expect(ready.index(s), nbytes)"],
    "_state_loader": ["wait(st_empty.index(slot), ((j // SLOTS) & 1) ^ 1)", "expect(bar, ST_BYTES)"],
    "_consume": ["wait(order.index(0), (n_done - 1) & 1)", "wait(order.index(1), n_done & 1)",
                 "wait(ready.index(s), ph)", "arrive(empty.index(prev_s), count=1)",
                 "arrive(empty.index(prev_s), count=1)", "arrive(order.index(1 - cid), count=1)",
                 "wait(st_empty.index(0), (j - 1) & 1)", "wait(st_ready.index(slot), (j // SLOTS) & 1)",
                 "arrive(st_empty.index(slot), count=1)"],
}


def test_the_model_transcribes_the_kernels_barrier_calls():
    src = PINGPONG.read_text()
    found = {}
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name in KERNEL_SYNC:
            body = ast.get_source_segment(src, node)
            found[node.name] = [m.group(1) for m in re.finditer(r"mbarrier\.((?:wait|arrive|expect)\(.*\))", body)]
    assert found == KERNEL_SYNC, ("pingpong.py's mbarrier calls changed: update programs() in "
                                  "tests/test_pingpong_protocol.py to match, then KERNEL_SYNC")
