"""Optimizer step time and state size: each funcpar optimizer against its peers, same run.

The parameter set is shaped like a decoder (an embedding, blocks of four square projections, two
up-projections, one down-projection and two norms, a final norm). At ``--preset h100`` it is the
888 M-parameter set of shared/PEERS.md; the default ``cpu`` preset is a scaled-down copy that a
2-core machine steps in seconds. Gradients are random and fixed; each optimizer is timed over
``--steps`` updates after ``--warmup`` ones, interleaving funcpar and its peers, median reported.

Columns: ms per step (median); bytes per parameter the algorithm must move (our count: each
tensor read or written once per step, listed per optimizer in BYTES_PER_PARAM); % of the floor
(bytes / copy bandwidth measured in the same run); optimizer-state bytes; and, for funcpar rows,
the ratio peer_ms / funcpar_ms (> 1: funcpar is faster). Peers not installed are skipped with a
note. Usage::

    python benchmarks/bench_optim.py                      # CPU preset
    python benchmarks/bench_optim.py --preset h100 --device cuda
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import funcpar.optim as fo
from funcpar.optim.memory import state_bytes

PRESETS = {
    # vocab, dim, ffn, blocks
    "h100": (32000, 2048, 5632, 16),
    "cpu": (4000, 256, 704, 2),
    "tiny": (500, 64, 176, 1),
}

# Bytes per fp32 parameter each algorithm must move at the least: reads and writes of the
# parameter, its gradient and each full-size state (factored states are negligible).
BYTES_PER_PARAM = {
    "sgd": 20,  # p r/w, g r, momentum r/w
    "adamw": 28,  # p r/w, g r, m r/w, v r/w
    "adafactor": 16,  # g read twice (statistics, update), p r/w
    "came": 24,  # g twice, p r/w, m r/w
    "lamb": 28,
    "galore_adamw": 12,  # p r/w, g r; low-rank states negligible
}


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
    name: str  # the algorithm (BYTES_PER_PARAM key)
    who: str  # "funcpar" or the peer's name
    build: Callable[[], object]  # -> funcpar GradientTransformation, or a peer factory


def _peer(module: str, attr: str, **kwargs) -> Callable[[list], torch.optim.Optimizer]:
    def make(params: list) -> torch.optim.Optimizer:
        cls = importlib.import_module(module)
        for part in attr.split("."):
            cls = getattr(cls, part)
        return cls(params, **kwargs)

    make.module = module  # type: ignore[attr-defined]
    return make


def entries(device: str) -> list[Entry]:
    lr = 1e-3
    out = [
        Entry("sgd", "funcpar", lambda: fo.sgd(lr=lr, momentum=0.9)),
        Entry("sgd", "torch.optim.SGD", _peer("torch.optim", "SGD", lr=lr, momentum=0.9)),
        Entry("adamw", "funcpar", lambda: fo.adamw(lr=lr)),
        Entry("adamw", "torch AdamW foreach",
              _peer("torch.optim", "AdamW", lr=lr, foreach=True)),
        Entry("adamw", "torch AdamW fused", _peer("torch.optim", "AdamW", lr=lr, fused=True)),
        Entry("adafactor", "funcpar",
              lambda: fo.adafactor(lr=lr, relative_step=False, scale_parameter=False)),
        Entry("adafactor", "transformers Adafactor",
              _peer("transformers.optimization", "Adafactor", lr=lr, relative_step=False,
                    scale_parameter=False)),
        Entry("adafactor", "funcpar (torch variant)", lambda: fo.adafactor_torch(lr=lr)),
        Entry("adafactor", "torch.optim.Adafactor",
              _peer("torch.optim", "Adafactor", lr=lr, foreach=True)),
        Entry("came", "funcpar", lambda: fo.came(lr=lr)),
        Entry("came", "came-pytorch", _peer("came_pytorch", "CAME", lr=lr)),
        Entry("lamb", "funcpar", lambda: fo.lamb(lr=lr)),
        Entry("lamb", "pytorch-optimizer Lamb", _peer("pytorch_optimizer", "Lamb", lr=lr)),
        Entry("lamb", "torch-optimizer Lamb", _peer("torch_optimizer", "Lamb", lr=lr)),
    ]
    if hasattr(fo, "galore_adamw"):
        out += [
            Entry("galore_adamw", "funcpar", lambda: fo.galore_adamw(lr=lr, rank=128)),
            Entry("galore_adamw", "galore-torch GaLoreAdamW", _galore_peer(lr, 128)),
        ]
    return out


def _galore_peer(lr: float, rank: int) -> Callable[[list], torch.optim.Optimizer]:
    def make(params: list) -> torch.optim.Optimizer:
        from galore_torch import GaLoreAdamW

        mats = [p for p in params if p.dim() == 2]
        rest = [p for p in params if p.dim() != 2]
        groups = [{"params": rest},
                  {"params": mats, "rank": rank, "update_proj_gap": 200, "scale": 0.25,
                   "proj_type": "std"}]
        return GaLoreAdamW(groups, lr=lr)

    make.module = "galore_torch"  # type: ignore[attr-defined]
    return make


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, numel: int) -> float:
    """Bytes per second of a device copy, counting bytes read and written."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / min(times)


