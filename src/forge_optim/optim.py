"""The torch.optim.Optimizer front end.

``forge_optim.AdamW(model, lr=...)`` patches the model's single-consumer nn.Linear layers so that
their weights are updated inside backward, tile by tile, and keeps torch.optim's behaviour for
everything else: ``opt.step()`` steps the parameters that were not fused (embeddings, norms,
biases, tied or shared weights) with the same rule, LR schedulers edit ``param_groups`` as usual
(the fused update reads them at backward time), and ``state_dict()`` uses torch.optim's layout.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn

from . import dtensor, patch, precision
from .autograd import Use, register_handle
from .backends import BACKEND_NAMES, StateView, UpdateJob, make_backend, triton_available
from .backends.base import RowSparseGrad
from .rules import Rule

STATE_DTYPES = ("fp32", "bf16", "int8")
_TORCH_ONLY_FLAGS = dict(foreach=None, fused=None, capturable=False, differentiable=False)


def _dtype_message(name: str, dtype: torch.dtype) -> str:
    why = {torch.float16: "fp16 needs loss scaling, which an in-backward update cannot undo",
           torch.float64: "the fused kernels and states are float32 at most"}.get(
        dtype, "only floating-point weights of these two dtypes can be updated")
    return (f"parameter '{name}' is {dtype}: forge_optim supports float32 and bfloat16 weights ({why}); "
            "cast the model with model.to(torch.bfloat16) or model.float()")


def _shape_2d(t: torch.Tensor) -> tuple[int, int]:
    """The [rows, cols] a state is stored as: the last axis stays whole (int8 blocks run along it)."""
    if t.dim() == 0:
        return 1, 1
    cols = t.shape[-1]
    return (t.numel() // cols if cols else 0), cols


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 2:  # the common case (a linear's weight and states): no view op on the hot path
        return t
    return t.view(_shape_2d(t))


def _cat_rows(ts: list, cols: int) -> torch.Tensor:
    """[sum of rows, cols]: the tensors' rows of width ``cols``, one after another (1-D tensors, the
    common case of norm weights and biases, are concatenated without a view op each)."""
    if all(t.dim() == 1 for t in ts):
        return torch.cat(ts).view(-1, cols)
    return torch.cat([t.reshape(-1, cols) for t in ts])


def _copy_rows_back(dst: list, flat: torch.Tensor) -> None:
    """The inverse of ``_cat_rows``: copy consecutive pieces of ``flat`` into the tensors of ``dst``."""
    pieces = flat.view(-1).split([t.numel() for t in dst])
    torch._foreach_copy_(dst, [p if d.dim() == 1 else p.view(d.shape) for d, p in zip(dst, pieces)])


def graph_capture_error(what: str) -> RuntimeError:
    """The error for an update inside a CUDA graph capture (callers test
    ``torch.cuda.is_current_stream_capturing()``, only where CUDA is present: a CPU-only torch raises on
    the query). The update's learning rate, bias corrections and stochastic-rounding keys are host
    scalars baked into the launch: every replay of the graph would apply this step's update again."""
    return RuntimeError(
        f"forge_optim: {what} inside a CUDA graph capture (torch.cuda.graph, or a CUDA-graph mode of "
        "torch.compile that captured forge_optim's code). The update's learning rate, bias corrections "
        "and random-rounding keys are host values that a replay would repeat unchanged, so each replay "
        "would re-apply this step's update. Capture only code without FORGE updates: torch.compile(model), "
        "also with mode='reduce-overhead', keeps forge_optim's ops out of its CUDA graphs; call opt.step() "
        "outside any captured region")


# What a backward asks of a fused weight (FusedWeight.asked)
UPDATE, SKIP, RETAINED = 0, 1, 2


def accelerate_defers_step() -> bool:
    """True in a non-final micro-step of Hugging Face accelerate's gradient accumulation: the Trainer
    with ``gradient_accumulation_steps > 1`` sets ``sync_gradients`` before each micro-step (and
    ``accelerator.accumulate(model)`` does the same), and steps the optimizer only after the last one.
    A fused layer then adds its gradient to its buffer, as inside ``opt.accumulate()``. Read from
    accelerate's shared state only if accelerate was imported (~0.1 us a call)."""
    state = sys.modules.get("accelerate.state")
    return state is not None and state.GradientState._shared_state.get("sync_gradients", True) is False


