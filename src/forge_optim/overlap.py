"""Fused updates on a side CUDA stream (``overlap_updates=True``).

A fused update needs nothing from the rest of the backward after it is issued, and nothing in the
backward needs it: dX was already formed from the old W. On one stream it still waits for, and
delays, every kernel of the backward. On a side stream its SM-time can fill what the backward leaves
idle: small kernels that do not fill the GPU, launch gaps, and the tail waves of the update kernels
themselves.

What keeps it correct:
- each update's side stream first waits for everything the caller's stream has issued so far: dY, X,
  the dX GEMM that read the old W, and a zero-filled accumulation buffer;
- dY, X and the buffer are marked used on the side stream (``record_stream``), so the caching
  allocator does not hand their memory to the caller's stream before the update has read them;
- the caller's stream waits for the side stream at the end of backward (an autograd engine callback)
  and in ``opt.step()``, ``state_dict()``, ``load_state_dict()`` and ``nonfinite_counts()``: whatever
  runs after ``loss.backward()`` on that stream sees the updated weights and states;
- to bound the memory held that way, the host waits for the oldest updates once those in flight hold
  more than ``MAX_HELD_BYTES`` of dY and X (a backward can issue every layer's update before the GPU
  has run the first).
"""
from __future__ import annotations

import collections
import os

import torch

MAX_HELD_BYTES = 512 << 20  # dY and X kept alive for updates not yet run
# the side stream's priority (CUDA: lower is more urgent; 0, the default stream's, is the least): a more
# urgent side stream gets SMs first as they free, the backward's kernels take what is left
SIDE_PRIORITY = int(os.environ.get("FORGE_SIDE_PRIORITY", "0"))


class SideStreams:
    """Per optimizer: one side stream per device, the caller streams to join, the updates in flight."""

    __slots__ = ("side", "mains", "inflight", "held", "queued")

    def __init__(self):
        self.side: dict[int, torch.cuda.Stream] = {}
        self.mains: dict[tuple[int, int], tuple] = {}  # (device, stream id) -> (caller stream, side stream)
        self.inflight: collections.deque = collections.deque()  # (event on the side stream, bytes held)
        self.held = 0
        self.queued = False

    def begin(self, device: torch.device):
        """Before an update's launch: (caller stream, side stream), the side waiting for the caller."""
        main = torch.cuda.current_stream(device)
        side = self.side.get(main.device_index)
        if side is None:
            side = self.side[main.device_index] = torch.cuda.Stream(main.device, priority=SIDE_PRIORITY)
        side.wait_stream(main)
        return main, side

    def end(self, main, side, tensors) -> None:
        """After the launch (issued with ``side`` current): hold ``tensors`` for it, schedule the join."""
        nbytes = 0
        for t in tensors:
            t.record_stream(side)
            nbytes += t.numel() * t.element_size()
        self.mains[(main.device_index, main.stream_id)] = (main, side)
        inflight = self.inflight
        inflight.append((side.record_event(), nbytes))
        self.held += nbytes
        while len(inflight) > 1 and (self.held > MAX_HELD_BYTES or inflight[0][0].query()):
            event, b = inflight.popleft()
            event.synchronize()  # returns at once for a finished one
            self.held -= b
        if not self.queued:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.join)
                self.queued = True
            except RuntimeError:  # not inside a backward pass: nothing will call us back, join now
                self.join()

    def join(self) -> None:
        """Make every caller stream wait for its side stream's updates."""
        self.queued = False
        if not self.mains:
            return
        for main, side in self.mains.values():
            main.wait_stream(side)
        self.mains.clear()  # (the updates stay in ``inflight`` until they have run: their memory is still held)
