"""Context parallelism (funcpar.transforms.context_parallel): memory per rank and speed.

For cp = 1, 2, 4 ranks (gloo on CPU, NCCL on CUDA; ``run_ranks`` starts them) and both modes
(ring, Ulysses) a Llama with grouped-query attention (default dim 256, 4 layers, 8 query / 2 kv
heads, vocab 1024, float32) trains on ``--batch`` sequences of ``--seq`` tokens with AdamW:

* ``act MiB``: the activations this rank keeps for the backward at ``--seq`` - the bytes of the
  distinct tensor storages the forward saves (``torch.autograd.graph.saved_tensors_hooks``),
  the weights excluded; the max over ranks. Deterministic, the quantity the issue's target
  (``<= 1.15 x one process / cp``) is about; ``vs 1/cp`` is its ratio to one process's / cp;
* ``peak MiB``: on CUDA ``max_memory_allocated`` over a step; on CPU the rank's ``ru_maxrss``
  growth over the steps (coarse: the allocator keeps freed pages), the max over ranks;
* ``max seq``: the longest sequence (a multiple of ``2 cp x 16``) whose ``act`` stays within
  one process's ``act`` at ``--cap-seq`` (default ``--seq``), by bisection on the measured
  forward; ``x1`` its ratio to one process's;
* ``tok/s``: global tokens per second of a whole step (median of ``--steps`` after a warm-up);
  for ring also ``no overlap``: the same with each kv transfer posted after the block's
  compute instead of before it.

    python benchmarks/bench_long_context.py                 # cp 1, 2, 4; ring and ulysses
    python benchmarks/bench_long_context.py --seq 1024 --cps 1,2 --no-bisect   # quick

Ranks share the host's cores: on a 2-core machine cp4 runs 4 processes on 2 cores, so its
tokens/s measures oversubscription as much as the method.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

MODES = ("ring", "ulysses")


def _setup(args: argparse.Namespace, cp: int, mode: str, overlap: bool = True):
    from funcpar import optim as fo
    from funcpar.models import Llama, LlamaConfig, lm_loss
    from funcpar.shard.mesh import DeviceMesh
    from funcpar.state import functionalize, init_state
    from funcpar.train import make_train_step
    from funcpar.transforms import context_parallel

    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, n_kv_heads=args.kv_heads, max_seq_len=1 << 20)
    device = torch.device(args.device)
    apply_fn, params, buffers = functionalize(Llama(cfg, device=device))
    opt = fo.adamw(lr=1e-3)
    step, state = make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt)
    if cp > 1:
        mesh = DeviceMesh.from_env(cp=cp)
        step, state = context_parallel(mesh, mode=mode, overlap=overlap)(step, state)
    return step, state, params, device


def _batch(args: argparse.Namespace, seq: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, seq + 1), generator=g).to(device)
    return ids[:, :-1], ids[:, 1:]


def _saved_bytes(step, state, batch, weights: set[int]) -> int:
    """Bytes of the distinct storages the forward saves for the backward (weights excluded)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            seen[st.data_ptr()] = st.nbytes()
        return t

    inputs, targets = step.local_batch(batch) if step.local_batch is not None else batch
    live = {k: v.detach().requires_grad_() for k, v in state.params.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = step.apply_fn(live, state.buffers, inputs)
        loss = step.loss_fn(out, targets)
    del loss, out
    return sum(seen.values())


def _weights(state) -> set[int]:
    return {v.untyped_storage().data_ptr() for v in state.params.values()}


def rank_main(args: argparse.Namespace, cp: int, mode: str) -> dict:
    """One rank's measurements (run by run_ranks on each of ``cp`` ranks)."""
    torch.set_num_threads(1)
    step, state, _, device = _setup(args, cp, mode)
    batch = _batch(args, args.seq, device)
    out: dict = {"act": _saved_bytes(step, state, batch, _weights(state))}
    if args.cap is not None:
        out["max_seq"] = _bisect(args, step, state, cp, args.cap)
    variants = {"overlap": step}
    if mode == "ring" and cp > 1:
        variants["no overlap"] = _setup(args, cp, mode, overlap=False)[0]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for name, s in variants.items():
        times = []
        st = state
        for i in range(args.steps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            st, m = s(st, batch)
            float(m["loss"])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
        out[name] = args.batch * args.seq / statistics.median(times)
    out["peak"] = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else
                   (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024)
    return out


def _bisect(args: argparse.Namespace, step, state, cp: int, cap: int) -> int:
    """The longest sequence (multiple of 2 cp x 16) whose saved activations are <= cap on this
    rank: all ranks step through the same lengths (their maxima agree through an all-reduce)."""
    grain = 2 * cp * 16
    weights = _weights(state)

    def fits(seq: int) -> bool:
        act = _saved_bytes(step, state, _batch(args, seq, torch.device(args.device)), weights)
        if cp > 1:
            t = torch.tensor([act], dtype=torch.int64, device=args.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            act = int(t)
        return act <= cap

    lo, hi = grain, grain
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > grain:
        mid = (lo + hi) // 2 // grain * grain
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main(argv=None) -> None:
    from funcpar.testing import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in (("dim", 256), ("layers", 4), ("heads", 8), ("kv-heads", 2), ("vocab", 1024),
                 ("batch", 1), ("seq", 2048), ("steps", 3)):
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--cap-seq", type=int, default=None,
                   help="the cap of 'max seq': one process's activations at this length "
                        "(default --seq)")
    p.add_argument("--no-bisect", action="store_true", help="skip the 'max seq' search")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    args.cap = None
    print(f"device {args.device} ({backend}); Llama dim {args.dim} x {args.layers} layers, "
          f"{args.heads} heads / {args.kv_heads} kv, vocab {args.vocab}, float32, AdamW; "
          f"batch {args.batch} x {args.seq}; {time.strftime('%Y-%m-%d')}")
    one = rank_main(_with(args, cap=None), 1, "ring")
    base_act = one["act"]
    if not args.no_bisect:
        cap_seq = args.cap_seq or args.seq
        cap = (base_act if cap_seq == args.seq else
               rank_main(_with(args, seq=cap_seq, cap=None, steps=1), 1, "ring")["act"])
        args.cap = cap
        one["max_seq"] = _bisect(args, *_setup(args, 1, "ring")[:2], 1, cap)
    print(f"{'cp':>3} {'mode':<8} {'act MiB':>8} {'vs 1/cp':>8} {'peak MiB':>9} "
          f"{'max seq':>8} {'x1':>5} {'tok/s':>8} {'no overlap':>10}")
    _row(1, "-", [one], one, base_act)
    for cp in (int(c) for c in args.cps.split(",")):
        if cp == 1:
            continue
        for mode in args.modes.split(","):
            res = run_ranks(rank_main, cp, args, cp, mode, backend=backend, timeout=args.timeout)
            _row(cp, mode, res, one, base_act)


def _row(cp: int, mode: str, res: list[dict], one: dict, base_act: int) -> None:
    act = max(r["act"] for r in res)
    peak = max(r["peak"] for r in res)
    tok = min(r["overlap"] for r in res)
    no = min((r["no overlap"] for r in res if "no overlap" in r), default=None)
    ms = res[0].get("max_seq")
    x1 = f"{ms / one['max_seq']:.2f}" if ms and one.get("max_seq") else "-"
    print(f"{cp:>3} {mode:<8} {act / 2**20:>8.2f} {act / (base_act / cp):>8.2f} "
          f"{peak / 2**20:>9.1f} {ms or '-':>8} {x1:>5} {tok:>8.0f} "
          f"{'-' if no is None else f'{no:.0f}':>10}", flush=True)


def _with(args: argparse.Namespace, **kw) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **kw})


if __name__ == "__main__":
    main()