class FusedWeight(patch.LiveOnly):
    """Links one fused weight to its optimizer: counts pending uses, buffers, updates. A copied or
    pickled model carries no link to this optimizer (LiveOnly): its module runs unfused."""

    def __init__(self, optimizer: "ForgeOptimizer", module_name: str, param: nn.Parameter):
        # Strong: a patched model keeps its optimizer (and the states it updates) alive.
        self._opt = optimizer
        self.name = module_name
        self.param = param
        self.pending_fwd = 0  # forward uses (outside backward) whose backward has not run yet
        self.pending_rec = 0  # uses first seen inside backward (reentrant checkpoint recompute)
        self.pending_traced = 0  # uses by the compiled form (no Use object: reset by opt.step())
        self.buffer: torch.Tensor | None = None  # fp32 gradient summed over uses / micro-steps
        self.updates = 0  # fused updates applied since the last opt.step()
        self.retained = False  # the buffer holds a retain_graph pass's gradient
        self.attached = True
        self.fast: _FastPath | None = None  # the prepared launch of the last update (optimizer-owned)
        self.grad_node = None  # the weight's AccumulateGrad node, to ask a backward what it wants of it
        self.id = register_handle(self)  # how the compiled form's custom ops find this handle

    @property
    def optimizer(self) -> "ForgeOptimizer":
        return self._opt

    def describe(self) -> str:
        opt = self._opt
        return f"{opt.rule.name}(state={opt.state_dtype_of(self.param)}, backend={opt.backend_name})"

    def detach(self) -> None:
        self.attached = False
        self._opt._any_detached = True  # opt.step() then forgets this handle (forge_optim.unpatch(model))

    def new_use(self) -> Use:
        if torch._C._current_graph_task_id() == -1:
            kind = "fwd"
            self.pending_fwd += 1
        elif self.pending_fwd == 0:
            kind = "rec"  # recomputed inside backward with no pending forward: its backward will run
            self.pending_rec += 1
        else:
            kind = None  # non-reentrant checkpoint recompute: the original forward is counted
        return Use(self, kind)

    def count_use(self) -> None:
        """The compiled form's forward. Ops return tensors only, so no Use object can release a use
        whose graph is dropped: ``opt.step()`` clears such stale counts (and applies what they buffered)."""
        if torch._C._current_graph_task_id() == -1 or self.pending_traced == 0:
            self.pending_traced += 1

    def release_one(self) -> None:
        self.pending_traced = max(0, self.pending_traced - 1)

    def release(self, kind: str) -> None:
        if kind == "fwd":
            self.pending_fwd = max(0, self.pending_fwd - 1)
        elif kind == "rec":
            self.pending_rec = max(0, self.pending_rec - 1)

    def asked(self) -> int:
        """What the running backward asks of this weight (one of ``UPDATE``, ``SKIP``, ``RETAINED``).

        SKIP: the backward does not want this weight's gradient (``torch.autograd.grad(loss, x)`` or
        ``backward(inputs=[...])`` for other tensors, as for an input gradient or an adversarial
        perturbation; or the weight was frozen with ``requires_grad_(False)``): torch.optim would not
        step it, so the fused update must not run either. RETAINED: ``retain_graph=True``, the graph
        may be backpropagated again and every pass must see the old weight, so the gradient is summed
        into the fp32 buffer and applied by the last pass or by ``opt.step()``."""
        p = self.param
        if not p.requires_grad:
            return SKIP
        if torch._C._current_graph_task_id() == -1:
            return UPDATE  # no backward graph task is visible to ask (a direct call)
        try:
            # The cached node answers the usual case in one call. It goes stale when autograd replaces
            # the weight's accumulator (p.data of another dtype, as model.half() does): then the answer
            # is False (not in this graph), so a False is asked again of the current node (~3 us)
            node = self.grad_node
            if node is None or not torch._C._will_engine_execute_node(node):
                node = self.grad_node = torch.autograd.graph.get_gradient_edge(p).node
                if not torch._C._will_engine_execute_node(node):
                    return SKIP
        except RuntimeError as e:
            if "autograd.grad" not in str(e):
                raise
            raise RuntimeError(
                f"forge_optim: torch.autograd.grad asked for the gradient of the fused weight '{self.name}.weight'. "
                "A fused layer never forms that gradient (its backward updates the weight in place). Leave the "
                "weight out of the inputs, or exclude the module (exclude=[...]) or unpatch the model to get it "
                "as a tensor") from None
        return RETAINED if torch._C._autograd._get_current_graph_task_keep_graph() else UPDATE

    def consume(self, dy: torch.Tensor, x: torch.Tensor, use: Use | None) -> None:
        """Called from backward with this use's dY [..., Dout] and X [..., Din] (DTensors under TP)."""
        if torch.is_grad_enabled():  # backward(create_graph=True); a plain backward runs without grad
            with torch.no_grad():
                return self.consume(dy, x, use)
        if dy.is_cuda and torch.cuda.is_current_stream_capturing():  # (a CPU-only torch raises on the query)
            raise graph_capture_error(f"the fused weight '{self.name}.weight' is being updated")
        if use is not None and not use.done:
            use.done = True
            self.release(use.kind)
        asked = self.asked()
        if asked == SKIP:
            return
        opt = self.optimizer
        if not self.attached:
            raise RuntimeError(f"'{self.name}' was unpatched while a forward through it was pending")
        dy, x = dtensor.local_operands(self.param, dy, x)
        if dy.dim() != 2:  # a view op each: ~0.8 us of host time
            dy = dy.reshape(-1, dy.shape[-1])
        if x.dim() != 2:
            x = x.reshape(-1, x.shape[-1])
        if (opt._accumulating or asked == RETAINED or self.pending_fwd or self.pending_rec or self.pending_traced
                or accelerate_defers_step()):
            # Another use of this weight still needs the old W, or we are inside accumulate() (or a
            # non-final micro-step of accelerate's accumulation), or the graph is retained for another
            # backward: add this gradient to the fp32 buffer and update after the last use (or in opt.step()).
            if self.buffer is None:
                w = dtensor.local(self.param)
                self.buffer = torch.zeros(w.shape, dtype=opt.accumulate_dtype, device=w.device)
            opt._backend_for(self.param).accumulate(self.buffer, dy, x)
            self.retained = self.retained or asked == RETAINED
            return
        self.retained = False
        opt._fused_update(self, dy, x)


class _FastPath:
    """A fused weight's prepared update (backend plan) and the tensors it was prepared for. Valid while
    the weight's storage, its state tensors and their storage, the group's state layout, the rounding mode, the backend
    and the input shapes are unchanged; anything else (load_state_dict, a new param group, p.data
    replaced, nonfinite='raise', DTensors) takes the full path, which re-prepares; accumulation
    never reaches it (consume() buffers those gradients)."""

    __slots__ = ("state", "specs", "tensors", "wptr", "wdtype", "stochastic", "backend", "plan")

    @classmethod
    def make(cls, opt, backend, p, state, job, dy, x):
        make_plan = getattr(backend, "plan", None)
        if make_plan is None or opt.nonfinite_mode != "skip" or dtensor.is_dtensor(p) or dtensor.is_dtensor(dy):
            return None
        plan = make_plan(job, dy, x)  # None for a job with a gradient buffer
        if plan is None:
            return None
        self = cls()
        self.state, self.specs, self.plan, self.backend = state, tuple(v.spec for v in job.states), plan, backend
        names = [sp.name for sp in self.specs] + [sp.name + "_scale" for sp in self.specs
                                                  if sp.name + "_scale" in state] + ["_nonfinite"]
        # the addresses too: the plan may launch with them as plain integers (kernels/launch.py, static launch),
        # so a state tensor given new storage in place (``t.data = ...``) must take the full path
        self.tensors = tuple((n, state[n], state[n].data_ptr()) for n in names)
        self.wptr, self.wdtype, self.stochastic = p.data_ptr(), p.dtype, opt.stochastic_rounding
        return self

    def valid(self, opt, p, group, dy, x) -> bool:
        state = self.state
        if opt.state.get(p) is not state or tuple(opt.rule.state_specs(group)) != self.specs:
            return False
        for name, t, ptr in self.tensors:
            if state.get(name) is not t or t.data_ptr() != ptr:
                return False
        return (p.data_ptr() == self.wptr and p.dtype is self.wdtype and opt.stochastic_rounding == self.stochastic
                and opt.nonfinite_mode == "skip" and opt._backends.get(p.device) is self.backend and self.plan.matches(dy, x))


