"""Collectives over one mesh axis, each recorded with what asked for it.

Thin wrappers over torch.distributed: :func:`all_reduce`, :func:`all_gather` (uneven pieces
included), :func:`reduce_scatter`, :func:`all_to_all` (uneven splits, expert parallelism),
:func:`broadcast`, :func:`send` / :func:`recv`, and
:func:`batch_p2p` (asynchronous sends and receives posted together, for pipeline stages).
Each takes the mesh, the axis to communicate over and a ``purpose`` (the leaf name or what
asked), and is functional: it returns a new tensor and leaves its input alone
(``all_reduce(inplace=True)`` excepted). Over an axis of size 1 nothing is issued, nothing is
recorded, and the input itself is returned.

Accounting: every collective actually issued is appended as a :class:`CommRecord` (step, op,
axis, bytes, purpose) to the process-local :data:`comm_log` while it is enabled, and to every
open :meth:`CommLog.capture`. ``bytes`` follows nccl-tests' convention - the size of the largest
buffer of the operation on this rank: the tensor for all_reduce / broadcast / send / recv, the
gathered output for all_gather, the full input for reduce_scatter (uneven pieces padded to the
largest one, as they travel), the larger of the send and receive buffers for all_to_all.
:func:`comm_report` prints a table per step.

These are not autograd functions: a differentiable collective (Megatron's f/g operators) wraps
them in a ``torch.autograd.Function`` so that its traffic is recorded too.

**Traced.** Inside :func:`traced_collectives` (the whole-step compile,
:mod:`funcpar.train.whole_step`, traces the step under it with ``make_fx``) :func:`all_reduce`,
:func:`all_gather`, :func:`reduce_scatter`, :func:`broadcast` and :func:`all_to_all` issue
torch's *functional* collectives (``torch.distributed._functional_collectives``: an
``_c10d_functional`` op and its ``wait_tensor``, which ``make_fx``, AOTAutograd and inductor
keep in the graph), so a step with collectives stays one compiled region. Their records are
collected, not logged, while tracing; the region replays them (:meth:`CommLog.replay`) each
time the compiled graph runs, so :data:`comm_log` and :func:`comm_report` account the same
bytes as the eager step. The point-to-point ones (:func:`send`, :func:`recv`,
:func:`batch_p2p`) have no functional form and refuse to be traced.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from funcpar.shard.mesh import DeviceMesh

__all__ = [
    "CommLog",
    "CommRecord",
    "CommSummary",
    "P2POp",
    "Pending",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "batch_p2p",
    "broadcast",
    "chunk_sizes",
    "comm_log",
    "comm_report",
    "recv",
    "reduce_scatter",
    "send",
    "summarize",
    "traced_collectives",
]


# ----------------------------------------------------------------------------------- recorder
class CommRecord(NamedTuple):
    """One collective issued by this process."""

    step: int | None
    op: str
    axis: str
    axis_size: int
    nbytes: int
    purpose: str
    dtype: str


class CommLog:
    """Process-local record of the collectives issued, tagged with the current step.

    The log keeps records only while :attr:`enabled` (off by default, so a long run does not
    grow it); :meth:`capture` collects the records of a block whatever :attr:`enabled` says.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self.enabled = False
        self.step: int | None = None
        self._captures: list[list[CommRecord]] = []
        self._traces: list[list[CommRecord]] = []
        # Seconds this process spent blocked in eager collectives (a synchronous call, or the
        # wait() of an asynchronous one): the communication the computation did not hide.
        self.blocked_s = 0.0

    def begin_step(self, step: int) -> None:
        """Tag the collectives that follow with ``step``."""
        self.step = int(step)

    def enable(self, on: bool = True) -> None:
        self.enabled = on

    def clear(self) -> None:
        self.records.clear()
        self.step = None
        self.blocked_s = 0.0

    def capture(self) -> contextlib.AbstractContextManager[list[CommRecord]]:
        """``with comm_log.capture() as recs:`` - ``recs`` fills with the block's collectives."""
        return _collecting(self._captures)

    def record(self, op: str, mesh: DeviceMesh, axis: str, nbytes: int, purpose: str,
               dtype: torch.dtype) -> None:
        if not (self._traces or self.enabled or self._captures):
            return
        rec = CommRecord(None, op, axis, mesh.size(axis), int(nbytes), purpose,
                         str(dtype).removeprefix("torch."))
        if self._traces:  # issued into a graph being traced: the graph's runs replay it
            self._traces[-1].append(rec)
            return
        self._add(rec)

    def replay(self, records: Sequence[CommRecord]) -> None:
        """Log ``records`` (collected by :func:`traced_collectives`) as issued now, tagged with
        the current step: what a traced region calls after each run of its graph."""
        for rec in records:
            self._add(rec)

    def _add(self, rec: CommRecord) -> None:
        if not (self.enabled or self._captures):
            return
        rec = rec._replace(step=self.step)
        if self.enabled:
            self.records.append(rec)
        for recs in self._captures:
            recs.append(rec)


