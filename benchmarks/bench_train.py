"""End-to-end training speed: funcpar's step against plain PyTorch, same model, same batches.

    python benchmarks/bench_train.py                       # CUDA: the 271 M Llama (preset h100)
    python benchmarks/bench_train.py --preset tiny         # CPU smoke run, seconds
    python benchmarks/bench_train.py --nominal-tflops 989  # also MFU against a spec-sheet peak

The model is :class:`funcpar.models.Llama` (RMSNorm, rotary, SwiGLU, SDPA attention) built from
an in-code config; preset ``h100`` is the one of shared/PEERS.md: hidden 1024, 16 layers, 16
heads, SwiGLU width 2816, vocabulary 32000 (271.1 M parameters), batch 8 x 2048 tokens, bf16
compute over float32 parameters. Each optimizer (AdamW, Adafactor) is run by these
implementations, all built from the same initial weights and fed the same batches:

* ``torch-eager``: the ``nn.Module`` under ``torch.autocast(bf16)``, ``loss.backward()``, then
  ``torch.optim.AdamW(fused=True)`` (``torch.optim.Adafactor`` for Adafactor: torch has no fused
  Adafactor; its default foreach path) and ``zero_grad(set_to_none=True)``;
* ``torch-compile``: the same with ``torch.compile(model)``;
* ``torch-eager-norm`` (asked for by name or ``all``): ``torch-eager`` that also computes the
  global gradient norm every step, as a loop that logs it would (one multi-tensor norm over the
  ``.grad`` tensors, stacked, one norm: what ``torch.nn.utils.get_total_norm`` runs). funcpar's
  step returns that metric every step (``grad_norm``); this is the plain loop doing the same
  work;
* ``funcpar-eager``: ``functionalize`` + ``make_train_step(apply_fn, lm_loss, opt)`` +
  ``amp_cast("bf16")`` (float32 master parameters, bf16 compute), with ``funcpar.optim.adamw``
  / ``adafactor_torch`` (the latter computes exactly torch.optim.Adafactor's update); the
  optimizers take the fused kernels of :mod:`funcpar.kernels` where the dispatcher picks them
  (``--kernels``, default ``auto``: the Triton kernels on CUDA, the plain-torch references
  elsewhere);
* ``funcpar-donate``: ``funcpar-eager`` with ``donate=True``: the step consumes its state and
  writes the next one into its storage (the optimizer in place, as torch.optim's; AdamW by
  torch's own fused CPU kernel, as the plain loop's), the fair peer of the in-place plain loop;
* ``funcpar-compile``: the same step with ``compile=True`` (one process: the whole step,
  forward, backward, norm, clip and optimizer update, is one compiled region);
* ``funcpar-compile-donate``: ``funcpar-compile`` with ``donate=True``: the compiled region
  writes the new state into the input's storage (an input mutation in the graph), so the
  update allocates no new leaf-sized buffers;
* ``pure-lean`` (AdamW in fp32 only; asked for by name or ``all``): the floor of a pure step,
  written by hand on flat leaf lists without funcpar's layers: the same functional forward
  (funcpar's ``apply_fn``), ``torch.autograd.grad``, the gradient norm as a metric, then
  ``torch._fused_adamw_`` in place on the consumed state, returned as fresh tensor objects. No
  trees, checks, hyperparameter state, dispatch or donation marks: what purity itself costs,
  against which ``funcpar-donate`` shows what funcpar's generality costs;
* ``funcpar-compile-cg`` (CUDA only): as ``funcpar-compile`` with ``torch.compile``'s
  ``mode="reduce-overhead"`` (CUDA graphs for the forward and backward). funcpar has no public
  switch for the compile mode yet, so this variant subclasses :class:`TrainStep` and overrides
  its (private) compiled-gradient hook; see ``_CudaGraphStep``.

``--variants`` picks a subset. On CPU the compiled variants are left out unless asked for
(compiling takes minutes there). A variant that fails to build or run is reported as failed
with its error, and the others still run.

Measurements, per optimizer:

* correctness first: every implementation's losses over the ``--warmup`` untimed steps (which
  also compile) are compared with the first implementation's; bf16 computes differently in the
  two styles (autocast keeps the residual stream in float32 and casts per op, amp_cast computes
  the whole model in bf16), so they agree only to bf16's precision: a relative gap above
  ``--loss-rtol`` (default 2e-2, about three bf16 ulps of relative error compounded over a few
  steps) ends the run with an error after the table, since timing different computations means
  nothing;
* time: ``--reps`` repetitions of ``--steps`` steps; within each repetition every
  implementation runs one block of steps on the same batches, the order rotated from one
  repetition to the next so that machine noise hits all alike; no implementation synchronises
  inside its steps, each block ends with one synchronisation; the table shows the median block
  (and the fastest);
* tokens/s = batch * seq_len / (median seconds per step);
* MFU = model FLOPs per second over the peak: per token ``6 N + 12 L d s`` (N all parameters,
  embeddings included; ``12 L d s`` the attention score and value matmuls forward and
  backward, counted over the full ``s x s`` matrix as in PaLM, Chowdhery et al. 2022,
  appendix B; shared/PEERS.md's MFUs follow the same count), divided by the matmul peak measured
  in the same run (a square bf16 matmul of ``--peak-size``, median of 10 after warm-up) and,
  with ``--nominal-tflops``, by that number too;
* peak memory (CUDA): the implementation's resting footprint (memory allocated by building and
  warming it up: its parameters, optimizer state, compiled graphs) plus the largest excess over
  the resting memory of all implementations during its timed blocks. Allocated bytes, not the
  caching allocator's reserved ones. Not measured on CPU.

Ratios are of tokens/s: ``vs torch-compile`` > 1 means faster than the compiled plain model.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcpar.kernels import current_mode, kernel_mode, triton_available
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.optim import adafactor_torch, adamw
from funcpar.state import functionalize, init_state
from funcpar.train.step import TrainStep, loss_and_grads, make_train_step
from funcpar.transforms import amp_cast

PRESETS: dict[str, dict[str, int]] = {
    # shared/PEERS.md's "Training step" model: 271.1 M parameters.
    "h100": dict(vocab=32000, dim=1024, layers=16, heads=16, ffn=2816, batch_size=8,
                 seq_len=2048, steps=5, reps=4, warmup=3, peak_size=8192),
    # The same architecture shrunk until a CPU step takes milliseconds: CI's smoke run.
    "tiny": dict(vocab=512, dim=64, layers=2, heads=4, ffn=176, batch_size=4, seq_len=64,
                 steps=3, reps=3, warmup=2, peak_size=256),
}
VARIANTS = ("torch-eager", "torch-eager-norm", "torch-compile", "funcpar-eager", "funcpar-donate",
            "funcpar-compile", "funcpar-compile-donate", "funcpar-compile-cg", "pure-lean")
COMPILED = ("torch-compile", "funcpar-compile", "funcpar-compile-donate", "funcpar-compile-cg")
# References, not implementations: run when named (or "all").
OPT_IN = ("torch-eager-norm", "pure-lean")
OPTIMS = ("adamw", "adafactor")
# AdamW: the usual LLM settings; Adafactor: torch.optim.Adafactor's defaults.
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
ADAFACTOR = dict(lr=1e-2)
PRECISIONS = {"bf16": torch.bfloat16, "fp32": None}

Runner = Callable[[tuple], torch.Tensor]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


# --------------------------------------------------------------------------- implementations
def plain_runner(model: Llama, optim: str, compile: bool, precision: str,
                 device: torch.device, norm: bool = False) -> Runner:
    """The plain PyTorch loop: nn.Module, autocast, loss.backward(), a torch.optim step;
    ``norm``: also the global gradient norm, as a metric (``torch-eager-norm``). The runner
    takes an optional dict, where it writes the seconds of its parts (step_ladder --phases)."""
    if optim == "adamw":
        # fused=True: torch's fastest AdamW (one multi-tensor kernel), the peer to beat.
        opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    else:
        opt = torch.optim.Adafactor(model.parameters(), **ADAFACTOR)
    forward = torch.compile(model) if compile else model
    params = list(model.parameters())
    dtype = PRECISIONS[precision]
    autocast = (functools.partial(torch.autocast, device.type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext)

    def run(batch: tuple, parts: dict[str, float] | None = None) -> torch.Tensor:
        inputs, targets = batch
        t0 = time.perf_counter()
        with autocast():
            loss = lm_loss(forward(inputs), targets)
        t1 = time.perf_counter()
        loss.backward()
        if norm:
            lean_grad_norm([q.grad for q in params if q.grad is not None])
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if parts is not None:
            parts.update({"forward + loss": t1 - t0, "backward": t2 - t1,
                          "optimizer": time.perf_counter() - t2})
        return loss.detach()

    return run


@dataclasses.dataclass(frozen=True)
class _CudaGraphStep(TrainStep):
    """TrainStep whose compiled forward + backward uses ``mode="reduce-overhead"`` (CUDA graphs).

    Overrides TrainStep's private ``_grads_of`` hook (same body, another compile mode) and turns
    its whole-step region off (``_whole``), so the optimizer runs eagerly after it: funcpar
    exposes no compile-mode option yet. Transforms keep the subclass (``dataclasses.replace``).
    The graphs' outputs (the gradients, the loss) are overwritten by the next replay; the step
    consumes the gradients before then, and the benchmark reads only the last loss.
    """

    @functools.cached_property
    def _grads_of(self) -> Callable[..., Any]:
        def grads_of(params, buffers, batch, loss_scale=None):
            return loss_and_grads(self.apply_fn, self.loss_fn, params, buffers, batch,
                                  loss_scale=loss_scale)

        return torch.compile(grads_of, mode="reduce-overhead")

    @functools.cached_property
    def _whole(self) -> Any:
        return None  # not the whole-step region: the forward + backward above, in CUDA graphs


def funcpar_runner(model: Llama, optim: str, variant: str, precision: str) -> Runner:
    """funcpar's pure step: functionalize, make_train_step, amp_cast; state threaded through."""
    apply_fn, params, buffers = functionalize(model)
    opt = adamw(**ADAMW) if optim == "adamw" else adafactor_torch(**ADAFACTOR)
    if variant == "funcpar-compile-cg":
        step = _CudaGraphStep(apply_fn, lm_loss, opt, compile=True)
    else:
        step = make_train_step(
            apply_fn, lm_loss, opt,
            compile=variant in ("funcpar-compile", "funcpar-compile-donate"),
            donate=variant in ("funcpar-donate", "funcpar-compile-donate"))
    state = init_state(params, buffers, opt)
    if PRECISIONS[precision] is not None:
        step, state = amp_cast(precision)(step, state)

    def run(batch: tuple) -> torch.Tensor:
        nonlocal state
        state, metrics = step(state, batch)
        return metrics["loss"]

    return run


