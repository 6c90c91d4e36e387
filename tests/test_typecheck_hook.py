"""funcpar.typecheck_hook: which functions the test suite's import hook checks, and how.

A throwaway package written to a temporary directory is imported through the hook: annotated
module- and class-level functions are checked (array annotations with shapes bound across
arguments, the others by beartype alone), violations are ``jaxtyping.TypeCheckError`` naming
the parameter, and closures, unannotated functions and ``@no_type_check`` ones are left as
written. funcpar itself is imported through the same hook by tests/conftest.py.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
from jaxtyping import TypeCheckError

from funcpar.typecheck_hook import active_hooks, install_import_hook

SOURCE = '''
"""A module to instrument."""
from __future__ import annotations

import dataclasses
from typing import no_type_check

import torch
from jaxtyping import Float
from torch import Tensor


def scale(x: float, times: int) -> float:
    return x * times


def matmul(a: Float[Tensor, "n k"], b: Float[Tensor, "k m"]) -> Float[Tensor, "n m"]:
    return a @ b


def untyped(x):
    return x


def factory(k: int):
    def closure(x: int) -> int:
        return x * k
    return closure


@no_type_check
def unchecked(x: int) -> int:
    return x


class Box:
    def put(self, item: str) -> str:
        return item

    @property
    def size(self) -> int:
        return "not an int"


@dataclasses.dataclass
class Config:
    width: int
'''


@pytest.fixture
def instrumented(tmp_path, monkeypatch):
    pkg = tmp_path / "hooked_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    hook = install_import_hook("hooked_pkg")
    try:
        yield importlib.import_module("hooked_pkg.mod")
    finally:
        hook.uninstall()
        for name in [n for n in sys.modules if n.startswith("hooked_pkg")]:
            del sys.modules[name]


def test_annotated_functions_are_checked(instrumented):
    m = instrumented
    assert m.scale(2, 3) == 6  # an int where a float is annotated: PEP 484's numeric tower
    with pytest.raises(TypeCheckError, match="times"):
        m.scale(2.0, "3")
    with pytest.raises(TypeCheckError, match="item"):
        m.Box().put(3)
    with pytest.raises(TypeCheckError):
        _ = m.Box().size  # the return annotation too
    with pytest.raises(TypeCheckError):
        m.Config(width="wide")  # a dataclass's fields at construction


def test_array_shapes_bind_across_arguments(instrumented):
    import torch

    m = instrumented
    assert m.matmul(torch.ones(2, 3), torch.ones(3, 4)).shape == (2, 4)
    with pytest.raises(TypeCheckError, match="b"):
        m.matmul(torch.ones(2, 3), torch.ones(5, 4))  # k is 3 for a, 5 for b


def test_closures_unannotated_and_no_type_check_are_left_alone(instrumented):
    m = instrumented
    assert not hasattr(m.untyped, "__wrapped__")
    assert m.factory(2)("x") == "xx"  # a closure: not checked (and not re-decorated per call)
    assert m.unchecked("x") == "x"
    assert hasattr(m.scale, "__wrapped__") and hasattr(m.matmul, "__wrapped__")


def test_funcpar_is_instrumented_in_the_suite():
    from funcpar.state.tree import path_name

    assert ("funcpar", ["funcpar"]) in active_hooks()
    with pytest.raises(TypeCheckError, match="path"):
        path_name("layers.0")  # a tuple is annotated


def test_the_hook_does_not_instrument_itself():
    import funcpar.typecheck_hook

    assert not hasattr(funcpar.typecheck_hook.install_import_hook, "__wrapped__")


def test_funcpar_runs_without_beartype():
    """beartype checks annotations only: without it (a GPU machine with its own environment,
    say) funcpar and its training step still import and run, and only installing the hook
    says what is missing."""
    import subprocess

    code = textwrap.dedent("""
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "beartype":
                    raise ModuleNotFoundError(f"No module named {name!r}", name="beartype")

        sys.meta_path.insert(0, Block())
        import torch
        import funcpar.optim as fo
        from funcpar.train import make_train_step
        from funcpar.state import init_state

        params = {"w": torch.ones(3)}
        step = make_train_step(lambda p, b, x: (x * p["w"], b),
                               lambda out, y: ((out - y) ** 2).mean(), fo.sgd(lr=0.1))
        state, metrics = step(init_state(params, {}, step.optimizer),
                              (torch.zeros(3), torch.ones(3)))
        assert "beartype" not in sys.modules and float(metrics["loss"]) == 1.0
        try:
            import funcpar.typecheck_hook
        except ModuleNotFoundError as err:
            assert err.name == "beartype"
        else:
            raise AssertionError("the hook imported without beartype")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
