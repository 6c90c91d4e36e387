"""Hugging Face coverage: every decoder family exact under tensor parallelism, or refused.

    python benchmarks/hf_coverage.py                      # the table, on stdout
    python benchmarks/hf_coverage.py --write-docs         # and into docs/HF_MODELS.md
    python benchmarks/hf_coverage.py --families qwen3 mixtral

For each family of :mod:`funcpar.testing.hf_families` (tiny random configs built locally, no
Hub access, float64): the rules from ``funcpar.shard.hf_rules(model)`` (the model's own
``tp_plan``, funcpar's rules for a family without one, or the refusal and its reason), then on
2 gloo ranks

* ``check_rules`` (one forward and backward under tp2 against the whole model): the largest
  relative error of the loss and of any gradient;
* 3 AdamW steps under tp2 against one process: the largest relative error of any parameter;
* MoE families: the same 3 steps under ep2 (``expert_parallel``).

A family is *exact* when every number is within 1e-9 (or, for a family computing parts in
float32 whatever its dtype, 100x its own round-off, which check_rules measures), *refused* when
``hf_rules`` refuses it, and **WRONG** otherwise. Also counts, over every model type of the
installed transformers that declares a ``base_model_tp_plan``, how many use only styles
``hf_rules`` maps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

DOC = os.path.join(ROOT, "docs", "HF_MODELS.md")
BEGIN, END = "<!-- hf_coverage begin -->", "<!-- hf_coverage end -->"
STEPS = 3
TOL = 1e-9


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()


def _train(family: str, tp: int = 1, ep: int = 1) -> tuple[list[float], dict[str, Any]]:
    """3 AdamW steps on one batch; the whole parameters after them."""
    import funcpar.optim as fo
    from funcpar.shard import DeviceMesh, hf_rules, unshard_tree
    from funcpar.state import functionalize, init_state
    from funcpar.testing.hf_families import build
    from funcpar.train import make_train_step
    from funcpar.transforms import compose, expert_parallel, shard_params
    from funcpar.transforms.check_rules import token_loss

    model = build(family)
    apply_fn, params, buffers = functionalize(model)
    opt = fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=1e-2, weight_decay=0.1))
    step = make_train_step(apply_fn, token_loss, opt)
    state = init_state(params, buffers, opt)
    transforms = []
    if tp * ep > 1:
        mesh = DeviceMesh.from_env(ep=ep, tp=tp)
        if tp > 1:
            transforms.append(shard_params(hf_rules(model), mesh))
        if ep > 1:
            transforms.append(expert_parallel(mesh))
    step, state = compose(*transforms)(step, state)
    ids = torch.randint(0, model.config.vocab_size, (4, 9),
                        generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, (ids[:, :-1], ids[:, 1:]))
        losses.append(float(metrics["loss"]))
    return losses, (state.params if step.layouts is None
                    else unshard_tree(state.params, step.layouts))


def _on_ranks(families: list[str], tp: int, ep: int) -> dict[str, Any]:
    """On every rank: per family, the check (tp only) and the trained parameters, or the
    error."""
    _quiet()
    from funcpar.shard import DeviceMesh, hf_rules
    from funcpar.testing.hf_families import build
    from funcpar.transforms import check_rules

    out: dict[str, Any] = {}
    for f in families:
        try:
            check = None
            if ep == 1:
                model = build(f)
                check = check_rules(model, hf_rules(model), DeviceMesh.from_env(tp=tp),
                                    tol=TOL, raise_on_error=False)
                check = (check.loss_err, *check.worst, check.tol, check.noise_floor)
            out[f] = ("ran", check, _train(f, tp, ep))
        except Exception as e:  # reported in the table: an error is not a pass
            out[f] = ("error", f"{type(e).__name__}: {e}".splitlines()[0][:200], None)
    return out


def _err(ref: tuple[list[float], dict], got: tuple[list[float], dict]) -> float:
    """The largest relative error of the losses and of the parameters. A parameter below 1e-3
    of the largest is measured against that: OPT's key biases, whose gradient softmax cancels,
    hold round-off that AdamW's normalisation magnifies to ~1e-5 (their error, 1e-14, is
    1e-9 of that, and means nothing)."""
    from funcpar.transforms.check_rules import rel_err

    (rl, rp), (gl, gp) = ref, got
    top = max(float(b.abs().max()) for b in rp.values())
    e = max(abs(a - b) / abs(b) for a, b in zip(gl, rl))
    return max([e, *(rel_err(gp[k], b, top, floor=1e-3) for k, b in rp.items())])


def _refusal(family: str) -> str | None:
    from funcpar.shard import hf_rules
    from funcpar.testing.hf_families import build

    try:
        hf_rules(build(family, dtype=None))
    except ValueError as e:
        return str(e)
    return None


def _source(family: str) -> str:
    from funcpar.testing.hf_families import build

    model = build(family, dtype=None)
    return "tp_plan" if getattr(model, "tp_plan", None) else "funcpar"


def style_census() -> tuple[int, int, dict[str, int]]:
    """(model types with a base_model_tp_plan, of which hf_rules maps every style, per
    unsupported style the number of model types using it)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from funcpar.shard.hf_plan import HF_STYLES

    total = ok = 0
    missing: dict[str, int] = {}
    for _, cls in CONFIG_MAPPING.items():
        plan = getattr(cls, "base_model_tp_plan", None)
        if not plan:
            continue
        total += 1
        bad = {s for s in plan.values() if s not in HF_STYLES}
        ok += not bad
        for s in bad:
            missing[s] = missing.get(s, 0) + 1
    return total, ok, dict(sorted(missing.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> str:
    from funcpar.testing import run_ranks
    from funcpar.testing.hf_families import FAMILIES, MOE_FAMILIES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="*", default=list(FAMILIES))
    p.add_argument("--write-docs", action="store_true", help=f"write the table into {DOC}")
    args = p.parse_args(argv)
    _quiet()
    t0 = time.time()
    refused = {f: _refusal(f) for f in args.families}
    run = [f for f in args.families if refused[f] is None]
    refs = {f: _train(f) for f in run}
    tp2 = run_ranks(_on_ranks, 2, run, 2, 1, backend=None, timeout=1200)[0]
    moe = [f for f in run if f in MOE_FAMILIES]
    ep2 = run_ranks(_on_ranks, 2, moe, 1, 2, backend=None, timeout=1200)[0] if moe else {}
    rows = ["| family | rules | tp2 forward+backward (check_rules) | tp2, 3 AdamW steps | "
            "ep2, 3 AdamW steps | verdict |", "|---|---|---|---|---|---|"]
    for f in args.families:
        if refused[f] is not None:
            why = refused[f].split(": ", 1)[-1].replace("|", "/")
            rows.append(f"| {f} | refused | - | - | - | refused: {why} |")
            continue
        verdict, cells = "exact", []
        kind, check, trained = tp2[f]
        if kind == "error":
            rows.append(f"| {f} | {_source(f)} | error | - | - | **ERROR**: {check} |")
            continue
        loss_err, leaf, gerr, tol, _floor = check
        if max(loss_err, gerr) > tol:
            verdict = f"**WRONG** (worst: {leaf})"
        note = f" (tol {tol:.0e}: float32 inside)" if tol > TOL else ""
        cells.append(f"{max(loss_err, gerr):.0e}{note}")
        e = _err(refs[f], trained)
        verdict = "**WRONG**" if e > max(tol, TOL) else verdict
        cells.append(f"{e:.0e}")
        if f in ep2:
            kind, msg, trained = ep2[f]
            if kind == "error":
                cells.append(f"error: {msg}")
                verdict = "**ERROR** (ep2)"
            else:
                e = _err(refs[f], trained)
                cells.append(f"{e:.0e}")
                verdict = "**WRONG** (ep2)" if e > max(tol, TOL) else verdict
        else:
            cells.append("-")
        rows.append(f"| {f} | {_source(f)} | " + " | ".join(cells) + f" | {verdict} |")
    total, ok, missing = style_census()
    import transformers

    census = (f"Of the {total} model types of transformers {transformers.__version__} that "
              f"declare a `base_model_tp_plan`, `hf_rules` maps every style of {ok}; the "
              "others use " + ", ".join(f"`{s}` ({n})" for s, n in missing.items()) + ".")
    table = "\n".join(rows)
    text = (f"{table}\n\n{census}\n\nGenerated by `python benchmarks/hf_coverage.py` "
            f"({time.time() - t0:.0f} s, torch {torch.__version__}, 2 gloo ranks, float64; "
            "errors are relative: max |tp - one process| / max |one process|).")
    print(text)
    if args.write_docs:
        with open(DOC) as fh:
            doc = fh.read()
        i, j = doc.index(BEGIN) + len(BEGIN), doc.index(END)
        with open(DOC, "w") as fh:
            fh.write(doc[:i] + "\n" + text + "\n" + doc[j:])
    return text


if __name__ == "__main__":
    main()