def time_funcpar(opt, params, grads, device, warmup, steps) -> tuple[float, int]:
    state = opt.init(params)
    times = []
    p = params
    for i in range(warmup + steps):
        _sync(device)
        t = time.perf_counter()
        updates, state = opt.update(grads, state, p)
        p = fo.apply_updates(p, updates)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, state_bytes(state)


def time_peer(make, params, grads, device, warmup, steps) -> tuple[float, int]:
    live = [v.clone().requires_grad_() for v in params.values()]
    for p, g in zip(live, grads.values()):
        p.grad = g
    opt = make(live)
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t = time.perf_counter()
        opt.step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    nbytes = sum(t.numel() * t.element_size() for s in opt.state.values()
                 for t in s.values() if torch.is_tensor(t))
    return statistics.median(times) * 1e3, nbytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated algorithm names")
    args = ap.parse_args(argv)

    shapes = decoder_shapes(*PRESETS[args.preset])
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen).mul_(0.02).to(args.device) for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen).to(args.device) for k, s in shapes.items()}
    n = sum(p.numel() for p in params.values())
    bw = copy_bandwidth(args.device, min(max(n, 1 << 24), 1 << 28))
    print(f"device {args.device}  params {n / 1e6:.1f} M  copy bandwidth {bw / 1e9:.1f} GB/s  "
          f"torch {torch.__version__}")

    only = set(filter(None, args.only.split(",")))
    rows, ours = [], {}
    for e in entries(args.device):
        if only and e.name not in only:
            continue
        try:
            if e.who.startswith("funcpar"):
                ms, nbytes = time_funcpar(e.build(), params, grads, args.device, args.warmup,
                                          args.steps)
            else:
                ms, nbytes = time_peer(e.build, params, grads, args.device, args.warmup,
                                       args.steps)
        except (ImportError, RuntimeError, ValueError) as err:
            rows.append((e.name, e.who, None, None, f"skipped: {type(err).__name__}: {err}"[:90]))
            continue
        if e.who.startswith("funcpar"):
            ours[(e.name, e.who)] = ms
        rows.append((e.name, e.who, ms, nbytes, ""))

    floor_ms = {k: b * n / bw * 1e3 for k, b in BYTES_PER_PARAM.items()}
    print("\n| optimizer | implementation | ms/step | bytes/param | % of floor | state MB | note |")
    print("|---|---|---|---|---|---|---|")
    for name, who, ms, nbytes, note in rows:
        if ms is None:
            print(f"| {name} | {who} | - | - | - | - | {note} |")
            continue
        pct = 100 * floor_ms[name] / ms
        print(f"| {name} | {who} | {ms:.2f} | {BYTES_PER_PARAM[name]} | {pct:.0f} % | "
              f"{nbytes / 2**20:.1f} | {note} |")
    print("\nratio peer ms / funcpar ms (> 1: funcpar faster):")
    for name, who, ms, _, _ in rows:
        if ms is None or who.startswith("funcpar"):
            continue
        mine = [(k[1], v) for k, v in ours.items() if k[0] == name]
        for label, v in mine:
            print(f"  {name:13s} {who:28s} vs {label:24s} {ms / v:5.2f}")


if __name__ == "__main__":
    main()
