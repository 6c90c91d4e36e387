"""Typed-shape testing: jaxtyping annotations checked at run time by beartype.

    python examples/typed_shapes.py                 # runs the checks, prints what was caught
    python examples/typed_shapes.py --batch 4 --seq 16
    python -m pytest -q examples/typed_shapes.py    # the same checks as pytest tests

A shape annotation such as ``Float[Tensor, "batch heads seq head_dim"]`` names every axis; with
``@jaxtyped(typechecker=beartype)`` each call checks the arguments and the return value against
them, and an axis name binds one size across all of them (``seq`` of ``q`` must equal ``seq``
of ``k``). A wrong shape is a ``jaxtyping.TypeCheckError`` (a ``TypeError``) raised at the call
whose message names the parameter ("The problem arose whilst typechecking parameter 'k'") and
lists the sizes each axis name was bound to, rather than a broadcasting accident three
functions later.

funcpar's own public functions carry the same annotations. They are checked when funcpar is
imported through its type-check import hook (``funcpar.typecheck_hook``), as done below before
the first funcpar import (the test suite's conftest.py does the same), so a user's
training code that passes, say, targets one token longer than the logits fails at
``funcpar.models.lm_loss`` with the argument named.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence

import jaxtyping
import torch
from beartype import beartype
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor

# Instrument funcpar before it is first imported: every annotated function it defines is then
# checked with funcpar's checker (beartype with int accepted as float; array shapes through
# jaxtyping). jaxtyping's own hook works too (jaxtyping.install_import_hook("funcpar",
# "funcpar.typecheck.checker")), wrapping every function, at ~2.5x the run time. Under pytest
# funcpar is instrumented already, and this is a no-op for imported modules.
from funcpar.typecheck_hook import install_import_hook

with install_import_hook("funcpar"):
    from funcpar.models import Llama, LlamaConfig, lm_loss
    from funcpar.train.cli import add_debug_flag, positive_int, run_cli


# ----------------------------------------------------------------- a user's typed functions
@jaxtyped(typechecker=beartype)
def attention_scores(
    q: Float[Tensor, "batch heads seq head_dim"],
    k: Float[Tensor, "batch heads seq head_dim"],
) -> Float[Tensor, "batch heads seq seq"]:
    """Scaled dot-product scores ``q k^T / sqrt(head_dim)`` (Vaswani et al. 2017)."""
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


@jaxtyped(typechecker=beartype)
def next_token_accuracy(
    logits: Float[Tensor, "batch seq vocab"], targets: Int[Tensor, "batch seq"]
) -> Float[Tensor, ""]:
    """The fraction of positions whose arg-max prediction is the target."""
    return (logits.argmax(-1) == targets).float().mean()


@jaxtyped(typechecker=beartype)
def bad_transpose(x: Float[Tensor, "batch seq dim"]) -> Float[Tensor, "batch seq dim"]:
    """A bug the return annotation catches: the output is ``[batch, dim, seq]``."""
    return x.transpose(1, 2)


# ------------------------------------------------------------------------------- checks
def caught(fn: Callable[[], object]) -> str:
    """The message of the TypeCheckError ``fn`` raises; AssertionError when it raises none."""
    try:
        fn()
    except jaxtyping.TypeCheckError as err:
        return str(err)
    raise AssertionError("expected a jaxtyping.TypeCheckError, none was raised")


def check_user_functions(batch: int = 2, seq: int = 8, heads: int = 4, head_dim: int = 16
                         ) -> dict[str, str]:
    """Right shapes pass; a wrong head_dim, a mismatched seq and a wrong return are caught,
    each error naming what was wrong. Returns the first line naming the culprit of each."""
    q = torch.randn(batch, heads, seq, head_dim)
    k = torch.randn(batch, heads, seq, head_dim)
    scores = attention_scores(q, k)
    assert scores.shape == (batch, heads, seq, seq)
    acc = next_token_accuracy(torch.randn(batch, seq, 11), torch.randint(0, 11, (batch, seq)))
    assert 0.0 <= float(acc) <= 1.0

    found = {}
    # k with another head_dim: "head_dim" was bound to q's size first, so k is the culprit.
    msg = caught(lambda: attention_scores(q, torch.randn(batch, heads, seq, head_dim + 1)))
    assert "parameter 'k'" in msg and f"head_dim={head_dim}" in msg, msg
    found["wrong head_dim"] = _culprit(msg)
    # targets one position longer than the logits (an off-by-one in the shift).
    msg = caught(lambda: next_token_accuracy(torch.randn(batch, seq, 11),
                                             torch.randint(0, 11, (batch, seq + 1))))
    assert "parameter 'targets'" in msg, msg
    found["targets too long"] = _culprit(msg)
    # float targets: the dtype is part of the annotation too.
    msg = caught(lambda: next_token_accuracy(torch.randn(batch, seq, 11),
                                             torch.zeros(batch, seq)))
    assert "parameter 'targets'" in msg, msg
    found["float targets"] = _culprit(msg)
    msg = caught(lambda: bad_transpose(torch.randn(batch, seq, 3)))
    assert "return" in msg.lower(), msg
    found["wrong return shape"] = _culprit(msg)
    return found


def check_funcpar_functions(batch: int = 2, seq: int = 8, vocab: int = 32) -> dict[str, str]:
    """funcpar's annotated API under the import hook: a model's logits with targets one token
    too long fail in ``lm_loss`` naming ``targets``; a right call returns a 0-d loss."""
    model = Llama(LlamaConfig(vocab_size=vocab, dim=32, n_layers=1, n_heads=2, max_seq_len=seq))
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    loss = lm_loss(logits, tokens[:, 1:])
    assert loss.dim() == 0 and math.isfinite(float(loss))
    msg = caught(lambda: lm_loss(logits, tokens))  # forgot to shift: seq + 1 targets
    assert "parameter 'targets'" in msg, msg
    return {"lm_loss targets not shifted": _culprit(msg)}


def _culprit(msg: str) -> str:
    for line in msg.splitlines():
        if "arose whilst" in line:
            return line.strip()
    return msg.splitlines()[0].strip()


# ---------------------------------------------------------------- as pytest-style tests
def test_user_functions_catch_wrong_shapes() -> None:
    found = check_user_functions()
    assert set(found) == {"wrong head_dim", "targets too long", "float targets",
                          "wrong return shape"}


def test_funcpar_api_is_checked() -> None:
    found = check_funcpar_functions()
    assert "parameter 'targets'" in found["lm_loss targets not shifted"]


# ------------------------------------------------------------------------------- script
def main(argv: Sequence[str] | None = None) -> dict[str, str]:
    p = argparse.ArgumentParser(prog="typed_shapes.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=positive_int, default=2)
    p.add_argument("--seq", type=positive_int, default=8)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=16)
    add_debug_flag(p)
    args = p.parse_args(argv)
    found = check_user_functions(args.batch, args.seq, args.heads, args.head_dim)
    found.update(check_funcpar_functions(args.batch, args.seq))
    for what, line in found.items():
        print(f"caught {what:<28} {line}")
    print(f"all {len(found)} wrong shapes were caught, each naming the argument or the return")
    return found


if __name__ == "__main__":
    run_cli(main)  # a user's error as one line on stderr, exit 2; --debug: the traceback