class ForgeOptimizer(torch.optim.Optimizer):
    """Base class: subclasses set ``rule`` and spell out torch.optim's hyper-parameters."""

    rule: type[Rule]

    def __init__(self, model: nn.Module, defaults: dict, *, params=None, state_dtype: str | None = None,
                 stochastic_rounding: bool | None = None, backend: str = "auto", exclude=(),
                 nonfinite: str = "skip", block_rows: int = 256, seed: int = 0, sparse_embeddings: bool = True,
                 accumulate_dtype: str = "fp32", **torch_flags):
        name = type(self).__name__
        if not isinstance(model, nn.Module):
            raise TypeError(f"forge_optim.{name} takes the model first (it patches the model's nn.Linear "
                            f"layers), got {type(model).__name__}; pass param groups as params=[...]")
        patch.check_not_data_parallel(model)
        for key, value in torch_flags.items():
            if key not in _TORCH_ONLY_FLAGS:
                valid = sorted(list(defaults) + ["params", "state_dtype", "stochastic_rounding", "backend",
                                                 "exclude", "nonfinite", "block_rows", "seed",
                                                 "sparse_embeddings", "accumulate_dtype"])
                raise TypeError(f"forge_optim.{name}: unknown option {key!r}; valid options: {', '.join(valid)}")
            if key in ("capturable", "differentiable") and value:
                raise ValueError(f"forge_optim.{name}: {key}=True is not supported")
        if state_dtype is not None and state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES} or None (the parameter's dtype), "
                             f"got {state_dtype!r}")
        if backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
        if backend == "triton":
            ok, why = triton_available()
            if not ok:
                raise RuntimeError(f"backend='triton' cannot run: {why}")
        if accumulate_dtype not in ("fp32", "bf16"):
            raise ValueError(f"accumulate_dtype must be 'fp32' or 'bf16' (the gradient buffer of accumulation, "
                             f"retained graphs and reused weights), got {accumulate_dtype!r}")
        if nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
        if int(block_rows) < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")

        self.state_dtype = state_dtype
        self.stochastic_rounding = True if stochastic_rounding is None else bool(stochastic_rounding)
        self.backend_name = backend
        self.nonfinite_mode = nonfinite
        self.block_rows = int(block_rows)
        self.seed = int(seed)
        # the gradient buffer's dtype: fp32 (4 B/param while a buffer lives; sums to fp32 round-off), or bf16
        # (2 B/param, as torch's bf16 .grad accumulates: each micro-step's sum rounded to nearest)
        self.accumulate_dtype = torch.float32 if accumulate_dtype == "fp32" else torch.bfloat16
        self._accumulating = 0
        self._any_detached = False  # a handle was detached (unpatched) since step() last looked
        self._warned_repeat = False  # the "several updates per opt.step()" warning is shown once
        self._warned_retained = False  # the "retain_graph=True cost a buffer" warning is shown once
        self._backends: dict[Any, Any] = {}
        self._model_ref = weakref.ref(model)

        if params is None:
            # Every parameter, as torch.optim.AdamW(model.parameters()) has them (same checkpoint layout): one
            # frozen now and unfrozen later (progressive unfreezing) is then stepped by opt.step() from its
            # gradient, as torch.optim would; left out, it would silently never train. Frozen parameters of
            # other dtypes (fp16 or quantized base weights) stay out: no rule here could step them.
            params = [p for p in model.parameters() if p.requires_grad or p.dtype in (torch.float32, torch.bfloat16)]
        # torch.optim's own flags ride along in each group so a state_dict loads into torch.optim as is.
        defaults = dict(defaults, **_TORCH_ONLY_FLAGS)
        # before super().__init__: its add_param_group calls name the parameters they refuse
        self._param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        super().__init__(params, defaults)

        trained = {id(p) for g in self.param_groups for p in g["params"]}
        fuse, skip = patch.plan_fusion(model, trained, exclude)
        self._unfused = skip
        self._handles: dict[str, FusedWeight] = {}
        for mname, mod in fuse.items():
            handle = FusedWeight(self, mname, mod.weight)
            patch.attach(mod, handle)
            self._handles[mname] = handle
        self._fused_ids = {id(h.param): h for h in self._handles.values()}
        # Embeddings hand opt.step() only their touched rows (patch.plan_sparse_embeddings says why).
        self._sparse_embeddings = patch.plan_sparse_embeddings(model, trained) if sparse_embeddings else {}
        for mod in self._sparse_embeddings.values():
            mod.__class__ = patch.ForgeEmbedding
            mod._forge_live = patch.EmbeddingLink(mod.weight)

    # ----- groups -------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        # Checked after torch.optim filled in the defaults; a group that fails is taken out again, so
        # a rejected group never reaches step() (torch.optim raises before appending; so do we, in effect).
        group = self.param_groups[-1]
        try:
            self.rule.validate(group)
            if group.get("amsgrad", False):
                raise ValueError("amsgrad=True is not supported by forge_optim")
            for p in group["params"]:
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(_dtype_message(self._param_name(p), p.dtype))
        except Exception:
            self.param_groups.pop()
            raise
        if "_unfused" in self.__dict__:  # a group added after construction
            self._note_added_linears(group)

    def _param_name(self, p: torch.Tensor) -> str:
        name = self._param_names.get(id(p))
        if name is None:  # a parameter registered on the model after construction
            model = self._model_ref()
            if model is not None:
                name = next((n for n, q in model.named_parameters(remove_duplicate=False) if q is p), None)
        return name or "<not a parameter of the model>"

    def _note_added_linears(self, group: dict) -> None:
        """A linear left unfused because its weight was not in the optimizer is now stepped by step()."""
        model = self._model_ref()
        if model is None:
            return
        ids = {id(p) for p in group["params"]}
        mods = dict(model.named_modules())
        for mname in list(self._unfused):
            mod = mods.get(mname)
            if mod is not None and id(getattr(mod, "weight", None)) in ids:
                self._unfused[mname] = ("weight added by add_param_group after construction; stepped by "
                                        "opt.step() from its gradient (construct the optimizer with it to fuse it)")

    def _locate(self, p: torch.Tensor) -> tuple[int, int]:
        """(group index, flat parameter index) of ``p``; cached, rebuilt when the groups change."""
        cache = self.__dict__.get("_where")
        key = tuple(id(g["params"]) for g in self.param_groups) + tuple(len(g["params"]) for g in self.param_groups)
        if cache is None or cache[0] != key:
            where, i = {}, 0
            for gi, group in enumerate(self.param_groups):
                for q in group["params"]:
                    where[id(q)] = (gi, i)
                    i += 1
            cache = self._where = (key, where)
        try:
            return cache[1][id(p)]
        except KeyError:
            raise KeyError("parameter is not in this optimizer") from None

    def _group_of(self, p: torch.Tensor) -> dict:
        return self.param_groups[self._locate(p)[0]]

    def _index_of(self, p: torch.Tensor) -> int:
        return self._locate(p)[1]

    # ----- what is fused ------------------------------------------------------------------------
    def fused_modules(self) -> dict[str, nn.Module]:
        """{module name: module} for every linear whose weight is updated inside backward."""
        model = self._model_ref()
        mods = dict(model.named_modules()) if model is not None else {}
        return {n: mods[n] for n, h in self._handles.items() if h.attached and n in mods}

    def unfused_linears(self) -> dict[str, str]:
        """{module name: why it is not fused} for every nn.Linear left to opt.step()."""
        return dict(self._unfused)

    def unpatch(self) -> None:
        """Restore plain nn.Linear modules; their weights are then stepped by opt.step()."""
        model = self._model_ref()
        if model is not None:
            for mod in model.modules():
                if isinstance(mod, patch.ForgeLinear) and mod._forge_handle in self._handles.values():
                    patch.detach(mod)
        for h in self._handles.values():
            h.detach()
        self._forget_detached()
        for mod in self._sparse_embeddings.values():
            if type(mod) is patch.ForgeEmbedding:
                mod.__class__ = nn.Embedding
                mod.__dict__.pop("_forge_live", None)
        self._sparse_embeddings = {}

    def _forget_detached(self) -> None:
        """Drop the handles whose layers were unpatched (``opt.unpatch()``, or ``forge_optim.unpatch(model)``,
        which reaches every optimizer's layers): they are plain nn.Linear again, and ``step()`` updates
        their weights from ``.grad`` with the same rule and states."""
        for name in [n for n, h in self._handles.items() if not h.attached]:
            h = self._handles.pop(name)
            self._fused_ids.pop(id(h.param), None)
            self._unfused[name] = "unpatched; stepped by opt.step() from its gradient"
        self._any_detached = False

    def nonfinite_counts(self) -> dict[str, int]:
        """{name: coordinates skipped so far because their gradient was NaN or Inf} (non-zero only)."""
        out = {}
        for p, st in self.state.items():
            c = st.get("_nonfinite")
            if c is not None and int(c) > 0:
                h = self._fused_ids.get(id(p))
                out[h.name + ".weight" if h else self._param_names.get(id(p), "?")] = int(c)
        return out

    def state_dtype_of(self, p: torch.Tensor) -> str:
        if self.state_dtype is not None:
            return self.state_dtype
        return "bf16" if p.dtype == torch.bfloat16 else "fp32"

    @contextlib.contextmanager
    def accumulate(self):
        """Gradient accumulation: inside, fused layers add their gradient to an fp32 buffer; the first
        backward outside (or ``step()``) applies the update with the summed gradient."""
        self._accumulating += 1
        try:
            yield self
        finally:
            self._accumulating -= 1

    # ----- state --------------------------------------------------------------------------------
    def _backend_for(self, p: torch.Tensor):
        key = p.device
        if key not in self._backends:
            self._backends[key] = make_backend(self.backend_name, p.device, self.block_rows)
        return self._backends[key]

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        if p.dtype not in (torch.float32, torch.bfloat16):
            # checked at construction too; a model cast afterwards (model.half()) would otherwise reach
            # the kernel, which stores fp32 or bf16 words: a wrong-width write into the weight's storage
            raise RuntimeError(
                f"forge_optim: parameter '{self._param_names.get(id(p), '?')}' is {p.dtype} now (the model was cast after the optimizer "
                "was created); forge_optim updates float32 and bfloat16 weights only. Cast it back "
                "(model.to(torch.bfloat16) or model.float()), or create the optimizer after casting to one "
                "of those")
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key, init in self.rule.scalar_states.items():
                state[key] = torch.tensor(init, dtype=torch.float32)
        mode = self.state_dtype_of(p)
        lp = dtensor.local(p)
        for spec in self.rule.state_specs(group):
            if spec.name not in state:
                value = float(group[spec.init]) if spec.init else 0.0
                self._set_state_constant(p, state, spec, value, mode)
        if "_nonfinite" not in state:
            state["_nonfinite"] = torch.zeros((), dtype=torch.int64, device=lp.device)
        for key, value in state.items():
            # model.to(device) after the first step moves the weights, not the states: the kernel would
            # be handed pointers of the old device
            if (key != "step" and key not in self.rule.scalar_states and torch.is_tensor(value)
                    and dtensor.local(value).device != lp.device):
                raise RuntimeError(
                    f"forge_optim: optimizer state {key!r} of '{self._param_names.get(id(p), '?')}' is on "
                    f"{dtensor.local(value).device}, the parameter on {lp.device}: the model was moved after "
                    "the optimizer's first step. Create the optimizer after moving the model, or move the states "
                    "with it: opt.load_state_dict(opt.state_dict()) after the move")
        return state

    @classmethod
    def _set_state_constant(cls, p, state: dict, spec, value: float, mode: str) -> None:
        """A fresh state, built directly in its storage format: no fp32 copy of the weight's size
        exists even for a moment (for int8 and bf16 states that copy would be the step's peak)."""
        lp = dtensor.local(p)
        v32 = torch.tensor(value, dtype=torch.float32).item()  # the fp32 value the rule starts from
        if mode == "int8":
            q, scale = precision.quantized_full(*_shape_2d(lp), v32, spec.nonnegative, device=lp.device)
            cls._set_state(p, state, spec, None, mode, quantized=(q, scale))
        elif mode == "bf16":
            v16 = torch.tensor(v32, dtype=torch.float32).to(torch.bfloat16).item()  # fp32 -> bf16 (RNE) once
            state[spec.name] = dtensor.like(p, torch.full(lp.shape, v16, dtype=torch.bfloat16, device=lp.device))
        else:
            state[spec.name] = dtensor.like(p, torch.full(lp.shape, v32, dtype=torch.float32, device=lp.device))

    @staticmethod
    def _set_state(p, state: dict, spec, value: torch.Tensor, mode: str, quantized=None) -> None:
        """Store an fp32 value of the parameter's (local) shape in this optimizer's storage format.
        Under tensor parallelism states are DTensors placed like their parameter."""
        lp = dtensor.local(p)
        if value is not None:
            value = dtensor.local(value).to(device=lp.device)
        if mode == "int8":
            if quantized is not None:
                q, scale = (dtensor.local(t) for t in quantized)
            else:
                q, scale = precision.quantize(_as_2d(value.float()), spec.nonnegative)
            state[spec.name] = dtensor.like(p, q.reshape(lp.shape).to(lp.device).contiguous())
            if scale.dtype != precision.SCALE_DTYPE:  # a cast would round the scale, and every code with it
                raise ValueError(f"int8 state {spec.name!r}: scales must be {precision.SCALE_DTYPE}, got {scale.dtype}")
            state[spec.name + "_scale"] = dtensor.like(p, scale.to(device=lp.device).contiguous())
        elif mode == "bf16":
            state[spec.name] = dtensor.like(p, value.to(torch.bfloat16).reshape(lp.shape).contiguous())
        else:
            state[spec.name] = dtensor.like(p, value.float().reshape(lp.shape).contiguous())

    def _step_scalars(self, group: dict, state: dict, idx: int, specs) -> tuple:
        """Advance the step; this step's coefficients, weight key and state keys (one per spec)."""
        step_t = state["step"]
        step = int(step_t.item()) + 1
        step_t.fill_(step)  # not `+= 1`: 1 us against 4 us of host time for a CPU scalar
        coeffs = self.rule.padded(self.rule.coefficients(group, state, step))
        base_key = precision.step_key(self.seed, idx, step)
        keys = tuple(precision.site_key(base_key, precision.SITE_STATE0 + spec.slot) for spec in specs)
        return coeffs, precision.site_key(base_key, precision.SITE_WEIGHT), keys

    def _job(self, p: torch.Tensor, weight2d: torch.Tensor, group: dict, state: dict, idx: int,
             scalars: tuple | None = None) -> UpdateJob:
        """The update of ``p`` this step; ``scalars`` (from ``_step_scalars``) when the step was advanced already."""
        specs = self.rule.state_specs(group)
        coeffs, key_weight, keys = scalars if scalars is not None else self._step_scalars(group, state, idx, specs)
        views = []
        for spec in specs:
            data = dtensor.local(state[spec.name])
            scale = state.get(spec.name + "_scale") if data.dtype in (torch.int8, torch.uint8) else None
            views.append(StateView(spec, _as_2d(data), None if scale is None else dtensor.local(scale)))
        return UpdateJob(
            weight=weight2d, rule=self.rule, coeffs=coeffs, states=views,
            grad_sign=-1.0 if group.get("maximize", False) else 1.0,
            stochastic_weight=self.stochastic_rounding, stochastic_state=self.stochastic_rounding,
            key_weight=key_weight, key_states=keys, nonfinite=state["_nonfinite"])

    # ----- updates ------------------------------------------------------------------------------
    def _fused_update(self, handle: FusedWeight, dy: torch.Tensor, x: torch.Tensor) -> None:
        """From FusedWeight.consume, with grad disabled."""
        p = handle.param
        gi, idx = self._locate(p)
        group = self.param_groups[gi]
        handle.updates += 1
        fast = handle.fast
        if fast is not None and handle.buffer is None and fast.valid(self, p, group, dy, x):
            coeffs, key_weight, keys = self._step_scalars(group, fast.state, idx, fast.specs)
            fast.plan.run(dy, x, coeffs, -1.0 if group.get("maximize", False) else 1.0, key_weight, keys)
            torch.autograd.graph.increment_version(p)
            return
        state = self._init_state(p, group)
        job = self._job(p, dtensor.local(p.detach()), group, state, idx)
        job.grad_buffer, handle.buffer = handle.buffer, None
        before = int(state["_nonfinite"]) if self.nonfinite_mode == "raise" else 0
        backend = self._backend_for(p)
        backend.update(job, dy, x)
        handle.fast = _FastPath.make(self, backend, p, state, job, dy, x)
        # Triton stores do not bump the version counter: make any stale use of the old W raise.
        torch.autograd.graph.increment_version(p)
        if self.nonfinite_mode == "raise":
            bad = int(state["_nonfinite"]) - before
            if bad:
                self._raise_after_backward(f"{handle.name}.weight", bad)

    def _warn_repeated_updates(self, h: FusedWeight) -> None:
        """The usual gradient-accumulation loop (backward per micro-batch, opt.step() every k) would
        silently take k optimizer steps per opt.step() here: each backward through a fused layer is one."""
        self._warned_repeat = True
        warnings.warn(
            f"forge_optim: '{h.name}.weight' was updated by {h.updates} backward passes since the last "
            f"{type(self).__name__}.step(): each backward through a fused layer applies a full optimizer step "
            "to it. If these backward passes were micro-batches of one step (gradient accumulation), run them "
            "inside `with opt.accumulate():` (the first backward outside it, or opt.step(), applies the summed "
            "gradient once). Shown once per optimizer.", UserWarning, stacklevel=patch.user_stacklevel())

    def _warn_retained(self, h: FusedWeight) -> None:
        """A graph backpropagated with retain_graph=True and not again: its gradients waited in fp32
        buffers (4 bytes per weight element) for this step, where one plain backward needs none."""
        self._warned_retained = True
        warnings.warn(
            f"forge_optim: '{h.name}.weight' was backpropagated with retain_graph=True (or create_graph=True) and not backpropagated "
            "through that graph again, so its gradient waited in an fp32 buffer of the weight's size until "
            f"{type(self).__name__}.step() (a retained graph may be backpropagated again, and every pass needs the "
            "old weight). The step is exact; drop retain_graph=True where one backward follows to save that "
            "memory. Shown once per optimizer.", UserWarning, stacklevel=patch.user_stacklevel())

    @staticmethod
    def _raise_after_backward(name: str, count: int) -> None:
        def _raise():
            raise FloatingPointError(
                f"non-finite gradient in '{name}': {count} coordinates were NaN or Inf; their weights and "
                "optimizer states were left unchanged (nonfinite='raise'; use nonfinite='skip' to only count)")

        torch.autograd.Variable._execution_engine.queue_callback(_raise)

    @torch.no_grad()
    def _apply_from_grad(self, p: torch.Tensor, group: dict, grad: torch.Tensor, scalars: tuple | None = None) -> None:
        state = self._init_state(p, group)
        w = dtensor.local(p.detach())
        contiguous = w.is_contiguous()
        w2d = _as_2d(w if contiguous else w.contiguous())
        job = self._job(p, w2d, group, state, self._index_of(p), scalars)
        if dtensor.is_dtensor(grad) and dtensor.is_dtensor(p) and tuple(grad.placements) != tuple(p.placements):
            grad = grad.redistribute(p.device_mesh, p.placements)  # e.g. a Partial norm-weight gradient
        before = int(state["_nonfinite"]) if self.nonfinite_mode == "raise" else 0
        if grad.is_sparse:  # an embedding's touched rows
            if grad.shape != w2d.shape:
                raise RuntimeError(f"sparse gradient of '{self._param_names.get(id(p), '?')}' has shape "
                                   f"{tuple(grad.shape)}; forge_optim steps row-sparse 2-D gradients (embeddings)")
            self._backend_for(p).update_from_row_sparse(job, RowSparseGrad(grad))
        else:  # read in place if fp32/bf16 and contiguous, else cast to fp32 chunk by chunk (the backend)
            self._backend_for(p).update_from_grad(job, _as_2d(dtensor.local(grad).contiguous()))
        if not contiguous:
            w.copy_(w2d.view_as(w))
        if self.nonfinite_mode == "raise" and int(state["_nonfinite"]) - before:
            raise FloatingPointError(
                f"non-finite gradient in '{self._param_names.get(id(p), '?')}': weights and states of those "
                "coordinates were left unchanged (nonfinite='raise')")

    @torch.no_grad()
    def step(self, closure=None):
        """Step the parameters that were not fused; fused weights were updated during backward."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise graph_capture_error(f"{type(self).__name__}.step() is running")
        if self._any_detached:
            self._forget_detached()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batches: dict[tuple, list] = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                h = self._fused_ids.get(id(p))
                if h is not None:
                    if p.grad is not None:
                        raise RuntimeError(
                            f"fused weight '{h.name}.weight' received a gradient from outside its module: "
                            "another consumer used it (e.g. a functional call on the weight), so its in-backward "
                            f"update may have run before that use. Exclude it: exclude=['{h.name}']")
                    h.pending_traced = 0  # every backward of this step has run: what is left is stale
                    if h.updates > 1 and not self._warned_repeat:
                        self._warn_repeated_updates(h)
                    h.updates = 0
                    if h.retained and not self._warned_retained:
                        self._warn_retained(h)
                    h.retained = False
                    if h.buffer is not None:
                        # accumulate() was used for every micro-step (or step() is called inside it, as
                        # torch.optim steps whatever .grad holds): apply the summed gradient now.
                        buf, h.buffer = h.buffer, None
                        self._apply_from_grad(p, group, buf)
                    continue
                if p.grad is None:
                    continue
                key = self._batch_key(p, gi)
                if key is None:
                    self._apply_from_grad(p, group, p.grad)
                else:
                    batches.setdefault(key, []).append(p)
        for key, ps in batches.items():
            group = self.param_groups[key[0]]
            if len(ps) == 1:
                self._apply_from_grad(ps[0], group, ps[0].grad)
            else:
                self._apply_batched(ps, group)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's zero_grad; also drops the fused layers' gradient buffers (accumulate() or
        retain_graph=True), which hold what .grad would hold under torch.optim: a discarded micro-batch
        is discarded for fused weights too."""
        super().zero_grad(set_to_none)
        for h in self._handles.values():
            if h.buffer is not None:
                h.buffer = None
                h.retained = False

    # Small unfused parameters (norm weights, biases) are stepped together: one update over their
    # rows concatenated instead of one launch each (65 RMSNorm weights of an 8B Llama cost ~15 ms
    # of host time per step one by one). The rule is element-wise, so the result is the same
    # update; only the stochastic-rounding stream is the batch's (keyed by its first parameter).
    BATCH_MAX_NUMEL = 1 << 20

    def _batch_key(self, p: torch.Tensor, gi: int) -> tuple | None:
        """What parameters must share to be stepped in one batch, or None for one on its own."""
        g = p.grad
        if (self.nonfinite_mode != "skip" or p.dim() == 0 or p.numel() == 0 or p.numel() > self.BATCH_MAX_NUMEL
                or g.is_sparse or g.shape != p.shape or dtensor.is_dtensor(p) or dtensor.is_dtensor(g)
                or not p.is_contiguous()):
            return None
        st = self.state.get(p)
        step = int(st["step"].item()) if st and "step" in st else 0
        # same step: the rule's coefficients (bias corrections) and scalar states agree
        return gi, p.device, p.dtype, g.dtype, p.shape[-1], self.state_dtype_of(p), step

    def _apply_batched(self, ps: list, group: dict) -> None:
        """One update for same-shaped-rows parameters of one group (``_batch_key``): weights, states
        and gradients are concatenated along rows, updated once, and copied back."""
        specs = self.rule.state_specs(group)
        states = [self._init_state(p, group) for p in ps]
        if self.rule.scalar_states:  # per-parameter scalars (NAdam's mu product): advance each
            scalars = [self._step_scalars(group, st, self._index_of(p), specs) for p, st in zip(ps, states)]
            if any(sc[0] != scalars[0][0] for sc in scalars[1:]):  # e.g. loaded apart: one by one
                for p, sc in zip(ps, scalars):
                    self._apply_from_grad(p, group, p.grad, sc)
                return
        else:  # the coefficients depend on the step only, which the members share (_batch_key)
            scalars = [self._step_scalars(group, states[0], self._index_of(ps[0]), specs)]
            step = states[0]["step"]
            for st in states[1:]:
                st["step"].copy_(step)
        cols = ps[0].shape[-1]
        rows = [p.numel() // cols for p in ps]
        w = _cat_rows(ps, cols)  # (step() runs without grad: the parameters are read and written as they are)
        grad = _cat_rows([p.grad for p in ps], cols)
        views, outs = [], []
        for spec in specs:
            data = _cat_rows([st[spec.name] for st in states], cols)
            scale = None
            if data.dtype in (torch.int8, torch.uint8):
                scales = [st[spec.name + "_scale"] for st in states]
                scale = _cat_rows(scales, scales[0].shape[-1])
                outs.append((scales, scale))
            views.append(StateView(spec, data, scale))
            outs.append(([st[spec.name] for st in states], data))
        coeffs, key_weight, keys = scalars[0]
        job = UpdateJob(
            weight=w, rule=self.rule, coeffs=coeffs, states=views,
            grad_sign=-1.0 if group.get("maximize", False) else 1.0,
            stochastic_weight=self.stochastic_rounding, stochastic_state=self.stochastic_rounding,
            key_weight=key_weight, key_states=keys, nonfinite=None)  # counted per parameter below
        self._backend_for(ps[0]).update_from_grad(job, grad)
        _copy_rows_back(ps, w)
        for dst, src in outs:
            _copy_rows_back(dst, src)
        # the kernel left non-finite coordinates unchanged; count them for each parameter
        bad = torch.isfinite(grad).logical_not_().sum(1)
        per_param = list(bad.unbind()) if all(r == 1 for r in rows) else [b.sum() for b in bad.split(rows)]
        torch._foreach_add_([st["_nonfinite"] for st in states], per_param)

    # ----- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch.optim's layout; int8 states are exported dequantized (fp32) under torch's key, with
        the exact quantized form kept beside them as ``<key>_q`` and ``<key>_scale``."""
        sd = super().state_dict()
        out = {}
        for idx, st in sd["state"].items():
            st = dict(st)
            st.pop("_nonfinite", None)
            for key in list(st):
                v = st[key]
                if isinstance(v, torch.Tensor) and v.dtype in (torch.int8, torch.uint8) and key + "_scale" in st:
                    st[key + "_q"] = v
                    lv = dtensor.local(v)
                    deq = precision.dequantize(_as_2d(lv), dtensor.local(st[key + "_scale"])).reshape(lv.shape)
                    st[key] = dtensor.like(v, deq)
            out[idx] = st
        sd["state"] = out
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict of this class or of the torch.optim optimizer with the same rule."""
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has "
                             f"{len(groups)}")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            sizes = [(len(s["params"]), len(g["params"])) for g, s in zip(groups, saved_groups)]
            msg = ("loaded state dict has parameter groups of different sizes than this optimizer (saved, here: "
                   f"{sizes})")
            frozen = [sum(not q.requires_grad for q in g["params"]) for g in groups]
            if any(frozen) and all(h - sv in (0, f) for (sv, h), f in zip(sizes, frozen)):
                # the default params took only trainable parameters before 2026-12-05
                msg += (f"; the difference is this model's {sum(frozen)} frozen parameters: a checkpoint saved by an "
                        "optimizer whose params left them out loads into one made with params=[p for p in "
                        "model.parameters() if p.requires_grad]")
            raise ValueError(msg)
        id_map = {}
        for g, s in zip(groups, saved_groups):
            id_map.update(zip(s["params"], g["params"]))
        new_groups = []
        for g, s in zip(groups, saved_groups):
            ng = dict(g)
            ng.update({k: v for k, v in s.items() if k != "params"})
            ng["params"] = g["params"]
            self.rule.validate(ng)
            new_groups.append(ng)
        # Everything is checked and converted before anything is replaced: a load that fails leaves
        # this optimizer exactly as it was.
        group_of = {id(q): ng for ng in new_groups for q in ng["params"]}
        new_state = defaultdict(dict)
        for k, saved in state_dict["state"].items():
            p = id_map[k]
            new_state[p] = self._import_state(p, group_of[id(p)], saved)
        self.param_groups = new_groups
        self.state = new_state

    def _import_state(self, p, group, saved: dict) -> dict:
        state: dict = {}
        if "step" in saved:
            state["step"] = torch.tensor(float(saved["step"]), dtype=torch.float32)
        for key, init in self.rule.scalar_states.items():
            state[key] = torch.tensor(float(saved.get(key, init)), dtype=torch.float32)
        mode = self.state_dtype_of(p)
        for spec in self.rule.state_specs(group):
            value = saved.get(spec.name)
            if value is None:
                continue
            if tuple(value.shape) != tuple(p.shape):
                # one of another shape but the same size would be reshaped into this layout, scrambled
                raise ValueError(
                    f"loaded state dict: state {spec.name!r} of parameter '{self._param_names.get(id(p), '?')}' "
                    f"has shape {tuple(value.shape)}, the parameter has {tuple(p.shape)}. The checkpoint comes "
                    "from another model, or its parameters were listed in another order; nothing was loaded")
            quantized = None
            if mode == "int8":
                quantized = _exact_codes(saved.get(spec.name + "_q"), saved.get(spec.name + "_scale"),
                                         value, spec.nonnegative)
            # otherwise (a torch.optim checkpoint, another state mode, codes torch.optim cast or kept stale
            # while it trained, or fp32 scales from before forge_optim 0.1's bf16 scales) the exported
            # value is quantized afresh
            # clone: a state_dict holds references to the live tensors of the optimizer that made it
            self._set_state(p, state, spec, value.detach().float().clone(), mode, quantized)
        if "step" not in state:
            # torch.optim.SGD keeps no step: a saved momentum buffer means at least one step was taken.
            state["step"] = torch.tensor(1.0 if state else 0.0, dtype=torch.float32)
        state["_nonfinite"] = torch.zeros((), dtype=torch.int64, device=p.device)
        return state