@contextlib.contextmanager
def _collecting(into: list[list[CommRecord]]) -> Iterator[list[CommRecord]]:
    """A fresh list of records, in ``into`` for the block's duration."""
    recs: list[CommRecord] = []
    into.append(recs)
    try:
        yield recs
    finally:
        into.remove(recs)


#: The process-local log every collective of this module reports to.
comm_log = CommLog()


class CommSummary(NamedTuple):
    """The collectives of one (step, op, axis): how many, how many bytes, asked by whom."""

    step: int | None
    op: str
    axis: str
    count: int
    nbytes: int
    purposes: tuple[str, ...]


def summarize(records: Sequence[CommRecord]) -> list[CommSummary]:
    """Records grouped by (step, op, axis), in order of first appearance."""
    groups: dict[tuple[Any, str, str], list[CommRecord]] = {}
    for r in records:
        groups.setdefault((r.step, r.op, r.axis), []).append(r)
    return [
        CommSummary(step, op, axis, len(rs), sum(r.nbytes for r in rs),
                    tuple(dict.fromkeys(r.purpose for r in rs)))
        for (step, op, axis), rs in groups.items()
    ]


def comm_report(
    records: Sequence[CommRecord] | None = None, *, echo: bool = True, max_purposes: int = 4
) -> str:
    """A table per step of the collectives in ``records`` (default: :data:`comm_log`).

    One row per (op, axis): count, total bytes, the purposes that asked (first
    ``max_purposes``). Printed when ``echo``; returned either way.
    """
    rows = summarize(comm_log.records if records is None else records)
    lines = []
    if not rows:
        lines.append("no collectives recorded")
    header = f"{'op':<15} {'axis':<6} {'count':>6} {'bytes':>14}  purposes"
    step_seen = object()
    for row in rows:
        if row.step != step_seen:
            step_seen = row.step
            total = sum(r.nbytes for r in rows if r.step == row.step)
            label = "outside steps" if row.step is None else f"step {row.step}"
            lines.append(f"{label} ({total:,} bytes)")
            lines.append("  " + header)
        shown = ", ".join(row.purposes[:max_purposes])
        if len(row.purposes) > max_purposes:
            shown += f", ... (+{len(row.purposes) - max_purposes})"
        lines.append(f"  {row.op:<15} {row.axis:<6} {row.count:>6} {row.nbytes:>14,}  {shown}")
    text = "\n".join(lines)
    if echo:
        print(text)
    return text


# -------------------------------------------------------------------------------- collectives
_OPS = ("sum", "max", "min")


@contextlib.contextmanager
def traced_collectives() -> Iterator[list[CommRecord]]:
    """Inside: the collectives of this module are functional (traceable into a graph, see the
    module docstring), and what they would record is collected into the yielded list instead
    of the log (the graph's every run replays it with :meth:`CommLog.replay`)."""
    with _collecting(comm_log._traces) as recs:
        yield recs


def _traced() -> bool:
    return bool(comm_log._traces)


