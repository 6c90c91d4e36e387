"""Device profiles: the throughputs and link costs the layout search prices a plan with.

A :class:`DeviceProfile` holds, each figure with its source (:class:`Figure`):

* ``matmul[dtype]``: matrix-multiply throughput (FLOP/s) against the cube size ``n`` of an
  ``n x n x n`` product (a table; a GEMM ``m x k x n`` is looked up at ``(m k n)^(1/3)``,
  log-log interpolated, flat beyond the table) and ``attention[dtype]``: causal
  ``scaled_dot_product_attention`` throughput counting ``2 b h t^2 d_h`` FLOPs forward (the
  causal half of ``QK^T`` and ``AV``);
* ``mem_bw``: device memory bandwidth (bytes read + written per second, a copy),
  ``host_bw``: device <-> host, ``host_mem_bw``: host memory (a CPU optimizer step),
  ``memory``: bytes per device, ``op_latency``: seconds to dispatch one small op (what a tiny
  model's step is made of on a CPU), ``stage_call``: seconds of one pipeline stage call's
  fixed work (the runtime's Python, the autograd engine's start for a backward; optional:
  absent, :meth:`DeviceProfile.stage_call_time` assumes 4 ``op_latency``, the ratio measured
  here), ``overlap``: the fraction of asynchronous communication
  (gradient buckets, ZeRO prefetches) that hides under compute (1 with NCCL's own streams; 0
  for gloo on shared CPU cores, whose collectives take the cores the compute needs),
  ``cores``: on a CPU profile, the cores the ranks of a host share (optional: absent, every
  rank owns its device, as on GPUs); the compute figures are one rank's alone on a core, and
  the cost model (:mod:`funcpar.auto.cost`) lets no step be faster than the ranks' work over
  these cores; ``sync_wait``: on CPU ranks, seconds a collective call waits beyond its own
  time when the ranks compute between calls (the spread of their arrivals, a blocked rank's
  wake-up, and where cores are shared its peer's turn on one: measured, a small all_reduce
  after each compute burst against the two alone);
* collectives: either measured ``collectives[op][n] = (alpha, beta)`` (seconds, seconds per
  byte in :mod:`funcpar.shard.comm`'s byte convention, fitted on ``n`` ranks) or link figures
  ``links["intra"|"inter"] = {bw, alpha}`` priced as rings: ``hops alpha + f bytes / bw`` with
  ``f = 2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather, reduce_scatter and
  all_to_all, 1 for p2p and broadcast (pipelined); ``hops = 2 log2 n`` for all_reduce (NCCL's
  trees), ``log2 n`` for broadcast, ``n - 1`` for the others, 1 for p2p. A broadcast without a
  fit of its own is priced as the all_gather that moves as many bytes into each rank. A group
  whose ranks lie within ``gpus_per_node`` consecutive ranks uses ``intra``
  (NVLink), any other ``inter`` (InfiniBand per GPU).

:func:`measure` fills one on the current devices (``python -m funcpar.profile``);
:func:`load_profile` reads JSON or a shipped reference (``funcpar/auto/profiles/*.json``:
``h100``, ``a100``, built from published figures with their sources).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from funcpar.auto.model import OPS_FWD

__all__ = ["DeviceProfile", "Figure", "load_profile", "measure", "shipped_profiles"]

PROFILE_DIR = Path(__file__).parent / "profiles"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STAGE_CALL_OPS = 4  # a stage call in dispatched ops, when not measured (21 us / 5.9 us on gloo CPU)


@dataclasses.dataclass(frozen=True)
class Figure:
    """A number and where it comes from (a datasheet, a paper, a measurement)."""

    value: float
    source: str

    def to_json(self) -> dict:
        return {"value": self.value, "source": self.source}


def _fig(x: Any) -> Figure:
    return Figure(float(x["value"]), str(x["source"])) if isinstance(x, dict) else Figure(
        float(x), "unlabelled")


@dataclasses.dataclass(eq=False)  # hashed by identity: the cost model caches per profile
class DeviceProfile:
    """What the cost model knows of a device and its links (module docstring)."""

    name: str
    matmul: dict[str, list[tuple[int, Figure]]]
    attention: dict[str, Figure]
    mem_bw: Figure
    host_bw: Figure
    host_mem_bw: Figure
    memory: Figure
    op_latency: Figure
    overlap: Figure
    gpus_per_node: int = 8
    links: dict[str, dict[str, Figure]] = dataclasses.field(default_factory=dict)
    collectives: dict[str, dict[int, tuple[float, float]]] = dataclasses.field(
        default_factory=dict)
    collectives_source: str = ""
    description: str = ""
    nominal: dict[str, Figure] = dataclasses.field(default_factory=dict)
    stage_call: Figure | None = None
    cores: Figure | None = None
    sync_wait: Figure | None = None

    # --------------------------------------------------------------------------- lookups
    def stage_call_time(self) -> float:
        """Seconds of a pipeline stage call's fixed work (``stage_call``; without the figure,
        4 dispatched ops' worth)."""
        return self.stage_call.value if self.stage_call is not None else \
            STAGE_CALL_OPS * self.op_latency.value

    def peak_flops(self, dtype: str) -> float:
        """MFU's denominator: the datasheet peak (``nominal``) where the profile has one,
        else the table's highest matmul throughput for ``dtype``."""
        if dtype in self.nominal:
            return self.nominal[dtype].value
        return max(f.value for _, f in self._table(dtype))

    def _table(self, dtype: str) -> list[tuple[int, Figure]]:
        if dtype not in self.matmul:
            raise KeyError(f"profile {self.name!r} has no matmul figure for {dtype}; it has "
                           f"{sorted(self.matmul)}")
        return self.matmul[dtype]

    def matmul_rate(self, dtype: str, m: float, k: float, n: float) -> float:
        """FLOP/s of an ``m x k x n`` product (module docstring)."""
        table = self._table(dtype)
        g = max(1.0, (m * k * n) ** (1 / 3))
        sizes = [s for s, _ in table]
        i = bisect.bisect_left(sizes, g)
        if i == 0:
            return table[0][1].value
        if i == len(table):
            return table[-1][1].value
        (s0, f0), (s1, f1) = table[i - 1], table[i]
        w = (math.log(g) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return math.exp((1 - w) * math.log(f0.value) + w * math.log(f1.value))

    def attention_rate(self, dtype: str) -> float:
        return self.attention[dtype].value if dtype in self.attention else \
            self.attention[next(iter(self.attention))].value

    def collective_time(self, op: str, nbytes: float, n: int, span: int) -> float:
        """Seconds of one ``op`` moving ``nbytes`` over a group of ``n`` ranks spanning
        ``span`` consecutive ranks (module docstring)."""
        if n <= 1:
            return 0.0
        if op == "broadcast" and op not in self.collectives and self.collectives:
            # Not measured: a pipelined broadcast moves its bytes once into each rank, as an
            # all_gather of n / (n - 1) times them does (2D tensor parallelism's panels).
            return self.collective_time("all_gather", nbytes * n / (n - 1), n, span)
        fitted = self.collectives.get(op)
        if fitted:
            sizes = sorted(fitted)
            near = min(sizes, key=lambda x: (abs(math.log(x / n)), x))
            alpha, beta = fitted[near]
            if near != n:  # scale to this group size by the ring factor
                beta *= _ring(op, n) / _ring(op, near)
                alpha *= _hops(op, n) / _hops(op, near)
            return alpha + beta * nbytes
        link = self.links["intra" if span <= self.gpus_per_node else "inter"]
        return _hops(op, n) * link["alpha"].value + _ring(op, n) * nbytes / link["bw"].value

    # ------------------------------------------------------------------------------ json
    def to_json(self) -> dict:
        return {
            "name": self.name, "description": self.description,
            "matmul": {d: [[s, f.to_json()] for s, f in t] for d, t in self.matmul.items()},
            "attention": {d: f.to_json() for d, f in self.attention.items()},
            "mem_bw": self.mem_bw.to_json(), "host_bw": self.host_bw.to_json(),
            "host_mem_bw": self.host_mem_bw.to_json(), "memory": self.memory.to_json(),
            "op_latency": self.op_latency.to_json(), "overlap": self.overlap.to_json(),
            "gpus_per_node": self.gpus_per_node,
            "links": {k: {n: f.to_json() for n, f in v.items()} for k, v in self.links.items()},
            "collectives": {op: {str(n): list(ab) for n, ab in v.items()}
                            for op, v in self.collectives.items()},
            "collectives_source": self.collectives_source,
            "nominal": {d: f.to_json() for d, f in self.nominal.items()},
            **({"stage_call": self.stage_call.to_json()} if self.stage_call else {}),
            **({"cores": self.cores.to_json()} if self.cores else {}),
            **({"sync_wait": self.sync_wait.to_json()} if self.sync_wait else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> DeviceProfile:
        return cls(
            name=d["name"], description=d.get("description", ""),
            matmul={k: sorted((int(s), _fig(f)) for s, f in v) for k, v in d["matmul"].items()},
            attention={k: _fig(v) for k, v in d["attention"].items()},
            mem_bw=_fig(d["mem_bw"]), host_bw=_fig(d["host_bw"]),
            host_mem_bw=_fig(d["host_mem_bw"]), memory=_fig(d["memory"]),
            op_latency=_fig(d["op_latency"]), overlap=_fig(d["overlap"]),
            gpus_per_node=int(d.get("gpus_per_node", 8)),
            links={k: {n: _fig(f) for n, f in v.items()} for k, v in d.get("links", {}).items()},
            collectives={op: {int(n): (float(a), float(b)) for n, (a, b) in v.items()}
                         for op, v in d.get("collectives", {}).items()},
            collectives_source=d.get("collectives_source", ""),
            nominal={k: _fig(v) for k, v in d.get("nominal", {}).items()},
            stage_call=_fig(d["stage_call"]) if "stage_call" in d else None,
            cores=_fig(d["cores"]) if "cores" in d else None,
            sync_wait=_fig(d["sync_wait"]) if "sync_wait" in d else None,
        )

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    def describe(self) -> str:
        """The figures with their sources, one per line."""
        lines = [f"profile {self.name}: {self.description}".rstrip(": ")]
        for d, t in self.matmul.items():
            s, f = max(t, key=lambda x: x[1].value)
            lines.append(f"  matmul {d}: {f.value / 1e12:,.3f} TFLOP/s at n={s} ({f.source})")
        for d, f in self.nominal.items():
            lines.append(f"  nominal peak {d}: {f.value / 1e12:,.1f} TFLOP/s ({f.source})")
        for d, f in self.attention.items():
            lines.append(f"  attention {d}: {f.value / 1e12:,.3f} TFLOP/s ({f.source})")
        for name in ("mem_bw", "host_bw", "host_mem_bw"):
            f = getattr(self, name)
            lines.append(f"  {name}: {f.value / 1e9:,.1f} GB/s ({f.source})")
        lines.append(f"  memory: {self.memory.value / 2**30:,.1f} GiB ({self.memory.source})")
        lines.append(f"  op_latency: {self.op_latency.value * 1e6:.1f} us "
                     f"({self.op_latency.source})")
        lines.append(f"  overlap: {self.overlap.value:.2f} ({self.overlap.source})")
        if self.stage_call is not None:
            lines.append(f"  stage_call: {self.stage_call.value * 1e6:.1f} us "
                         f"({self.stage_call.source})")
        if self.cores is not None:
            lines.append(f"  cores: {self.cores.value:g} shared by a host's ranks "
                         f"({self.cores.source})")
        if self.sync_wait is not None:
            lines.append(f"  sync_wait: {self.sync_wait.value * 1e6:.0f} us a collective "
                         f"({self.sync_wait.source})")
        for k, v in self.links.items():
            lines.append(f"  link {k}: {v['bw'].value / 1e9:,.1f} GB/s ({v['bw'].source}), "
                         f"alpha {v['alpha'].value * 1e6:.1f} us ({v['alpha'].source})")
        for op, v in self.collectives.items():
            fits = ", ".join(f"n={n}: {a * 1e6:.0f} us + {1 / b / 1e9:.2f} GB/s"
                             for n, (a, b) in sorted(v.items()))
            lines.append(f"  {op}: {fits} ({self.collectives_source})")
        return "\n".join(lines)


def _ring(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    return 1.0 if op in ("p2p", "broadcast") else (n - 1) / n


def _hops(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * math.ceil(math.log2(n))
    if op == "broadcast":
        return float(math.ceil(math.log2(n)))
    return 1.0 if op == "p2p" else float(n - 1)


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(profile: str | os.PathLike | DeviceProfile | None = None) -> DeviceProfile:
    """A :class:`DeviceProfile`: itself, a JSON file, or a shipped name (``"h100"``,
    ``"a100"``). None: ``"h100"``."""
    if isinstance(profile, DeviceProfile):
        return profile
    name = "h100" if profile is None else str(profile)
    path = Path(name)
    if not path.suffix and (PROFILE_DIR / f"{name}.json").exists():
        path = PROFILE_DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"no device profile {name!r}: pass a JSON file written by "
                         f"python -m funcpar.profile or one of {shipped_profiles()}")
    return DeviceProfile.from_json(json.loads(path.read_text()))


# --------------------------------------------------------------------------- measuring
def _timed(fn: Any, reps: int, sync: Any, best: bool = False) -> float:
    """Median seconds of ``fn`` over ``reps`` (after one warm-up); ``best``: the fastest, for
    one device's own work, which other processes on shared cores only ever slow down."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times) if best else statistics.median(times)


def measure(device: str | torch.device = "cpu", *, dtypes: tuple[str, ...] = ("fp32", "bf16"),
            sizes: tuple[int, ...] | None = None, mesh_axes: dict[str, int] | None = None,
            comm_sizes: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24),
            reps: int = 5, name: str | None = None) -> DeviceProfile:
    """Measure a profile on ``device`` (``reps`` repetitions a figure). Under torchrun (a
    process group initialised), also the collectives of every axis of
    ``DeviceMesh.from_env(**mesh_axes)`` (default: one axis over the world, and ``dp x tp=2``
    when the world is even), fitted per group size over ``comm_sizes`` bytes (:func:`_fit`).

    The device's own figures (matmul, attention, bandwidths, latencies) are the fastest of
    ``reps``, each rank measuring alone: on a CPU whose cores the ranks share, one rank at a
    time while the others wait, so they are one rank's speed on a core of its own, and
    ``cores`` records how many cores the ranks share (the cost model divides the ranks' work
    among them). The collectives are medians over all ranks at once, as a step runs them."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    import torch.distributed as dist

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sizes = sizes or ((1024, 2048, 4096, 8192) if cuda else (32, 64, 128, 256, 512))
    src = f"measured on {device} ({torch.cuda.get_device_name(device) if cuda else 'cpu'}, " \
          f"{torch.get_num_threads()} threads), {time.strftime('%Y-%m-%d')}"
    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if group and not cuda:
        figures: dict[str, Any] = {}
        for r in range(dist.get_world_size()):
            if dist.get_rank() == r:
                figures = _device_figures(device, dtypes, sizes, reps, sync, src)
            dist.barrier()
    else:
        figures = _device_figures(device, dtypes, sizes, reps, sync, src)
    cores = None
    if not cuda:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        cores = Figure(float(n or 1), src + ", the CPUs this process may run on")
    prof = DeviceProfile(
        name=name or f"measured-{device.type}", **figures,
        memory=Figure(float(torch.cuda.get_device_properties(device).total_memory if cuda
                            else _host_memory()), src),
        overlap=Figure(1.0 if cuda else 0.0, "assumed: NCCL runs on its own streams" if cuda
                       else "assumed: gloo collectives take the CPU cores the compute uses"),
        gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        description=f"measured with python -m funcpar.profile on {device}", cores=cores,
    )
    if group:
        prof.collectives = _measure_collectives(device, mesh_axes, comm_sizes, reps, sync)
        prof.collectives_source = src + f", {dist.get_backend()} over " \
            f"{dist.get_world_size()} ranks, alpha + beta * bytes fitted over {list(comm_sizes)}"
        if cores is not None:
            prof.sync_wait = Figure(_sync_wait(), src + f", {dist.get_world_size()} ranks on "
                                    f"{cores.value:g} cores: a 4 KiB all_reduce of pairs "
                                    f"after a compute burst less the two alone, medians of "
                                    f"40 in alternated runs")
    return prof


def _sync_wait(iters: int = 40) -> float:
    """Seconds a collective call waits, beyond its own time, when CPU ranks compute between
    calls: every rank times a compute burst (a few ms of matmuls), a 4 KiB all_reduce over
    pairs of ranks (every pair at once; the world when it is 2 or odd), and the burst
    followed by the all_reduce, each in runs of 10; the median of the third less those of
    the first two, at least 0. Blocked in the collective, a rank sleeps; the call ends once
    the later peer has arrived (the bursts' spread) and the sleeper has woken, and where the
    ranks outnumber the cores, once a peer that other ranks' compute held off its core has
    run again (1.6-1.8 ms on 2 ranks here, 1.5-2.1 ms on 4; back to back, the all_reduces
    keep every rank in the collective and wait for none of this)."""
    import torch.distributed as dist

    from funcpar.shard import comm
    from funcpar.shard.mesh import DeviceMesh

    world = dist.get_world_size()
    pairs = world % 2 == 0 and world > 2
    mesh = DeviceMesh.from_env(dp=world // 2, tp=2) if pairs else DeviceMesh.from_env(dp=world)
    axis = "tp" if pairs else "dp"
    a = torch.randn(256, 256)
    t = torch.zeros(1024)

    def burst() -> None:
        for _ in range(5):
            a @ a

    def reduce() -> None:
        comm.all_reduce(t, mesh, axis)

    def both() -> None:
        burst()
        reduce()

    times: list[list[float]] = [[], [], []]
    # Each kind in runs of 10 (a collective alone right after a burst would wait as well),
    # the runs alternated so that a slow spell lands on every kind.
    for _ in range(iters // 10):
        for i, fn in enumerate((burst, reduce, both)):
            dist.barrier()
            for _ in range(10):
                s = time.perf_counter()
                fn()
                times[i].append(time.perf_counter() - s)
    b, r, br = (statistics.median(x) for x in times)
    return max(0.0, br - b - r)


def _device_figures(device: torch.device, dtypes: tuple[str, ...], sizes: tuple[int, ...],
                    reps: int, sync: Any, src: str) -> dict[str, Any]:
    """matmul, attention, mem_bw, host_bw, host_mem_bw, op_latency and stage_call of one
    device, each the fastest of ``reps`` (a device's speed; anything sharing it only slows
    it down)."""
    cuda = device.type == "cuda"
    matmul: dict[str, list[tuple[int, Figure]]] = {}
    attention: dict[str, Figure] = {}
    for d in dtypes:
        dt = DTYPE_NAMES[d]
        table = []
        for n in sizes:
            a = torch.randn(n, n, device=device, dtype=dt)
            b = torch.randn(n, n, device=device, dtype=dt)
            t = _timed(lambda a=a, b=b: a @ b, reps, sync, best=True)
            table.append((n, Figure(2 * n**3 / t, src)))
        matmul[d] = table
        bsz, h, seq, hd = (4, 16, 1024, 64) if cuda else (2, 4, 256, 32)
        q = torch.randn(bsz, h, seq, hd, device=device, dtype=dt)
        t = _timed(lambda q=q: torch.nn.functional.scaled_dot_product_attention(
            q, q, q, is_causal=True), reps, sync, best=True)
        attention[d] = Figure(2 * bsz * h * seq * seq * hd / t, src)
    x = torch.empty(16 << 20, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    mem_bw = Figure(2 * x.nbytes / _timed(lambda: y.copy_(x), reps, sync, best=True),
                    src + ", a copy")
    host_mem_bw = mem_bw
    if cuda:
        h = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host_bw = Figure(x.nbytes / _timed(lambda: h.copy_(x, non_blocking=True), reps, sync),
                         src + ", device to pinned host")
        hy = torch.empty_like(h)
        host_mem_bw = Figure(2 * h.nbytes / _timed(lambda: hy.copy_(h), reps, lambda: None),
                             src + ", host copy")
    else:
        host_bw = Figure(mem_bw.value, src + " (host memory: the device is the host)")
    lat = _op_latency(device, reps, sync)
    call = _stage_call_latency(device, reps, sync)
    return {
        "matmul": matmul, "attention": attention, "mem_bw": mem_bw, "host_bw": host_bw,
        "host_mem_bw": host_mem_bw,
        "op_latency": Figure(lat, src + f", forward + backward of a tiny Llama block over "
                             f"{3 * OPS_FWD} ops"),
        "stage_call": Figure(call, src + ", a one-op stage's forward and autograd.grad "
                             "backward with the pipeline runtime's per-call bookkeeping"),
    }


def _op_latency(device: torch.device, reps: int, sync: Any) -> float:
    """Seconds per dispatched op of a training step: the forward and backward of a Llama block
    too small to compute anything (dim 32, 4 tokens), over the ``3 x OPS_FWD`` ops the cost
    model counts for it (funcpar.auto.model.OPS_FWD)."""
    from funcpar.models.llama import Llama, LlamaConfig, rotary_cos_sin

    cfg = LlamaConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, max_seq_len=4)
    block = Llama(cfg, device=device).layers[0]
    x = torch.randn(1, 4, 32, device=device, requires_grad=True)
    cos, sin = rotary_cos_sin(4, cfg.head_dim, cfg.rope_theta, dtype=x.dtype, device=device)

    def step() -> None:
        block(x, cos, sin).sum().backward()

    return _timed(step, max(reps, 10), sync, best=True) / (3 * OPS_FWD)


def _stage_call_latency(device: torch.device, reps: int, sync: Any) -> float:
    """Seconds of a pipeline stage call's fixed work, half a forward and backward pair of
    ``funcpar.pipeline.runtime``'s kind on a stage of one tiny op: the input detached and
    marked, the call, ``torch.autograd.grad`` for the leaf and the input, the accumulation."""
    w = torch.randn(4, device=device, requires_grad=True)
    acc = torch.zeros(4, device=device)

    def pair() -> None:
        x = torch.randn(4, device=device).detach().requires_grad_()
        held = {(0, 0): (x, (x * w).sum())}
        x, out = held.pop((0, 0))
        got = torch.autograd.grad([out], [w, x], allow_unused=True)
        acc.add_(got[0])

    return _timed(pair, max(reps, 20), sync, best=True) / 2


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover
        return 0


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``t = alpha + beta * bytes`` by least squares of the relative error (each point weighed
    by ``1 / t^2``), alpha and beta kept >= 0: plain least squares lets the largest size
    decide alpha, which then misprices the small collectives a step makes by the hundred."""
    w = [1.0 / max(y, 1e-12) ** 2 for _, y in points]
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    var = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    beta = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / var if var else 0.0
    beta = max(beta, 1e-15)
    return max(my - beta * mx, 0.0), beta


def _measure_collectives(device: torch.device, mesh_axes: dict[str, int] | None,
                         comm_sizes: tuple[int, ...], reps: int, sync: Any
                         ) -> dict[str, dict[int, tuple[float, float]]]:
    import torch.distributed as dist

    from funcpar.shard import comm
    from funcpar.shard.mesh import DeviceMesh

    world = dist.get_world_size()
    meshes = [dict(mesh_axes)] if mesh_axes else [{"dp": world}]
    if not mesh_axes and world % 2 == 0 and world > 2:
        meshes.append({"dp": world // 2, "tp": 2})
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for axes in meshes:
        mesh = DeviceMesh.from_env(**axes)
        for axis, n in mesh.shape.items():
            if n == 1:
                continue
            for op in COLLECTIVES:
                if op == "p2p" and op in out:  # one pair of ranks, whatever the axis size
                    continue
                pts = []
                for nbytes in comm_sizes:
                    t = torch.zeros(max(n, nbytes // 4) // n * n, device=device)
                    fn = _collective(op, t, mesh, axis, comm)
                    dist.barrier()
                    # p2p: two round trips, four one-way transfers, per fit point
                    per = 4 if op == "p2p" else 1
                    # Medians of at least 10: on shared cores a collective waits for every
                    # rank to be scheduled, milliseconds of noise per call.
                    pts.append((_bytes(op, t, n), _timed(fn, max(reps, 10), sync) / per))
                out.setdefault(op, {})[2 if op == "p2p" else n] = _fit(pts)
    return out


def _bytes(op: str, t: torch.Tensor, n: int) -> int:
    """The comm log's convention: all_gather's gathered output, the others their input."""
    return t.nbytes * n if op == "all_gather" else t.nbytes


def _collective(op: str, t: torch.Tensor, mesh: Any, axis: str, comm: Any) -> Any:
    n = mesh.size(axis)
    if op == "all_reduce":
        return lambda: comm.all_reduce(t, mesh, axis)
    if op == "all_gather":
        return lambda: comm.all_gather(t, mesh, axis, sizes=[t.shape[0]] * n)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(t, mesh, axis)
    if op == "all_to_all":
        k = t.shape[0] // n
        return lambda: comm.all_to_all(t, mesh, axis, [k] * n, [k] * n)
    me = mesh.rank(axis)

    def pingpong() -> None:  # coordinates 0 and 1 exchange; half the round trip
        if me == 0:
            comm.send(t, mesh, axis, dst=1)
            comm.recv(t, mesh, axis, src=1)
        elif me == 1:
            comm.recv(t, mesh, axis, src=0)
            comm.send(t, mesh, axis, dst=0)

    def p2p() -> None:
        pingpong()
        pingpong()

    return p2p