def _exact_codes(q, scale, value: torch.Tensor, nonnegative: bool):
    """The saved int8 codes and scales, if they are this state's exact quantized form; else None.

    A forge_optim checkpoint that passed through torch.optim's load_state_dict comes back with every
    tensor cast to the parameter's dtype (codes as bf16 or fp32 numbers), and with codes that are stale
    if torch.optim trained in between: codes are used only if they are integers in range and
    dequantize to the exported value (compared in the value's dtype)."""
    if not isinstance(q, torch.Tensor) or not isinstance(scale, torch.Tensor):
        return None
    q, scale = dtensor.local(q).detach(), dtensor.local(scale).detach()
    lv = dtensor.local(value).detach()
    code_dtype = precision.int8_dtype(nonnegative)
    rows, cols = _shape_2d(lv)
    if (tuple(q.shape) != tuple(lv.shape) or scale.dtype != precision.SCALE_DTYPE
            or tuple(scale.shape) != (rows, precision.num_scale_blocks(cols))):
        return None
    if q.dtype != code_dtype:
        info = torch.iinfo(code_dtype)
        if not q.is_floating_point() or not bool(((q == q.round()) & (q >= info.min) & (q <= info.max)).all()):
            return None
        q = q.to(code_dtype)
    q, scale = q.to(lv.device), scale.to(lv.device)
    deq = precision.dequantize(_as_2d(q), scale).reshape(lv.shape)
    if not torch.equal(deq.to(lv.dtype), lv):
        return None
    return q.clone(), scale.clone()