def lean_grads(apply_fn: Callable[..., Any], names: Sequence[str], leaves: Sequence[torch.Tensor],
               buffers: Any, batch: tuple) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
    """``pure-lean``'s forward and backward: ``(loss, grads, new_buffers)`` of the flat
    ``leaves`` (named ``names`` in ``apply_fn``'s params), by ``torch.autograd.grad``."""
    inputs, targets = batch
    live = [x.detach().requires_grad_() for x in leaves]
    out, new_buffers = apply_fn(dict(zip(names, live)), buffers, inputs)
    loss = lm_loss(out, targets)
    return loss, list(torch.autograd.grad(loss, live)), new_buffers


def lean_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """``pure-lean``'s gradient-norm metric: one multi-tensor norm, stacked, one norm."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(grads))))


def lean_runner(model: Llama) -> Runner:
    """``pure-lean``: a pure AdamW step (fp32) on flat leaf lists, by hand (module docstring)."""
    apply_fn, params, buffers = functionalize(model)
    names = list(params)
    p = [params[k].detach() for k in names]
    m, v = [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p]
    count = 0
    lr, (beta1, beta2), wd = ADAMW["lr"], ADAMW["betas"], ADAMW["weight_decay"]

    def run(batch: tuple) -> torch.Tensor:
        nonlocal p, m, v, count
        loss, grads, _ = lean_grads(apply_fn, names, p, buffers, batch)  # Llama: no updates
        lean_grad_norm(grads)  # the metric
        count += 1
        step = torch.scalar_tensor(count, dtype=torch.float32, device=p[0].device)
        torch._fused_adamw_(p, grads, m, v, [], [step] * len(p), lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=wd, eps=1e-8, amsgrad=False,
                            maximize=False)
        # The consumed state's storage, handed back as new tensor objects (a pure step).
        p, m, v = ([x.detach() for x in xs] for xs in (p, m, v))
        return loss.detach()

    return run


def build(variant: str, base: Llama, optim: str, precision: str,
          device: torch.device) -> Runner:
    # Each implementation owns a copy of the same initial weights (functionalize's params are
    # views of the module's, and torch.optim steps the module's in place).
    model = copy.deepcopy(base).to(device)
    if variant.startswith("torch-"):
        return plain_runner(model, optim, variant == "torch-compile", precision, device,
                            norm=variant == "torch-eager-norm")
    if variant == "pure-lean":
        return lean_runner(model)
    if variant == "funcpar-compile-cg" and device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    return funcpar_runner(model, optim, variant, precision)


# ------------------------------------------------------------------------------ measuring
def matmul_peak(n: int, device: torch.device, dtype: torch.dtype, reps: int = 10) -> float:
    """FLOP/s of an ``n x n x n`` matmul in ``dtype`` (median of ``reps`` after 3 warm-ups)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for i in range(3 + reps):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def flops_per_token(cfg: LlamaConfig, n_params: int, seq_len: int) -> int:
    """``6 N + 12 L d s``: the parameter matmuls (forward 2N, backward 4N) and attention's
    ``QK^T`` and ``PV`` (forward ``4 s d`` per layer and token, backward twice that)."""
    return 6 * n_params + 12 * cfg.n_layers * cfg.dim * seq_len


