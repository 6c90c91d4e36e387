"""Executing a pipeline schedule on one rank: micro-batches, transfers, gradient accumulation.

:class:`Pipeline` is what :func:`~funcpar.transforms.pipeline_split` stores in
``TrainStep.pipeline``; the step calls :meth:`Pipeline.loss_and_grads` in place of the
single-pass forward/backward. It walks this rank's action list (:mod:`.schedules`):

* ``F(s, mb)``: ``step.apply_fn(params, buffers, s, x, *inputs_mb)`` on the activation ``x``
  received from stage ``s - 1`` (detached, made a leaf that requires grad, so the stage's
  backward stops there); the last stage also computes ``step.loss_fn(out, targets_mb)``;
* ``B(s, mb)``: ``torch.autograd.grad`` of the stage's output against the received gradient
  (the last stage: of ``loss_mb / m``, times the loss scale under fp16; a stage that returned
  a :class:`~.stages.SideLoss`: of its hidden states against the received gradient and of
  ``side_loss_mb / m`` likewise) with respect to the stage's parameter leaves (summed into the
  step's gradients) and to ``x`` (sent back);
* transfers: consecutive ones are posted together (:func:`funcpar.shard.comm.batch_p2p`,
  recorded in the comm log as ``send``/``recv`` over ``pp``); sends are not waited for until
  the step's end, receives right away - the semantics :func:`.schedules.simulate` verified the
  lists under. Each (stage, micro-batch, direction) has its own tag. The first activation a
  stage receives in a step is preceded by a small header (its shape and dtype); gradients have
  their activation's shape.

Random draws (dropout, a noisy loss): the forward of ``(stage s, micro-batch mb)`` draws from
the generator seeded by a hash of the step's entry state (``state.rng``) and ``(s, mb)``, and
the step leaves the generator at a state seeded by the entry state alone. So the draws do not
depend on the schedule or on which rank runs a stage, no two stages share a stream, and
``state.rng`` after the step is the same on every pp rank - one generator state for the whole
pipelined state, which a checkpoint saves once and loads into any layout (each rank's own
stream would advance by its own stages' draws only and differ between ranks).

The loss is the mean over micro-batches of the micro-batch losses - the full-batch loss when
the loss is a mean over equal-size micro-batches (as data parallelism assumes for its ranks) -
and its gradients are those of that mean; side losses (an MoE model's router losses on the
stages before the last) are terms of it, averaged over micro-batches likewise. Each rank's
share - the last stage's mean loss, the other stages' mean side losses - is all-reduced over
``pp`` (as float64), so every rank reports the whole loss. Leaves held by two ranks (tied
embeddings) get the sum of both ranks' gradients, added in rank order so both hold the same
bits.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from funcpar.pipeline.schedules import COMPUTE, Action
from funcpar.pipeline.stages import SideLoss, StagePlan
from funcpar.shard import comm
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.reduce import tree_split_over
from funcpar.state.tree import Tree, tree_flatten, tree_unflatten

__all__ = ["Pipeline", "split_microbatches"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32]
_HEADER = 10  # ndim, up to 8 sizes, dtype code


def split_microbatches(batch: Any, m: int, who: str = "pipeline",
                       flag: str = "microbatches") -> list[Any]:
    """``batch`` cut into ``m`` equal micro-batches along dim 0 of every tensor (``who`` and
    ``flag`` name the caller and its count in the error)."""
    leaves, spec = tree_flatten(batch)
    cut = []
    for x in leaves:
        if not torch.is_tensor(x):
            cut.append([x] * m)
            continue
        if x.dim() == 0 or x.shape[0] % m:
            raise ValueError(f"{who}: a batch tensor of shape {tuple(x.shape)} does not "
                             f"split into {m} equal micro-batches along dim 0 (the batch on "
                             f"this rank must be a multiple of {flag}={m})")
        cut.append(list(x.chunk(m)))
    return [tree_unflatten(spec, [c[i] for c in cut]) for i in range(m)]


class Pipeline:
    """This rank's share of a pipelined step (module docstring).

    ``actions``: this rank's schedule; ``trace``: when ``record`` is set, the last step's
    compute spans ``(action, start, end)`` in ``time.perf_counter`` seconds and its peak
    number of micro-batches held (``peak_in_flight``), for benchmarks.
    """

    def __init__(self, mesh: DeviceMesh, axis: str, plan: StagePlan, schedule: str,
                 microbatches: int, actions: list[Action]) -> None:
        self.mesh, self.axis, self.plan = mesh, axis, plan
        self.schedule, self.m, self.actions = schedule, microbatches, actions
        self.rank = mesh.rank(axis)
        self.record = False
        self.trace: list[tuple[Action, float, float]] = []
        self.peak_in_flight = 0

    # ------------------------------------------------------------------------------ helpers
    def _tag(self, kind: int, sender_stage: int, mb: int) -> int:
        return (kind * self.plan.n_stages + sender_stage) * self.m + mb

    def norms_over_stages(self, grads: dict[str, Tensor]) -> Any:
        """The context (:func:`funcpar.shard.reduce.tree_split_over`) under which tree-wide
        norms of ``grads`` (this rank's leaves) are the whole model's: summed over ``pp``,
        each leaf held by several ranks (a tied weight, same gradient on every holder)
        counted on its first holder only."""
        elsewhere = [grads[n] for n, rs in self.plan.shared().items()
                     if self.rank in rs and rs[0] != self.rank and grads.get(n) is not None]
        return tree_split_over(self.mesh, self.axis, held_elsewhere=elsewhere)

    def global_norm(self, grads: dict[str, Tensor], layouts: Tree | None) -> Tensor:
        """The norm of the whole model's gradients (every stage's leaves, each once): the
        ``grad_norm`` metric, by the same mechanism as the optimizer's clip."""
        from funcpar.optim.clip import global_norm  # the optimizer layer sits above

        with self.norms_over_stages(grads):
            return global_norm(grads, layouts)

    # ------------------------------------------------------------------------------ the step
    def loss_and_grads(self, step: Any, params: Tree, buffers: Tree, batch: Any,
                       loss_scale: Tensor | None = None, *, backward: bool = True,
                       on_grad: Callable[[int, Tensor], None] | None = None,
                       ) -> tuple[Tensor, Tree | None, Tree]:
        """``(loss, grads, new_buffers)`` of the pipelined forward/backward over ``batch``
        (this rank's stages' leaves only).

        ``on_grad(i, grad)`` (``i`` the leaf's index in ``params``' flat order): called in the
        backward of each stage's last micro-batch as soon as a leaf's gradient, summed over
        every micro-batch, is complete, so a data-parallel or ZeRO reduction can start while
        that backward goes on (as Megatron-LM overlaps its gradient reduction with the last
        micro-batch). Not for a leaf held by several ranks (a tied weight): its gradient is
        complete only after the holders' sum.

        ``backward=False`` (evaluation, :mod:`funcpar.train.eval`): the schedule's forwards and
        their transfers alone, in the schedule's order (a subsequence of a deadlock-free
        order whose sends do not block is one too), without autograd; the loss is the last
        stage's mean micro-batch loss (no side losses: they are training terms), and the
        gradients come back None."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError("a batch must be a pair (inputs, targets); inputs may be a tuple "
                            "of tensors")
        if not isinstance(params, dict):
            raise TypeError("pipeline_split needs params as a dict of dotted names "
                            "(functionalize's)")
        inputs, targets = batch
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        m, plan = self.m, self.plan
        train = backward
        actions = self.actions if train else [
            a for a in self.actions if a.kind in ("F", "SEND_F", "RECV_F")]
        mb_args = split_microbatches(args, m)
        mb_targets = split_microbatches(targets, m)
        last = plan.n_stages - 1
        live = {n: x.detach().requires_grad_(train and (x.is_floating_point()
                                                         or x.is_complex()))
                for n, x in params.items()}
        device = next((x.device for x in params.values() if torch.is_tensor(x)),
                      torch.device("cpu"))
        entry = _rng_bytes(device)  # the step's generator state (module docstring)
        stage_leaves = {s: [n for n in plan.names[s] if live[n].requires_grad]
                        for s in plan.stages_of(self.rank)}
        grads: dict[str, Tensor | None] = dict.fromkeys(params)
        owned: set[str] = set()  # gradients that are sums made here (not autograd's outputs)
        held: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        inbox: dict[tuple[str, int, int], comm.Pending | Tensor] = {}
        local: dict[tuple[str, int, int], Tensor] = {}  # hand-overs between stages of a rank
        sent: list[comm.Pending] = []
        shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        loss_sum: Tensor | None = None
        side_sum: Tensor | None = None  # this rank's stages' side losses (SideLoss), float64
        new_buffers = buffers
        self.trace = []
        self.peak_in_flight = 0
        pending_comm: list[Action] = []
        final_mb = {a.stage: a.mb for a in actions if a.kind == "B"}  # each stage's last
        index: dict[str, int] = {}
        if on_grad is not None:
            order = {id(x): i for i, x in enumerate(tree_flatten(params)[0])}
            tied = {n for n, rs in plan.shared().items() if self.rank in rs}
            index = {n: order[id(x)] for n, x in params.items() if n not in tied}

        def add(n: str, g: Tensor) -> Tensor:
            if grads[n] is None:
                grads[n] = g
            elif n in owned:
                # A sum this step made: added in place (the same bits), where a new
                # leaf-sized tensor per micro-batch cost an allocation (fresh pages on CPU)
                # each time.
                grads[n].add_(g)
            else:
                grads[n] = grads[n] + g
                owned.add(n)
            return grads[n]

        def completed(n: str, g: Tensor) -> None:
            on_grad(index[n], add(n, g))

        def flush() -> None:
            ops: list[comm.P2POp] = []
            recvs: list[tuple[tuple[str, int, int], int]] = []
            for a in pending_comm:
                if a.kind == "SEND_F":
                    out = _hidden(held[(a.stage, a.mb)][1]).detach().contiguous()
                    peer = plan.rank_of(a.stage + 1)
                    if a.stage not in shapes:
                        shapes[a.stage] = (tuple(out.shape), out.dtype)
                        ops.append(comm.P2POp("send", _header(out), peer,
                                              self._tag(2, a.stage, a.mb),
                                              f"pp activation header s{a.stage}"))
                    ops.append(comm.P2POp("send", out, peer, self._tag(0, a.stage, a.mb),
                                          f"pp activation s{a.stage}->s{a.stage + 1}"))
                elif a.kind == "SEND_B":
                    g = local.pop(("dx", a.stage, a.mb)).contiguous()
                    ops.append(comm.P2POp("send", g, plan.rank_of(a.stage - 1),
                                          self._tag(1, a.stage, a.mb),
                                          f"pp grad s{a.stage}->s{a.stage - 1}"))
                elif a.kind == "RECV_F":
                    src = a.stage - 1
                    if src not in shapes:
                        # The header travels first; its receive is waited for here (a receive
                        # blocks in the verified semantics anyway).
                        ops_now = ops + [comm.P2POp(
                            "recv", torch.empty(_HEADER, dtype=torch.int64,
                                                device=self.mesh.device),
                            plan.rank_of(src), self._tag(2, src, a.mb),
                            f"pp activation header s{src}")]
                        got = comm.batch_p2p(ops_now, self.mesh, self.axis)
                        sent.extend(got[:-1])
                        ops = []
                        shapes[src] = _parse_header(got[-1].wait())
                    shape, dtype = shapes[src]
                    buf = torch.empty(shape, dtype=dtype, device=self.mesh.device)
                    ops.append(comm.P2POp("recv", buf, plan.rank_of(src),
                                          self._tag(0, src, a.mb),
                                          f"pp activation s{src}->s{a.stage}"))
                    recvs.append((("x", a.stage, a.mb), len(ops) - 1))
                elif a.kind == "RECV_B":
                    like = _hidden(held[(a.stage, a.mb)][1])
                    buf = torch.empty(like.shape, dtype=like.dtype, device=self.mesh.device)
                    ops.append(comm.P2POp("recv", buf, plan.rank_of(a.stage + 1),
                                          self._tag(1, a.stage + 1, a.mb),
                                          f"pp grad s{a.stage + 1}->s{a.stage}"))
                    recvs.append((("g", a.stage, a.mb), len(ops) - 1))
            got = comm.batch_p2p(ops, self.mesh, self.axis)
            is_recv = {i for _, i in recvs}
            sent.extend(w for i, w in enumerate(got) if i not in is_recv)
            for key, i in recvs:
                inbox[key] = got[i].wait()
            pending_comm.clear()

        for a in actions:
            if a.kind not in COMPUTE:
                pending_comm.append(a)
                continue
            if pending_comm:
                flush()
            t0 = time.perf_counter()
            if a.kind == "F":
                if a.stage == 0:
                    x = None
                elif ("x", a.stage, a.mb) in inbox:
                    x = inbox.pop(("x", a.stage, a.mb))
                else:
                    x = local.pop(("y", a.stage - 1, a.mb))
                if train and x is not None and (x.is_floating_point() or x.is_complex()):
                    x = x.detach().requires_grad_()
                _seed_draws(device, entry, a.stage, a.mb)
                with torch.enable_grad() if train else torch.no_grad():
                    out, new_buffers = step.apply_fn(live, new_buffers, a.stage, x,
                                                     *mb_args[a.mb])
                    if a.stage == last:
                        out = _checked_loss(step.loss_fn(out, mb_targets[a.mb]))
                        loss_sum = out.detach() if loss_sum is None else loss_sum + out.detach()
                    else:
                        out = _checked_stage_output(out, a.stage)
                        if isinstance(out, SideLoss) and train:
                            side = out.loss.detach().double()
                            side_sum = side if side_sum is None else side_sum + side
                held[(a.stage, a.mb)] = (x, out)
                self.peak_in_flight = max(self.peak_in_flight, len(held))
                if a.stage < last and plan.rank_of(a.stage + 1) == self.rank:
                    local[("y", a.stage, a.mb)] = _hidden(out).detach()
            else:
                x, out = held.pop((a.stage, a.mb))
                if a.stage == last:
                    targets, g_outs = [_as_loss_target(out, loss_scale, m)], [None]
                else:
                    g_out = inbox.pop(("g", a.stage, a.mb), None)
                    if g_out is None:
                        g_out = local.pop(("dx", a.stage + 1, a.mb))
                    targets, g_outs = [_hidden(out)], [g_out]
                    if isinstance(out, SideLoss) and out.loss.requires_grad:
                        # The side loss is a term of every micro-batch's loss, as the last
                        # stage's: d loss / d side = 1 / m (times the loss scale).
                        targets.append(_as_loss_target(out.loss, loss_scale, m))
                        g_outs.append(None)
                names = stage_leaves[a.stage]
                wanted = [live[n] for n in names]
                want_x = x is not None and x.requires_grad
                if want_x:
                    wanted.append(x)
                hooked = ({n for n in names if n in index}
                          if on_grad is not None and final_mb[a.stage] == a.mb else set())
                # The hook observes (returns None): it sums the leaf's last micro-batch in and
                # hands the whole gradient on, so the loop below skips the leaves it saw.
                hooks = [live[n].register_hook(lambda g, n=n: completed(n, g)) for n in hooked]
                try:
                    got = torch.autograd.grad(targets, wanted, grad_outputs=g_outs,
                                              allow_unused=True)
                finally:
                    for h in hooks:
                        h.remove()
                for n, g in zip(names, got):
                    if g is None or n in hooked:
                        continue
                    add(n, g)
                if a.stage > 0:
                    dx = got[-1] if want_x else None
                    local[("dx", a.stage, a.mb)] = (torch.zeros_like(x) if dx is None else dx)
                # Summed in: this micro-batch's gradients would otherwise stay alive until the
                # next backward returns (a stage's gradient bytes more at the rank's peak).
                got = g = None
            if self.record:
                self.trace.append((a, t0, time.perf_counter()))
        if pending_comm:
            flush()
        for w in sent:
            w.wait()
        _seed_draws(device, entry, "after the step")  # the same on every rank
        if not train:  # the forwards' outputs were kept for their sends only
            if inbox:
                raise RuntimeError(f"pipeline forwards left {sorted(inbox)} received on rank "
                                   f"{self.rank}")
            return self._loss_everywhere(loss_sum, None), None, new_buffers
        if held or inbox:
            raise RuntimeError(f"pipeline schedule left work undone on rank {self.rank}: "
                               f"held {sorted(held)}, received {sorted(inbox)}")
        flat = {n: (torch.zeros_like(params[n]) if g is None else g) for n, g in grads.items()}
        flat = self._sum_shared(flat)
        loss = self._loss_everywhere(loss_sum, side_sum)
        return loss, flat, new_buffers

    def _loss_everywhere(self, loss_sum: Tensor | None, side_sum: Tensor | None) -> Tensor:
        """The step's loss on every pp rank: the mean micro-batch loss (the last stage's) plus
        the mean side losses of the other stages, one all-reduce (sum, float64) over pp of
        each rank's share (0 where a rank has neither, so a dense model's loss comes back
        bit for bit)."""
        mine = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for part in (loss_sum, side_sum):
            if part is not None:
                mine = mine + part.double() / self.m
        return comm.all_reduce(mine, self.mesh, self.axis, purpose="pp loss")

    def _sum_shared(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """Leaves held by several ranks (tied weights): the sum of their gradients, in rank
        order, on each holder."""
        for name, holders in self.plan.shared().items():
            if self.rank not in holders:
                continue
            mine = grads[name].contiguous()
            ops = []
            for r in holders:
                if r != self.rank:
                    ops.append(comm.P2POp("send", mine, r, 0, f"{name}: tied grad"))
                    ops.append(comm.P2POp("recv", torch.empty_like(mine), r, 0,
                                          f"{name}: tied grad"))
            got = comm.batch_p2p(ops, self.mesh, self.axis)
            theirs = {r: got[2 * k + 1].wait() for k, r in enumerate(
                r for r in holders if r != self.rank)}
            for w in got[0::2]:
                w.wait()
            total = None
            for r in holders:
                g = mine if r == self.rank else theirs[r]
                total = g if total is None else total + g
            grads[name] = total
        return grads

    def same_as_first_holder(self, updates: dict[str, Tensor]) -> dict[str, Tensor]:
        """``updates`` (or new parameters) with each leaf held by several ranks replaced, on
        all but the first holder, by the first holder's: the holders' optimizers see the same
        gradient and the same global norm, but an optimizer's own arithmetic need not be
        bit-reproducible (a kernel, a reduction order), and tied copies must stay equal."""
        for name, holders in self.plan.shared().items():
            if self.rank not in holders:
                continue
            mine = updates[name].contiguous()
            if self.rank == holders[0]:
                ops = [comm.P2POp("send", mine, r, 1, f"{name}: tied update")
                       for r in holders[1:]]
                for w in comm.batch_p2p(ops, self.mesh, self.axis):
                    w.wait()
            else:
                ops = [comm.P2POp("recv", torch.empty_like(mine), holders[0], 1,
                                  f"{name}: tied update")]
                updates[name] = comm.batch_p2p(ops, self.mesh, self.axis)[0].wait()
        return updates


def _rng_bytes(device: torch.device) -> bytes:
    state = (torch.cuda.get_rng_state(device) if device.type == "cuda"
             else torch.get_rng_state())
    return state.numpy().tobytes()


def _seed_draws(device: torch.device, entry: bytes, *key: Any) -> None:
    """Seed ``device``'s generator from the step's entry state and ``key`` (a stage and
    micro-batch, or the step's end): 63 bits of a sha256, so distinct keys give unrelated
    streams."""
    h = hashlib.sha256(entry)
    h.update(repr(key).encode())
    seed = int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def _hidden(out: Tensor | SideLoss) -> Tensor:
    """The hidden states a stage before the last sends on."""
    return out.hidden if isinstance(out, SideLoss) else out


def _as_loss_target(loss: Tensor, loss_scale: Tensor | None, m: int) -> Tensor:
    """What a micro-batch's loss term is differentiated as: ``loss / m``, times the loss scale
    under fp16 (in float32, as the one-process step scales it)."""
    target = loss if loss_scale is None else loss.float() * loss_scale
    return target / m


def _checked_stage_output(out: Any, stage: int) -> Tensor | SideLoss:
    if torch.is_tensor(out):
        return out
    if (isinstance(out, SideLoss) and torch.is_tensor(out.hidden) and torch.is_tensor(out.loss)
            and out.loss.dim() == 0):
        return out
    raise TypeError(f"pipeline stage {stage} returned a {type(out).__name__}; a stage before "
                    "the last must return one tensor (the hidden states) or "
                    "SideLoss(hidden, 0-d loss term)")


def _checked_loss(loss: Any) -> Tensor:
    if not (torch.is_tensor(loss) and loss.dim() == 0):
        raise ValueError(f"loss_fn must return a 0-d tensor, got {type(loss).__name__} "
                         f"{tuple(getattr(loss, 'shape', ()))}")
    return loss


def _header(t: Tensor) -> Tensor:
    if t.dim() > _HEADER - 2:
        raise ValueError(f"pipeline activations of more than {_HEADER - 2} dims are not "
                         f"supported, got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"pipeline activation dtype {t.dtype} is not one of {_DTYPES}")
    h = [t.dim(), *t.shape, *([0] * (_HEADER - 2 - t.dim())), _DTYPES.index(t.dtype)]
    return torch.tensor(h, dtype=torch.int64, device=t.device)


def _parse_header(h: Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    v = [int(x) for x in h.tolist()]
    return tuple(v[1:1 + v[0]]), _DTYPES[v[-1]]