# ----- the optimizers users construct: torch.optim's names and defaults after the model ---------------
from . import rules as _rules  # noqa: E402


def _no_amsgrad(amsgrad: bool) -> None:
    if amsgrad:
        raise ValueError("amsgrad=True is not supported by forge_optim (use torch.optim for AMSGrad)")


class AdamW(ForgeOptimizer):
    """AdamW (torch.optim.AdamW) with fused in-backward updates of the model's linear weights."""

    rule = _rules.AdamW

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, **options):
        _no_amsgrad(amsgrad)
        super().__init__(model, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                                     maximize=maximize, decoupled_weight_decay=True), **options)


class Adam(ForgeOptimizer):
    """Adam with L2 weight decay (torch.optim.Adam); decoupled_weight_decay=True makes it AdamW."""

    rule = _rules.Adam

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, decoupled_weight_decay=False, **options):
        _no_amsgrad(amsgrad)
        if decoupled_weight_decay:
            self.rule = _rules.AdamW
        super().__init__(model, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                                     maximize=maximize, decoupled_weight_decay=bool(decoupled_weight_decay)),
                         **options)


class NAdam(ForgeOptimizer):
    """NAdam (torch.optim.NAdam)."""

    rule = _rules.NAdam

    def __init__(self, model, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
                 decoupled_weight_decay=False, *, maximize=False, **options):
        super().__init__(model, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                     momentum_decay=momentum_decay, decoupled_weight_decay=decoupled_weight_decay,
                                     maximize=maximize), **options)


