"""Optimizer step time and state size: each funcpar optimizer against its peers, same run.

The parameter set is shaped like a decoder (an embedding, blocks of four square projections, two
up-projections, one down-projection and two norms, a final norm). At ``--preset h100`` it is the
888 M-parameter set of shared/PEERS.md; the default ``cpu`` preset is a scaled-down copy (2.6 M
parameters) that a 2-core machine steps in milliseconds. Gradients are random and fixed.

Each algorithm is a *group*: the funcpar optimizer and the peers configured to compute the same
thing (the pairs the tests check step by step; e.g. funcpar's Lamb ``variant="torch_optimizer"``
against ``torch_optimizer.Lamb``). Within a group every optimizer is built, warmed up
(``--warmup`` steps: GaLore's SVD happens at the first step, so the timed steps are the ones
between projector refreshes, ``update_proj_gap`` = 200 here), then timed in ``--reps`` rounds
of ``--steps`` steps each, the optimizers interleaved and their order rotated every round, so
machine noise hits all of them alike; the median step time is reported. Only one group is alive
at a time (at the h100 preset a group holds tens of GB).

Columns: ms per step (the median, and the fastest step: on a shared machine the median is
noisy); bytes per parameter the algorithm must move at the least (our count: each tensor read
or written once per step, BYTES_PER_PARAM) and the % of that floor
reached (bytes / device copy bandwidth measured in the same run); on funcpar's kernel rows
(CUDA) also the bytes its kernels' passes move (KERNEL_BYTES_PER_PARAM: more than the floor
where a whole-leaf reduction must finish before the update) and the % of that;
optimizer-state bytes in total and per parameter; and, on each peer's row,
``peer ms / funcpar ms`` for the funcpar optimizer of its group (of the medians, and of the
fastest steps): > 1 means funcpar is faster, < 1 that it is slower (reported as such).
The funcpar step timed is :func:`funcpar.optim.update_params` (what TrainStep runs: the fused
``apply`` where an optimizer has one, else ``update`` + ``apply_updates``) in the kernel mode
``auto`` (funcpar.kernels: the Triton kernels on CUDA, the plain-torch references elsewhere);
``--reference`` adds a row per funcpar optimizer timed with the references (mode
``reference``), whose last column is then ``reference ms / kernels ms``. The peers' step is
``optimizer.step()``. ``--donate`` adds a row per funcpar optimizer stepped inside
:func:`funcpar.kernels.inplace.inplace_updates` (a donated train step: the fast paths write
params and state in place instead of into clones; its last column: the fastest peer's ms over
its own). Peers not installed (bitsandbytes, say)
are skipped with a note. Usage::

    python benchmarks/bench_optim.py --preset cpu --threads 1   # CPU (the default), ~3 min
    python benchmarks/bench_optim.py --preset h100 --device cuda --reference   # the issue's table
    python benchmarks/bench_optim.py --only lamb,galore_adamw
    python benchmarks/bench_optim.py --preset tiny --steps 1 --reps 1   # smoke run, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

import funcpar.optim as fo
from funcpar.kernels import kernel_mode
from funcpar.kernels.inplace import inplace_updates
from funcpar.optim.memory import state_bytes

PRESETS = {
    # vocab, dim, ffn, blocks, GaLore rank
    "h100": (32000, 2048, 5632, 16, 512),
    "cpu": (4000, 256, 704, 2, 64),
    "tiny": (500, 64, 176, 1, 16),
}

# Bytes per fp32 parameter each algorithm must move at the least: reads and writes of the
# parameter, its gradient and each full-size state (factored and low-rank states negligible).
BYTES_PER_PARAM = {
    "sgd": 20,  # p r/w, g r, momentum r/w
    "adamw": 28,  # p r/w, g r, m r/w, v r/w
    "adafactor": 16,  # g read twice (statistics, update), p r/w
    "adafactor_torch": 16,
    "came": 24,  # g twice, p r/w, m r/w
    "lamb": 28,
    "adamw8bit": 16,  # p r/w, g r, two 8-bit moments r/w (block scales negligible)
    "galore_adamw": 16,  # g read twice (projection; 1-D leaves' Adam), p r/w
    "galore_adafactor": 16,
    "galore_adamw8bit": 16,
}

# Bytes per fp32 parameter funcpar's kernels move (funcpar.kernels, docs/KERNELS.md), where
# they differ from the count above: a reduction over a whole leaf that must complete before
# any of its elements can be updated (Lamb's trust ratio, the update clipping of Adafactor and
# CAME) costs one more pass over tensors larger than the GPU's L2 cache (50 MB on an H100; the
# embedding alone is 262 MB). Lamb: pass 1 reads p, g, m, v and writes m, v (24), pass 2 reads
# p, m, v and writes p (16). Adafactor: g read by the statistics, update-norm and update passes
# (12), p r/w (8). CAME: statistics and norm passes read g (8), the residual pass reads g and
# m and writes m (12), the update pass reads g and m, writes p (16). 8-bit AdamW: the fused
# step writes its direction (4 B) and the parameter update is a separate torch pass (p r/w and
# the direction read: 12), so 24 where writing the parameter in the kernel would make it 16.
KERNEL_BYTES_PER_PARAM = {"adafactor": 20, "came": 32, "lamb": 40, "adamw8bit": 24}

LR = 1e-3


def decoder_shapes(vocab: int, dim: int, ffn: int, blocks: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, dim)}
    for b in range(blocks):
        for n in ("q", "k", "v", "o"):
            shapes[f"l{b}.{n}"] = (dim, dim)
        shapes[f"l{b}.gate"] = (ffn, dim)
        shapes[f"l{b}.up"] = (ffn, dim)
        shapes[f"l{b}.down"] = (dim, ffn)
        shapes[f"l{b}.norm1"] = (dim,)
        shapes[f"l{b}.norm2"] = (dim,)
    shapes["norm"] = (dim,)
    return shapes


@dataclass
class Entry:
    who: str  # "funcpar ..." or the peer's name
    build: Callable[[], object]  # funcpar: () -> GradientTransformation; peer: list -> Optimizer
    mode: str = "auto"  # funcpar's kernel mode (funcpar.kernels.kernel_mode)
    donate: bool = False  # funcpar: step inside inplace_updates() (a donated train step)

    @property
    def ours(self) -> bool:
        return self.who.startswith("funcpar")


def _peer(module: str, attr: str, **kwargs) -> Callable[[list], torch.optim.Optimizer]:
    def make(params: list) -> torch.optim.Optimizer:
        cls = importlib.import_module(module)
        for part in attr.split("."):
            cls = getattr(cls, part)
        return cls(params, **kwargs)

    return make


def _galore_peer(cls_name: str, rank: int, **kwargs) -> Callable[[list], torch.optim.Optimizer]:
    """galore-torch with every 2-D leaf projected (funcpar's default ``galore_mask``)."""

    def make(params: list) -> torch.optim.Optimizer:
        cls = getattr(importlib.import_module("galore_torch"), cls_name)
        groups = [{"params": [p for p in params if p.dim() != 2]},
                  {"params": [p for p in params if p.dim() == 2], "rank": rank,
                   "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}]
        return cls(groups, **kwargs)

    return make


def groups(rank: int) -> dict[str, list[Entry]]:
    """The peer list. Per algorithm: a funcpar optimizer, then the peers that compute the same
    (their rows are compared with the funcpar row above them)."""
    hf_af = dict(lr=LR, relative_step=False, scale_parameter=False)
    return {
        "sgd": [Entry("funcpar", lambda: fo.sgd(lr=LR, momentum=0.9)),
                Entry("torch.optim.SGD foreach",
                      _peer("torch.optim", "SGD", lr=LR, momentum=0.9, foreach=True))],
        "adamw": [Entry("funcpar", lambda: fo.adamw(lr=LR)),
                  Entry("torch AdamW foreach",
                        _peer("torch.optim", "AdamW", lr=LR, foreach=True)),
                  Entry("torch AdamW fused", _peer("torch.optim", "AdamW", lr=LR, fused=True))],
        "adafactor": [Entry("funcpar", lambda: fo.adafactor(**hf_af)),
                      Entry("transformers Adafactor",
                            _peer("transformers.optimization", "Adafactor", **hf_af))],
        "adafactor_torch": [Entry("funcpar", lambda: fo.adafactor_torch(lr=LR)),
                            Entry("torch.optim.Adafactor foreach",
                                  _peer("torch.optim", "Adafactor", lr=LR, foreach=True))],
        "came": [Entry("funcpar", lambda: fo.came(lr=LR)),
                 Entry("came-pytorch CAME", _peer("came_pytorch", "CAME", lr=LR))],
        "lamb": [Entry("funcpar (torch_optimizer)",
                       lambda: fo.lamb(lr=LR, variant="torch_optimizer")),
                 Entry("torch-optimizer Lamb", _peer("torch_optimizer", "Lamb", lr=LR)),
                 Entry("funcpar (pytorch_optimizer)",
                       lambda: fo.lamb(lr=LR, variant="pytorch_optimizer")),
                 Entry("pytorch-optimizer Lamb", _peer("pytorch_optimizer", "Lamb", lr=LR))],
        # AdamW with blockwise 8-bit moments: GaLore's 8-bit AdamW with nothing projected.
        "adamw8bit": [Entry("funcpar (8-bit states)",
                            lambda: fo.galore_adamw(lr=LR, rank=rank, eight_bit=True,
                                                    adam_variant="bnb", eps=1e-8,
                                                    weight_decay=0.0,
                                                    galore_mask=lambda name, p: False)),
                      Entry("bitsandbytes AdamW8bit",
                            _peer("bitsandbytes.optim", "AdamW8bit", lr=LR, eps=1e-8,
                                  weight_decay=0.0))],
        "galore_adamw": [Entry("funcpar", lambda: fo.galore_adamw(lr=LR, rank=rank)),
                         Entry("galore-torch GaLoreAdamW",
                               _galore_peer("GaLoreAdamW", rank, lr=LR))],
        "galore_adafactor": [Entry("funcpar", lambda: fo.galore_adafactor(**hf_af, rank=rank)),
                             Entry("galore-torch GaLoreAdafactor",
                                   _galore_peer("GaLoreAdafactor", rank, **hf_af))],
        "galore_adamw8bit": [
            Entry("funcpar", lambda: fo.galore_adamw(lr=LR, rank=rank, eight_bit=True,
                                                     adam_variant="bnb", eps=1e-8,
                                                     weight_decay=0.0)),
            Entry("galore-torch GaLoreAdamW8bit (bnb)",
                  _galore_peer("GaLoreAdamW8bit", rank, lr=LR, eps=1e-8, weight_decay=0.0)),
        ],
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def _cpu_cuda_sync_is_noop(device: str) -> Iterator[None]:
    # GaLoreAdamW8bit calls torch.cuda.synchronize() after every parameter, which raises on a
    # CPU-only torch; on CPU there is nothing to wait for.
    if device.startswith("cuda") or torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.synchronize = saved


def copy_bandwidth(device: str, numel: int) -> float:
    """Bytes per second of a device copy of ``numel`` floats (the parameter count, so that a
    CPU's caches help the copy as much as they help the optimizers), counting bytes read and
    written; the fastest of 20 copies (a shared machine slows some of them)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(20):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / min(times)


class Runner:
    """One optimizer with its own copy of the parameters; ``step()`` is what is timed."""

    def __init__(self, entry: Entry, params: dict, grads: dict):
        self.entry = entry
        if entry.ours:
            self.opt = entry.build()
            self.params = {k: v.clone() for k, v in params.items()}
            self.grads = grads
            self.state = self.opt.init(self.params)
        else:
            self.live = [v.clone().requires_grad_() for v in params.values()]
            # Each peer gets its own gradients, set again before every step (as a backward
            # would): GaLoreAdamW8bit leaves the low-rank gradient in p.grad.
            self.peer_grads = [g.clone() for g in grads.values()]
            self.opt = entry.build(self.live)

    def step(self) -> None:
        if self.entry.ours:
            with kernel_mode(self.entry.mode), inplace_updates(self.entry.donate):
                self.params, self.state = fo.update_params(self.opt, self.grads, self.state,
                                                           self.params)
        else:
            for p, g in zip(self.live, self.peer_grads):
                p.grad = g
            self.opt.step()

    def state_bytes(self) -> int:
        if self.entry.ours:
            return state_bytes(self.state)
        total = 0
        for s in self.opt.state.values():
            for v in s.values():
                if hasattr(v, "ortho_matrix"):  # galore-torch's projector object
                    mats = v.ortho_matrix if isinstance(v.ortho_matrix, list) else [v.ortho_matrix]
                    v = [m for m in mats if torch.is_tensor(m)]
                for t in v if isinstance(v, list) else [v]:
                    if torch.is_tensor(t):
                        total += t.numel() * t.element_size()
        return total


def time_group(entries: list[Entry], params, grads, device, warmup, steps, reps):
    """[(entry, median ms, min ms, state bytes, note)] (None where skipped), interleaved."""
    runners, out = [], {}
    for e in entries:
        try:
            r = Runner(e, params, grads)
            for _ in range(warmup):
                r.step()
            _sync(device)
            runners.append(r)
        except (ImportError, AttributeError, RuntimeError, ValueError, TypeError) as err:
            out[e.who] = (None, None, None, f"skipped: {type(err).__name__}: {err}"[:100])
    times: dict[str, list[float]] = {r.entry.who: [] for r in runners}
    for rep in range(reps):
        k = rep % max(len(runners), 1)
        for r in runners[k:] + runners[:k]:  # rotate the order every round
            for _ in range(steps):
                _sync(device)
                t = time.perf_counter()
                r.step()
                _sync(device)
                times[r.entry.who].append(time.perf_counter() - t)
    for r in runners:
        out[r.entry.who] = (statistics.median(times[r.entry.who]) * 1e3,
                            min(times[r.entry.who]) * 1e3, r.state_bytes(), "")
    return [(e, *out[e.who]) for e in entries]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated algorithm names")
    ap.add_argument("--reference", action="store_true",
                    help="also time each funcpar optimizer with the plain-torch references "
                         "(kernel mode 'reference'; on CPU 'auto' is the reference already)")
    ap.add_argument("--donate", action="store_true",
                    help="also time each funcpar optimizer donated: inside inplace_updates(), "
                         "where its fast path overwrites params and state in place")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads for torch (0: torch's default). On a CPU shared with other "
                         "work, 1 avoids the multi-ms waits of a parallel region for a "
                         "descheduled thread, which otherwise dominate the small steps")
    args = ap.parse_args(argv)
    if args.threads < 0:
        ap.error(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)

    vocab, dim, ffn, blocks, rank = PRESETS[args.preset]
    shapes = decoder_shapes(vocab, dim, ffn, blocks)
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen).mul_(0.02).to(args.device)
              for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen).to(args.device) for k, s in shapes.items()}
    n = sum(p.numel() for p in params.values())
    bw = copy_bandwidth(args.device, n)
    dev_name = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
                else "cpu")
    print(f"preset {args.preset}: {n / 1e6:.2f} M fp32 params in {len(shapes)} leaves, GaLore "
          f"rank {rank}; device {args.device} ({dev_name}), {torch.get_num_threads()} threads; "
          f"funcpar kernels: {'Triton' if args.device.startswith('cuda') else 'references'} "
          f"(mode auto); copy "
          f"bandwidth {bw / 1e9:.1f} GB/s; torch {torch.__version__}; median of "
          f"{args.reps} x {args.steps} steps after {args.warmup} warm-up")

    all_groups = groups(rank)
    if args.reference:
        for name, entries in all_groups.items():
            with_ref = []
            for e in entries:
                with_ref.append(e)
                if e.ours:
                    with_ref.append(Entry(f"{e.who} [reference]", e.build, mode="reference"))
            all_groups[name] = with_ref
    if args.donate:
        for name, entries in all_groups.items():
            all_groups[name] = [*entries, *(Entry(f"{e.who} [donated]", e.build, mode=e.mode,
                                                  donate=True) for e in entries if e.ours)]
    only = set(filter(None, args.only.split(",")))
    unknown = only - set(all_groups)
    if unknown:
        ap.error(f"--only: unknown {sorted(unknown)}; choose from {sorted(all_groups)}")
    print("\n| algorithm | implementation | ms/step (median) | min ms | moved B/param | "
          "% of floor | kernels' B/param (% of it) | state MB | state B/param | "
          "peer ms / funcpar ms (median; min) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    with _cpu_cuda_sync_is_noop(args.device):
        for name, entries in all_groups.items():
            if only and name not in only:
                continue
            rows = time_group(entries, params, grads, args.device, args.warmup, args.steps,
                              args.reps)
            floor_ms = BYTES_PER_PARAM[name] * n / bw * 1e3
            mine = None  # the funcpar row a peer row is compared with: the last one above it
            peers: list[tuple[str, float, float]] = []  # (who, median, min) of the peers above
            for e, ms, ms_min, nbytes, note in rows:
                if ms is None:
                    print(f"| {name} | {e.who} | - | - | - | - | - | - | - | {note} |")
                    continue
                ratio = ""
                if e.ours and e.mode == "reference":
                    if mine is not None:
                        ratio = (f"reference / kernels {ms / mine[1]:.2f}; "
                                 f"min {ms_min / mine[2]:.2f}")
                elif e.ours and e.donate and peers:
                    # A donated row (listed after the peers): against the fastest peer.
                    who, p_ms, p_min = min(peers, key=lambda x: x[1])
                    r = p_ms / ms
                    ratio = (f"{who} / this {r:.2f} ({'faster' if r > 1 else 'SLOWER'}); "
                             f"min {p_min / ms_min:.2f}")
                elif e.ours:
                    mine = (e.who, ms, ms_min)
                elif mine is not None:
                    peers.append((e.who, ms, ms_min))
                    r, r_min = ms / mine[1], ms_min / mine[2]
                    ratio = (f"{r:.2f} ({'funcpar faster' if r > 1 else 'funcpar SLOWER'}); "
                             f"min {r_min:.2f}")
                    summary.append((name, e.who, mine[0], r))
                kern = "-"
                if e.ours and e.mode == "auto" and args.device.startswith("cuda"):
                    kb = KERNEL_BYTES_PER_PARAM.get(name, BYTES_PER_PARAM[name])
                    kern = f"{kb} ({100 * kb * n / bw * 1e3 / ms:.0f} %)"
                print(f"| {name} | {e.who} | {ms:.2f} | {ms_min:.2f} | {BYTES_PER_PARAM[name]} | "
                      f"{100 * floor_ms / ms:.0f} % | {kern} | {nbytes / 2**20:.2f} | "
                      f"{nbytes / n:.2f} | {ratio} |")
    if summary:
        faster = sum(r > 1 for *_, r in summary)
        print(f"\nfuncpar faster than the peer in {faster} of {len(summary)} pairs; slower in "
              f"{len(summary) - faster}: "
              + ", ".join(f"{a} vs {b} {r:.2f}" for a, b, _, r in summary if r <= 1))


if __name__ == "__main__":
    main()