def timed(run: Runner, batches: Sequence[tuple], device: torch.device) -> float:
    """Seconds per step over ``batches`` (one synchronisation, at the end)."""
    _sync(device)
    start = time.perf_counter()
    for batch in batches:
        loss = run(batch)
    _sync(device)
    loss.item()
    return (time.perf_counter() - start) / len(batches)


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text if len(text) <= 160 else text[:157] + "..."


def bench_optimizer(optim: str, variants: Sequence[str], base: Llama, args: argparse.Namespace,
                    device: torch.device, batches: list[tuple]) -> dict[str, dict[str, Any]]:
    """Build, warm up, check and time every variant for one optimizer."""
    warm, timed_batches = batches[: args.warmup], batches[args.warmup:]
    runners: dict[str, Runner] = {}
    out: dict[str, dict[str, Any]] = {}
    for v in variants:
        if v == "pure-lean" and (optim != "adamw" or args.precision != "fp32"):
            continue  # the lean reference exists for fp32 AdamW only
        gc.collect()
        m0 = _allocated(device)
        try:
            run = build(v, base, optim, args.precision, device)
            losses = [float(run(b)) for b in warm]  # float(): a sync per warm-up step
        except Exception as err:  # reported in the table; the other variants go on
            out[v] = {"error": _short(err)}
            print(f"  {optim} {v}: FAILED: {_short(err)}", file=sys.stderr, flush=True)
            continue
        _sync(device)
        gc.collect()
        runners[v] = run
        out[v] = {"warm_losses": losses, "rest_bytes": _allocated(device) - m0}

    ref = next(iter(runners), None)
    for v in runners:
        ls, rl = out[v]["warm_losses"], out[ref]["warm_losses"]
        out[v]["loss_gap"] = max(abs(a - b) / abs(b) for a, b in zip(ls, rl))

    times: dict[str, list[float]] = {v: [] for v in runners}
    peaks: dict[str, int] = dict.fromkeys(runners, 0)
    names = list(runners)
    for rep in range(args.reps):
        chunk = timed_batches[rep * args.steps:(rep + 1) * args.steps]
        k = rep % len(names) if names else 0
        for v in names[k:] + names[:k]:
            if v not in runners:
                continue
            base_bytes = _allocated(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                times[v].append(timed(runners[v], chunk, device))
            except Exception as err:  # a failure after warm-up (a graph replay, say)
                out[v] = {"error": _short(err)}
                print(f"  {optim} {v}: FAILED: {_short(err)}", file=sys.stderr, flush=True)
                del runners[v]
                continue
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) - base_bytes
                peaks[v] = max(peaks[v], peak)
    for v in runners:
        out[v].update(median=statistics.median(times[v]), min=min(times[v]),
                      peak_bytes=(peaks[v] + out[v]["rest_bytes"]) if device.type == "cuda"
                      else None)
    runners.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_train.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model and run sizes (default: h100 on CUDA, tiny on CPU); the flags "
                        "below override single entries")
    for name in ("vocab", "dim", "layers", "heads", "ffn", "batch_size", "seq_len", "steps",
                 "reps", "warmup", "peak_size"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--optims", default=",".join(OPTIMS),
                   help=f"comma-separated, from {', '.join(OPTIMS)}")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, from {', '.join(VARIANTS)}, or 'all' (default: all "
                        "on CUDA; the eager ones on CPU)")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16",
                   help="compute precision; parameters and optimizer state stay float32")
    p.add_argument("--kernels", choices=("auto", "reference", "triton"), default=None,
                   help="funcpar's optimizer implementation (funcpar.kernels.kernel_mode; "
                        "default: $FUNCPAR_KERNELS, else auto)")
    p.add_argument("--nominal-tflops", type=float, default=None,
                   help="also report MFU against this peak (e.g. 989 for an H100 SXM's dense "
                        "bf16, the figure shared/PEERS.md uses)")
    p.add_argument("--loss-rtol", type=float, default=2e-2,
                   help="largest relative gap of warm-up losses between implementations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (one: spin-waiting OpenMP threads make timings on "
                        "shared cores erratic)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    preset = args.preset or ("h100" if device.type == "cuda" else "tiny")
    args.preset = preset
    for k, v in PRESETS[preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
        if getattr(args, k) <= 0:
            p.error(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    if args.threads <= 0:
        p.error(f"--threads must be positive, got {args.threads}")
    args.optims = [o.strip() for o in args.optims.split(",") if o.strip()]
    bad = [o for o in args.optims if o not in OPTIMS]
    if bad or not args.optims:
        p.error(f"--optims: unknown {bad or 'empty list'}; choose from {', '.join(OPTIMS)}")
    if args.variants in (None, "all"):
        args.variants = list(VARIANTS) if args.variants == "all" else [
            v for v in VARIANTS
            if v not in OPT_IN and (device.type == "cuda" or v not in COMPILED)]
        if device.type != "cuda":
            args.variants = [v for v in args.variants if v != "funcpar-compile-cg"]
    else:
        args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in args.variants if v not in VARIANTS]
        if bad or not args.variants:
            p.error(f"--variants: unknown {bad or 'empty list'}; choose from {', '.join(VARIANTS)}")
    if args.heads <= 0 or args.dim % args.heads:
        p.error(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns ``{"header": {...}, "results": {optim: {variant: {...}}}}``."""
    args = parse_args(argv)
    device = torch.device(args.device)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    mode = kernel_mode(args.kernels) if args.kernels else contextlib.nullcontext()
    try:
        with mode:
            return _run(args, device)
    finally:
        torch.set_num_threads(saved_threads)


def _run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, ffn_hidden=args.ffn, max_seq_len=args.seq_len)
    base = Llama(cfg, seed=args.seed)  # on the CPU: each implementation copies it over
    n_params = sum(p.numel() for p in base.parameters())
    tokens_per_step = args.batch_size * args.seq_len
    fpt = flops_per_token(cfg, n_params, args.seq_len)
    peak_dtype = PRECISIONS[args.precision] or torch.float32
    peak = matmul_peak(args.peak_size, device, peak_dtype)

    gen = torch.Generator().manual_seed(args.seed)
    n_batches = args.warmup + args.reps * args.steps
    tokens = torch.randint(0, args.vocab, (n_batches, args.batch_size, args.seq_len + 1),
                           generator=gen).to(device)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]

    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"cpu ({platform.processor() or platform.machine()})")
    header = {
        "device": dev_name, "torch": torch.__version__, "preset": args.preset,
        "params": n_params, "batch": f"{args.batch_size}x{args.seq_len}",
        "precision": args.precision, "kernels": current_mode(), "triton": triton_available(),
        "peak_flops": peak, "flops_per_token": fpt,
    }
    print(f"device {dev_name} | torch {torch.__version__} | preset {args.preset} | model "
          f"{n_params / 1e6:.2f} M params (dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} "
          f"heads, ffn {cfg.hidden}, vocab {cfg.vocab_size}) | batch {args.batch_size}x"
          f"{args.seq_len} | {args.precision} compute, fp32 params | funcpar kernels "
          f"{current_mode()} (triton {'importable' if triton_available() else 'absent'})"
          + (f" | {torch.get_num_threads()} thread(s)" if device.type == "cpu" else ""))
    print(f"matmul peak: {peak / 1e12:.3f} TFLOP/s ({args.peak_size}^3 {peak_dtype}, measured) | "
          f"model FLOPs/token 6N + 12Lds = {fpt / 1e6:,.2f} MFLOP | {args.reps} reps x "
          f"{args.steps} steps after {args.warmup} warm-up, medians", flush=True)

    results: dict[str, dict[str, dict[str, Any]]] = {}
    for optim in args.optims:
        results[optim] = bench_optimizer(optim, args.variants, base, args, device, batches)

    nominal = args.nominal_tflops
    cols = (f"{'optim':<10}{'impl':<20}{'ms/step':>9}{'min':>9}{'tokens/s':>12}{'MFU':>7}"
            + (f"{'MFU nom':>9}" if nominal else "") + f"{'peak GiB':>10}{'loss gap':>10}"
            f"{'vs t-eager':>11}{'vs t-compile':>13}")
    print(cols)
    mismatch = []
    for optim, res in results.items():
        ref = {k: res[k]["median"] for k in ("torch-eager", "torch-compile")
               if "median" in res.get(k, {})}
        for v, r in res.items():
            if "error" in r:
                print(f"{optim:<10}{v:<20}  FAILED: {r['error']}")
                continue
            tps = tokens_per_step / r["median"]
            r["tokens_per_s"] = tps
            r["mfu"] = tps * fpt / peak
            line = (f"{optim:<10}{v:<20}{1e3 * r['median']:>9.2f}{1e3 * r['min']:>9.2f}"
                    f"{tps:>12,.0f}{100 * r['mfu']:>6.1f}%")
            if nominal:
                r["mfu_nominal"] = tps * fpt / (nominal * 1e12)
                line += f"{100 * r['mfu_nominal']:>8.1f}%"
            mem = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}"
            line += f"{mem:>10}{r['loss_gap']:>10.1e}"
            for k in ("torch-eager", "torch-compile"):
                if k in ref:
                    r[f"vs_{k}"] = ref[k] / r["median"]
                    line += f"{r[f'vs_{k}']:>{11 if k == 'torch-eager' else 13}.3f}"
                else:
                    line += f"{'-':>{11 if k == 'torch-eager' else 13}}"
            print(line)
            if not r["loss_gap"] <= args.loss_rtol:
                mismatch.append(f"{optim} {v} (gap {r['loss_gap']:.2e})")
    for optim, res in results.items():
        # The like-for-like ratio: the plain loop computing the metric funcpar's step returns.
        base_ms = res.get("torch-eager-norm", {}).get("median")
        ours = [(v, r["median"]) for v, r in res.items()
                if base_ms and v.startswith(("funcpar-", "pure-")) and "median" in r]
        if ours:
            print(f"{optim}: vs torch-eager-norm (the plain loop with the grad-norm metric): "
                  + ", ".join(f"{v} {base_ms / ms:.3f}" for v, ms in ours))
    print("ratios: tokens/s over the plain model's (> 1: funcpar faster). Targets (issue 16): "
          "funcpar-eager >= 1.0x torch-eager; funcpar-compile >= 1.15x torch-compile on the "
          "tiny preset, >= 1.0x on the 7.3 M model.")
    if mismatch:
        raise SystemExit(f"error: warm-up losses differ from the first implementation's by more "
                         f"than --loss-rtol {args.loss_rtol}: {', '.join(mismatch)}")
    return {"header": header, "results": results}


if __name__ == "__main__":
    main()