class RAdam(ForgeOptimizer):
    """RAdam (torch.optim.RAdam)."""

    rule = _rules.RAdam

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled_weight_decay=False, *, maximize=False, **options):
        super().__init__(model, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                     decoupled_weight_decay=decoupled_weight_decay, maximize=maximize), **options)


class Lion(ForgeOptimizer):
    """Lion (Chen et al., 2023) with decoupled weight decay; torch.optim has no Lion."""

    rule = _rules.Lion

    def __init__(self, model, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False, **options):
        super().__init__(model, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize), **options)


class RMSprop(ForgeOptimizer):
    """RMSprop (torch.optim.RMSprop), optionally centered and with momentum."""

    rule = _rules.RMSprop

    def __init__(self, model, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False, *,
                 maximize=False, **options):
        super().__init__(model, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                     centered=centered, maximize=maximize), **options)


class Adagrad(ForgeOptimizer):
    """Adagrad (torch.optim.Adagrad)."""

    rule = _rules.Adagrad

    def __init__(self, model, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                 *, maximize=False, **options):
        super().__init__(model, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                     initial_accumulator_value=initial_accumulator_value, eps=eps,
                                     maximize=maximize), **options)


class SGD(ForgeOptimizer):
    """SGD with momentum, dampening and Nesterov (torch.optim.SGD)."""

    rule = _rules.SGD

    def __init__(self, model, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, **options):
        super().__init__(model, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                     nesterov=nesterov, maximize=maximize), **options)


OPTIMIZERS = {cls.__name__: cls for cls in (AdamW, Adam, NAdam, RAdam, Lion, RMSprop, Adagrad, SGD)}
