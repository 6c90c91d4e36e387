"""Peak memory per parameter: plain PyTorch vs funcpar's step, undonated and donated.

Each variant runs in its own subprocess (a fresh interpreter, so one variant's peak cannot hide
another's): a Llama (default dim 512, 8 layers, vocab 32000: 58 M params), batch 1 x 32, three
steps of AdamW or Adafactor. On CPU the peak is the process's ``ru_maxrss`` minus its value
after the imports (the interpreter and torch), divided by the parameter count; on CUDA it is
``torch.cuda.max_memory_allocated``. Variants:

* ``plain``: the module, ``loss.backward()`` and ``torch.optim.AdamW`` (or funcpar's Adafactor
  applied in place through the module's ``.grad``, torch having no Adafactor of the same
  maths), in place, ``zero_grad(set_to_none=True)``;
* ``donate_off``: ``make_train_step(...)``: each step holds the old and the new params and
  optimizer state at once;
* ``donate_on``: ``make_train_step(..., donate=True)``: the new state is written into the old
  one's storage (in place where the optimizer runs under ``inplace_updates``, else copied in
  after the update);
* ``in_backward``: ``make_train_step(..., donate=True, update_in_backward=True)``: each leaf
  updated in its post-accumulate-grad hook and its gradient dropped at once.

    python benchmarks/bench_memory.py            # the 58 M model, AdamW and Adafactor
    python benchmarks/bench_memory.py --small    # dim 128, 2 layers, vocab 4000: a quick check

Prints a table: bytes per parameter at the peak and the ratio to ``plain``; ``net`` is the
same after a warm-up step of a tiny model each way (the process's fixed costs, which do not
scale with the model, taken out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

VARIANTS = ("plain", "donate_off", "donate_on", "in_backward")
OPTIMS = ("adamw", "adafactor")


def _peak_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child(args: argparse.Namespace) -> dict:
    """One variant in this process: ``{"params": n, "peak": bytes}``."""
    import torch

    from funcpar import optim as fo
    from funcpar.models import Llama, LlamaConfig, lm_loss
    from funcpar.state import functionalize, init_state
    from funcpar.train import make_train_step

    torch.set_num_threads(1)
    device = torch.device(args.device)
    base = 0 if device.type == "cuda" else _peak_bytes(device)  # after every import
    _warm_up(device)  # loads the kernels' code and workspaces every variant needs, once
    warm = 0 if device.type == "cuda" else _peak_bytes(device)

    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.dim // 64 or 1, ffn_hidden=args.ffn, max_seq_len=args.seq)
    torch.manual_seed(0)
    model = Llama(cfg).to(device)
    n = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (3, args.batch, args.seq + 1), generator=g).to(device)
    batches = [(ids[i, :, :-1], ids[i, :, 1:]) for i in range(3)]
    opt = (fo.adamw(lr=1e-3, weight_decay=0.1) if args.optim == "adamw"
           else fo.adafactor(lr=1e-3, relative_step=False, scale_parameter=False))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if args.variant == "plain":
        if args.optim == "adamw":
            topt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1,
                                     foreach=False)
        params = dict(model.named_parameters())
        if args.optim != "adamw":
            state = opt.init({k: p.detach() for k, p in params.items()})
        for x, y in batches:
            loss = lm_loss(model(x), y)
            loss.backward()
            if args.optim == "adamw":
                topt.step()
                topt.zero_grad(set_to_none=True)
            else:  # funcpar's Adafactor, written back into the module's tensors in place
                grads = {k: p.grad for k, p in params.items()}
                with torch.no_grad():
                    new, state = fo.update_params(opt, grads, state,
                                                  {k: p.detach() for k, p in params.items()})
                    for k, p in params.items():
                        p.copy_(new[k])
                        p.grad = None
                    del new, grads
    else:
        apply_fn, params, buffers = functionalize(model)
        del model
        step = make_train_step(apply_fn, lm_loss, opt, donate=args.variant != "donate_off",
                               update_in_backward=args.variant == "in_backward")
        state = init_state(params, buffers, opt)
        del params, buffers
        for batch in batches:
            state, _ = step(state, batch)
    peak = _peak_bytes(device)
    return {"params": n, "peak": peak - base, "net": peak - warm}


def _warm_up(device) -> None:
    """One step of a tiny Llama each way (module + torch.optim, funcpar's step undonated,
    donated and in the backward, AdamW and Adafactor), so that the process's fixed costs (the
    kernels' code pages, allocator arenas, autograd's threads) are in place before the
    ``net`` baseline; the big model's peak minus it is what scales with the model."""
    import torch

    from funcpar import optim as fo
    from funcpar.models import Llama, LlamaConfig, lm_loss
    from funcpar.state import functionalize, init_state
    from funcpar.train import make_train_step

    cfg = LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=1, ffn_hidden=96,
                      max_seq_len=8)
    ids = torch.randint(0, 64, (1, 9), device=device)
    batch = (ids[:, :-1], ids[:, 1:])
    model = Llama(cfg).to(device)
    topt = torch.optim.AdamW(model.parameters(), foreach=False)
    lm_loss(model(batch[0]), batch[1]).backward()
    topt.step()
    for opt in (fo.adamw(lr=1e-3), fo.adafactor(lr=1e-3, relative_step=False)):
        for kw in ({}, {"donate": True}, {"donate": True, "update_in_backward": True}):
            apply_fn, params, buffers = functionalize(Llama(cfg).to(device))
            make_train_step(apply_fn, lm_loss, opt, **kw)(init_state(params, buffers, opt),
                                                          batch)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="dim 128, 2 layers, vocab 4000")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--optims", default=",".join(OPTIMS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per subprocess")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--optim", help=argparse.SUPPRESS)
    for k, v in (("dim", 512), ("layers", 8), ("vocab", 32000), ("ffn", 1376), ("batch", 1),
                 ("seq", 32)):
        p.add_argument(f"--{k}", type=int, default=v)
    args = p.parse_args(argv)
    if args.small:
        args.dim, args.layers, args.vocab, args.ffn = 128, 2, 4000, 344
    for flag, given, known in (("--variants", args.variants, VARIANTS),
                               ("--optims", args.optims, OPTIMS)):
        unknown = sorted(set(given.split(",")) - set(known))
        if unknown:
            p.error(f"{flag}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    if args.variant:  # a child
        print(json.dumps(child(args)))
        return
    shape = ["--dim", str(args.dim), "--layers", str(args.layers), "--vocab", str(args.vocab),
             "--ffn", str(args.ffn), "--batch", str(args.batch), "--seq", str(args.seq),
             "--device", args.device]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"device {args.device}; model dim {args.dim} x {args.layers} layers, vocab "
          f"{args.vocab}; batch {args.batch}x{args.seq}; 3 steps; peak "
          f"{'max_memory_allocated' if args.device.startswith('cuda') else 'ru_maxrss - imports'}")
    print(f"{'optim':<10} {'variant':<11} {'params':>10} {'peak MiB':>9} {'B/param':>8} "
          f"{'vs plain':>8} {'net B/param':>11} {'vs plain':>8}")
    for optim in args.optims.split(","):
        plain = plain_net = None
        for variant in args.variants.split(","):
            cmd = [sys.executable, __file__, "--variant", variant, "--optim", optim, *shape]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                 timeout=args.timeout)
            if out.returncode:
                print(f"{optim:<10} {variant:<11} failed: {out.stderr.strip()[-300:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            per, net = r["peak"] / r["params"], r["net"] / r["params"]
            if variant == "plain":
                plain, plain_net = per, net
            ratio = f"{per / plain:.2f}x" if plain else "-"
            net_ratio = f"{net / plain_net:.2f}x" if plain_net else "-"
            print(f"{optim:<10} {variant:<11} {r['params']:>10,} {r['peak'] / 2**20:>9.1f} "
                  f"{per:>8.1f} {ratio:>8} {net:>11.1f} {net_ratio:>8}", flush=True)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