def _funcol() -> Any:
    import torch.distributed._functional_collectives as funcol

    return funcol


def _funcol_op(name: str, before_2_12: str) -> Callable[..., Tensor]:
    # torch 2.12 renamed two functional collectives (same arguments, same op); the GPU
    # machines' torch 2.11 has only the old names.
    funcol = _funcol()
    return getattr(funcol, name, None) or getattr(funcol, before_2_12)


def _untraceable(what: str, purpose: str) -> None:
    if _traced():
        raise RuntimeError(f"{what} ({purpose}) has no functional collective and cannot be "
                           "traced into a compiled region (the whole-step compile refuses "
                           "pipelines for that reason)")


def _reduce_op(op: str) -> Any:
    import torch.distributed as dist

    if op not in _OPS:
        raise ValueError(f"reduction op must be one of {_OPS}, got {op!r}")
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def chunk_sizes(n: int, parts: int) -> list[int]:
    """How torch.chunk (and DTensor's ``Shard``) cuts ``n`` into ``parts``: ``ceil(n / parts)``
    each, the last ones fewer or none (``7 -> [2, 2, 2, 1]``, ``6 -> [2, 2, 2, 0]`` over 4)."""
    c = -(-n // parts) if parts else 0
    return [max(0, min(n, c * (i + 1)) - c * i) for i in range(parts)]


def _blocked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its wall time added to :attr:`CommLog.blocked_s`."""
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        comm_log.blocked_s += time.perf_counter() - t0


class Pending:
    """A collective in flight; :meth:`wait` returns its result (``finish()`` of the received
    buffers when given, else ``out``)."""

    def __init__(self, work: Any, out: Tensor | list[Tensor] | None,
                 finish: Callable[[], Tensor | list[Tensor]] | None = None) -> None:
        self._work, self._out, self._finish = work, out, finish

    def wait(self) -> Tensor | list[Tensor]:
        if self._work is not None:
            _blocked(self._work.wait)
            self._work = None
        if self._finish is not None:
            self._out, self._finish = self._finish(), None
        return self._out


def all_reduce(
    t: Tensor,
    mesh: DeviceMesh,
    axis: str,
    *,
    op: str = "sum",
    purpose: str = "",
    inplace: bool = False,
    async_op: bool = False,
) -> Any:
    """``op`` (sum, max, min) of ``t`` over the ranks of ``axis``; same shape on every rank.

    Returns a new tensor (``t`` itself when ``inplace`` or the axis has size 1), or a
    :class:`Pending` when ``async_op``.
    """
    red = _reduce_op(op)
    if mesh.size(axis) == 1:
        return Pending(None, t) if async_op else t
    group = mesh.group(axis)
    if _traced():  # a new tensor even when ``inplace``: callers take the returned one
        comm_log.record("all_reduce", mesh, axis, _nbytes(t), purpose, t.dtype)
        out = _funcol().all_reduce(t.contiguous(), op, group)
        return Pending(None, out) if async_op else out
    import torch.distributed as dist

    out = t if inplace else t.clone(memory_format=torch.contiguous_format)
    comm_log.record("all_reduce", mesh, axis, _nbytes(out), purpose, out.dtype)
    work = (dist.all_reduce(out, op=red, group=group, async_op=True) if async_op
            else _blocked(dist.all_reduce, out, op=red, group=group))
    return Pending(work, out) if async_op else out


def _pad0(t: Tensor, n: int) -> Tensor:
    """``t`` (dim 0 first) padded with zeros to ``n`` rows, contiguous."""
    if t.shape[0] == n:
        return t.contiguous()
    return torch.cat([t, t.new_zeros((n - t.shape[0], *t.shape[1:]))]).contiguous()


def all_gather(
    t: Tensor,
    mesh: DeviceMesh,
    axis: str,
    *,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    purpose: str = "",
    async_op: bool = False,
    concat: bool = True,
) -> Tensor | list[Tensor] | Pending:
    """The pieces of the ranks of ``axis`` concatenated along ``dim``, in coordinate order.

    Pieces may differ in length along ``dim``: pass every rank's length in ``sizes`` (a layout
    knows them), or leave it None to exchange them first (one small extra all_gather). Pieces
    travel padded to the longest one. With ``async_op`` (``sizes`` given), a :class:`Pending`.
    ``concat=False``: the list of the ranks' pieces instead (views of the receive buffers, for
    a caller that copies them on into its own tensors: the concatenation would be a copy more).
    """
    k = mesh.size(axis)
    if async_op and sizes is None:
        raise ValueError(f"an asynchronous all_gather needs the sizes ({purpose})")
    if k == 1:
        out = t if concat else [t]
        return Pending(None, out) if async_op else out
    if t.dim() == 0:
        raise ValueError(f"all_gather of a 0-d tensor along dim {dim} ({purpose})")
    d = dim % t.dim()
    group = mesh.group(axis)
    import torch.distributed as dist

    if sizes is None:
        if _traced():
            raise ValueError(f"a traced all_gather over {axis} needs the sizes ({purpose}): "
                             "exchanging them would read a tensor on the host")
        mine = torch.tensor([t.shape[d]], dtype=torch.int64, device=t.device)
        got = [torch.empty_like(mine) for _ in range(k)]
        comm_log.record("all_gather", mesh, axis, _nbytes(mine) * k, f"{purpose} (sizes)",
                        mine.dtype)
        _blocked(dist.all_gather, got, mine, group=group)
        sizes = [int(g.item()) for g in got]
    sizes = [int(s) for s in sizes]
    if len(sizes) != k or sizes[mesh.rank(axis)] != t.shape[d]:
        raise ValueError(
            f"all_gather over {axis} ({purpose}): sizes {sizes} do not fit {k} ranks with this "
            f"rank ({mesh.rank(axis)}) holding {t.shape[d]} along dim {d}"
        )
    longest = max(sizes)
    front = t.movedim(d, 0)
    if longest == 0:
        out = t.clone() if concat else [t.clone() for _ in range(k)]
        return Pending(None, out) if async_op else out
    piece = _pad0(front, longest)
    comm_log.record("all_gather", mesh, axis, _nbytes(piece) * k, purpose, t.dtype)
    if _traced():
        bufs = _funcol_op("all_gather_single", "all_gather_tensor")(piece, 0, group).chunk(k)
        work = None
    else:
        bufs = [torch.empty_like(piece) for _ in range(k)]
        work = (dist.all_gather(bufs, piece, group=group, async_op=True) if async_op
                else _blocked(dist.all_gather, bufs, piece, group=group))

    def finish() -> Tensor | list[Tensor]:
        pieces = [b[:s] for b, s in zip(bufs, sizes)]
        if not concat:
            return [x.movedim(0, d) for x in pieces]
        out = torch.cat(pieces)
        # A fresh tensor, never a view (movedim(0, 0) would be one): callers may key on it.
        return out if d == 0 else out.movedim(0, d).contiguous()

    return Pending(work, None, finish) if async_op else finish()


def all_to_all(
    t: Tensor,
    mesh: DeviceMesh,
    axis: str,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int],
    *,
    purpose: str = "",
) -> Tensor:
    """Rows ``t[sum(send_sizes[:j]) : sum(send_sizes[:j+1])]`` go to the rank at coordinate
    ``j`` of ``axis``; the result is what every rank sent here, concatenated in coordinate order
    (``recv_sizes[j]`` rows from rank ``j``). Splits may be uneven and empty."""
    k = mesh.size(axis)
    send_sizes, recv_sizes = [int(s) for s in send_sizes], [int(s) for s in recv_sizes]
    if len(send_sizes) != k or len(recv_sizes) != k or sum(send_sizes) != t.shape[0]:
        raise ValueError(f"all_to_all over {axis} ({purpose}): send sizes {send_sizes} and "
                         f"receive sizes {recv_sizes} do not fit {k} ranks and {t.shape[0]} rows")
    if k == 1:
        return t
    import torch.distributed as dist

    out = t.new_empty((sum(recv_sizes), *t.shape[1:]))
    comm_log.record("all_to_all", mesh, axis, max(_nbytes(t), _nbytes(out)), purpose, t.dtype)
    if _traced():
        return _funcol().all_to_all_single(t.contiguous(), recv_sizes, send_sizes,
                                           mesh.group(axis))
    _blocked(dist.all_to_all_single, out, t.contiguous(), recv_sizes, send_sizes,
             group=mesh.group(axis))
    return out


def reduce_scatter(
    t: Tensor,
    mesh: DeviceMesh,
    axis: str,
    *,
    dim: int = 0,
    op: str = "sum",
    sizes: Sequence[int] | None = None,
    purpose: str = "",
    async_op: bool = False,
) -> Tensor | Pending:
    """``op`` of ``t`` over the ranks of ``axis``, of which this rank keeps its piece along
    ``dim``: pieces of :func:`chunk_sizes` (torch.chunk's cut) unless ``sizes`` says otherwise.
    With ``async_op``, a :class:`Pending`.
    """
    red = _reduce_op(op)
    k = mesh.size(axis)
    if k == 1:
        return Pending(None, t) if async_op else t
    if t.dim() == 0:
        raise ValueError(f"reduce_scatter of a 0-d tensor ({purpose})")
    d = dim % t.dim()
    sizes = chunk_sizes(t.shape[d], k) if sizes is None else [int(s) for s in sizes]
    if len(sizes) != k or sum(sizes) != t.shape[d] or min(sizes) < 0:
        raise ValueError(
            f"reduce_scatter over {axis} ({purpose}): sizes {sizes} do not cut dim {d} of "
            f"length {t.shape[d]} into {k} pieces"
        )
    mine = sizes[mesh.rank(axis)]
    longest = max(sizes)
    front = t.movedim(d, 0)
    if longest == 0:
        return Pending(None, t.clone()) if async_op else t.clone()
    group = mesh.group(axis)
    import torch.distributed as dist

    pieces = [_pad0(p, longest) for p in torch.split(front, sizes)]
    comm_log.record("reduce_scatter", mesh, axis, _nbytes(pieces[0]) * k, purpose, t.dtype)
    # One flat input (the tensor itself when its pieces are equal and already laid out in
    # order): gloo's list form runs a reduction per piece, 2-2.5x the flat form's time on 4
    # CPU ranks from 4 KiB to 4 MiB (docs/BENCHMARKS.md); NCCL's would flatten it with a copy.
    flat = front.contiguous() if d == 0 and min(sizes) == longest else torch.cat(pieces)
    work = None
    if _traced():
        out = _funcol_op("reduce_scatter_single", "reduce_scatter_tensor")(flat, op, 0, group)
    else:
        out = torch.empty_like(pieces[0])
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = (scatter(out, flat, op=red, group=group, async_op=True) if async_op
                else _blocked(scatter, out, flat, op=red, group=group))

    def finish() -> Tensor:
        return out[:mine].movedim(0, d).contiguous()

    return Pending(work, None, finish) if async_op else finish()


def broadcast(
    t: Tensor, mesh: DeviceMesh, axis: str, *, src: int = 0, purpose: str = ""
) -> Tensor:
    """The tensor of the rank at coordinate ``src`` of ``axis``, on every rank of that axis
    (``t`` gives the shape and dtype elsewhere)."""
    k = mesh.size(axis)
    if not 0 <= src < k:
        raise ValueError(f"broadcast src {src} is outside axis {axis!r} of size {k}")
    if k == 1:
        return t
    group = mesh.group(axis)
    import torch.distributed as dist

    if _traced():
        comm_log.record("broadcast", mesh, axis, _nbytes(t), purpose, t.dtype)
        # The functional op's root is a rank of the group, not of the world.
        root = dist.get_group_rank(group, mesh.group_ranks(axis)[src])
        return _funcol().broadcast(t.contiguous(), root, group)
    out = t.clone(memory_format=torch.contiguous_format)
    comm_log.record("broadcast", mesh, axis, _nbytes(out), purpose, out.dtype)
    _blocked(dist.broadcast, out, src=mesh.group_ranks(axis)[src], group=group)
    return out


def _peer(mesh: DeviceMesh, axis: str, peer: int, what: str) -> int:
    k = mesh.size(axis)
    if not 0 <= peer < k or peer == mesh.rank(axis):
        raise ValueError(
            f"{what} {peer} must be another coordinate of axis {axis!r} (size {k}, this rank "
            f"is {mesh.rank(axis)})"
        )
    return mesh.group_ranks(axis)[peer]


def send(t: Tensor, mesh: DeviceMesh, axis: str, *, dst: int, purpose: str = "") -> None:
    """Send ``t`` to the rank at coordinate ``dst`` of ``axis`` (which calls :func:`recv`)."""
    _untraceable("send", purpose)
    peer = _peer(mesh, axis, dst, "send dst")
    import torch.distributed as dist

    t = t.contiguous()
    comm_log.record("send", mesh, axis, _nbytes(t), purpose, t.dtype)
    _blocked(dist.send, t, dst=peer, group=mesh.group(axis))


def recv(like: Tensor, mesh: DeviceMesh, axis: str, *, src: int, purpose: str = "") -> Tensor:
    """Receive, from the rank at coordinate ``src`` of ``axis``, a tensor shaped like ``like``."""
    _untraceable("recv", purpose)
    peer = _peer(mesh, axis, src, "recv src")
    import torch.distributed as dist

    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    comm_log.record("recv", mesh, axis, _nbytes(out), purpose, out.dtype)
    _blocked(dist.recv, out, src=peer, group=mesh.group(axis))
    return out


# ------------------------------------------------------------------------- point to point
class P2POp(NamedTuple):
    """One half of a point-to-point transfer for :func:`batch_p2p`: ``op`` is ``"send"`` (of
    ``tensor``) or ``"recv"`` (into ``tensor``, a buffer of the right shape and dtype); ``peer``
    the other rank's coordinate on the axis; ``tag`` tells apart transfers between one pair of
    ranks (gloo matches a receive to the send of the same tag; NCCL matches in order)."""

    op: str
    tensor: Tensor
    peer: int
    tag: int = 0
    purpose: str = ""


def batch_p2p(ops: Sequence[P2POp], mesh: DeviceMesh, axis: str) -> list[Pending]:
    """Post the sends and receives of ``ops`` over ``axis`` together, without waiting.

    One ``torch.distributed.batch_isend_irecv`` (a coalesced group under NCCL, so a send and a
    receive between the same two ranks in opposite directions cannot block each other); each
    op is recorded as ``send`` / ``recv`` with its bytes and purpose. Returns one
    :class:`Pending` per op, in order: a receive's ``wait()`` gives its filled buffer, a send's
    ``wait()`` returns once the tensor may be reused.
    """
    if not ops:
        return []
    _untraceable("batch_p2p", ops[0].purpose)
    import torch.distributed as dist

    group = mesh.group(axis)
    p2p = []
    for o in ops:
        if o.op not in ("send", "recv"):
            raise ValueError(f"a P2POp is a 'send' or a 'recv', got {o.op!r} ({o.purpose})")
        if not o.tensor.is_contiguous():
            raise ValueError(f"p2p {o.op} of a non-contiguous tensor ({o.purpose})")
        peer = _peer(mesh, axis, o.peer, f"{o.op} peer")
        comm_log.record(o.op, mesh, axis, _nbytes(o.tensor), o.purpose, o.tensor.dtype)
        fn = dist.isend if o.op == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, o.tensor, peer, group=group, tag=o.tag))
    works = dist.batch_isend_irecv(p2p)
    if len(works) != len(ops):  # NCCL coalesces the batch into one work
        works = [works[0] if works else None] * len(ops)
    return [Pending(w, o.tensor) for w, o in zip(works, ops)]
