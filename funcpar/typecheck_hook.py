"""The import hook that type-checks funcpar's annotations at run time.

Tests (and users who want the checks) import funcpar through :func:`install_import_hook`
(``tests/conftest.py`` does it before the first funcpar import). Every module- or class-level
function of the package that carries annotations is then checked at each call by
:data:`funcpar.typecheck.checker` (beartype, with PEP 484's numeric tower on, so an ``int`` is
accepted where a ``float`` is annotated):

* a function with a jaxtyping array annotation (``Float[Tensor, "n m"]``, ...) through
  ``jaxtyping.jaxtyped``, so that named dimensions must agree across its arguments and result;
* any other annotated function through beartype alone: the same checks, without jaxtyping's
  per-call signature binding, which made the instrumented package ~2.5x slower than the plain
  one (measured on the test suite: jaxtyping's own import hook wraps every function, nested
  closures and unannotated ones included, and re-decorates a closure each time it is made);
* dataclasses as jaxtyping does (their ``__init__`` checks the fields).

Functions nested in functions (closures such as an optimizer's ``update``), functions without
annotations and anything under ``@typing.no_type_check`` are left as written. A violation is
a ``jaxtyping.TypeCheckError`` (a ``TypeError``) either way, naming the parameter. Inside a
``torch.compile`` trace the beartype-only checks step aside (dynamo would check its proxies).

jaxtyping's own hook (``jaxtyping.install_import_hook("funcpar", "funcpar.typecheck.checker")``)
works too, with every function wrapped (this module and ``funcpar.typecheck`` included: their
own functions are then checked, which is harmless).
"""

from __future__ import annotations

import ast
import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterable
from typing import Any

from funcpar.typecheck import checker

__all__ = ["ARRAY_TYPES", "HOOKS_ENV", "ImportHook", "active_hooks", "install_hooks",
           "install_import_hook"]

#: Names whose presence in an annotation makes it a jaxtyping array annotation.
ARRAY_TYPES = frozenset({
    "AbstractArray", "Array", "BFloat16", "Bool", "Complex", "Complex64", "Complex128", "Float",
    "Float16", "Float32", "Float64", "Inexact", "Int", "Int8", "Int16", "Int32", "Int64",
    "Integer", "Key", "Num", "Real", "Shaped", "UInt", "UInt8", "UInt16", "UInt32", "UInt64",
})

# The instrumented module refers to this one by a name no source file uses.
_ALIAS = "__funcpar_typecheck__"
_SELF = __name__
# Imported before any hook is installed (funcpar/__init__ imports the checker): never instrumented.
_NEVER = (_SELF, "funcpar.typecheck")


def shaped(fn: Any) -> Any:
    """``jaxtyping.jaxtyped`` with :data:`checker`: array shapes bound across the call."""
    from jaxtyping import jaxtyped

    return jaxtyped(fn, typechecker=checker)


def plain(fn: Callable[..., Any]) -> Callable[..., Any]:
    """:data:`checker` alone, its violations raised as ``jaxtyping.TypeCheckError``."""
    from beartype.roar import BeartypeCallHintViolation
    from jaxtyping import TypeCheckError
    from torch.compiler import is_compiling

    inner = checker(fn)
    if inner is fn:  # nothing beartype can check
        return fn

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if is_compiling():  # dynamo would trace the checks over its own proxies of the values
            return fn(*args, **kwargs)
        try:
            return inner(*args, **kwargs)
        except BeartypeCallHintViolation as err:
            raise TypeCheckError(str(err)) from None

    return checked


def _annotations(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.expr]:
    a = node.args
    args = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
    found = [x.annotation for x in args if x.annotation is not None]
    return found if node.returns is None else [*found, node.returns]


def _names(node: ast.AST) -> set[str]:
    """Every name in an annotation, strings (``from __future__ import annotations``) parsed."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            try:
                out |= _names(ast.parse(n.value, mode="eval"))
            except SyntaxError:  # a jaxtyping dimension string such as "n m"
                pass
    return out


def _no_type_check(decorators: list[ast.expr]) -> bool:
    for d in decorators:
        d = d.func if isinstance(d, ast.Call) else d
        if (isinstance(d, ast.Name) and d.id == "no_type_check") or (
                isinstance(d, ast.Attribute) and d.attr == "no_type_check"):
            return True
    return False


def _decorator(name: str, like: ast.AST) -> ast.expr:
    dec = ast.Attribute(ast.Name(_ALIAS, ast.Load()), name, ast.Load())
    return ast.copy_location(dec, like)


class _Instrument(ast.NodeTransformer):
    """Adds the decorators (see the module docstring) to one module's tree."""

    def __init__(self) -> None:
        self._in_function = 0
        self._skipped = 0

    def visit_Module(self, node: ast.Module) -> ast.Module:
        self.generic_visit(node)
        at = 0  # after the docstring and the __future__ imports, which must come first
        for i, stmt in enumerate(node.body):
            doc = (i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                   and isinstance(stmt.value.value, str))
            future = isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__"
            if not (doc or future):
                break
            at = i + 1
        node.body.insert(at, ast.Import([ast.alias(_SELF, _ALIAS)]))
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        skip = _no_type_check(node.decorator_list)
        self._skipped += skip
        if not (self._skipped or self._in_function):
            # Outermost, as jaxtyping: the dataclass decorator has run when it sees the class.
            node.decorator_list.insert(0, _decorator("shaped", node))
        self.generic_visit(node)
        self._skipped -= skip
        return node

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        skip = _no_type_check(node.decorator_list)
        anns = _annotations(node)
        if anns and not (skip or self._skipped or self._in_function):
            kind = "shaped" if any(_names(a) & ARRAY_TYPES for a in anns) else "plain"
            # Innermost: it sees the function as written (property, staticmethod, cache and
            # torch.compile wrappers come after it).
            node.decorator_list.append(_decorator(kind, node))
        self._skipped += skip
        self._in_function += 1
        self.generic_visit(node)
        self._in_function -= 1
        self._skipped -= skip
        return node

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function


def instrument(source: str | bytes, path: str) -> Any:
    """The code object of ``source`` with the checks added."""
    tree = ast.parse(source, path)
    tree = ast.fix_missing_locations(_Instrument().visit(tree))
    return compile(tree, path, "exec", dont_inherit=True)


class _Loader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname: str) -> Any:
        # Never the cached bytecode: __pycache__ holds the plain module's, and an instrumented
        # one written there would check a later plain import.
        path = self.get_filename(fullname)
        return instrument(self.get_data(path), path)


class ImportHook(importlib.abc.MetaPathFinder):
    """Instruments the modules of ``packages`` (and their submodules) imported after it is
    installed; :meth:`uninstall` removes it (modules already imported stay instrumented)."""

    def __init__(self, packages: Iterable[str]) -> None:
        self.packages = tuple(packages)

    def _covers(self, fullname: str) -> bool:
        return fullname not in _NEVER and any(
            fullname == p or fullname.startswith(p + ".") for p in self.packages)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not self._covers(fullname):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = _Loader(spec.loader.name, spec.loader.path)
            return spec
        return None

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def __enter__(self) -> ImportHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def install_import_hook(packages: str | Iterable[str] = ("funcpar",)) -> ImportHook:
    """Check the annotations of ``packages`` (module names) imported from now on; also a
    context manager that uninstalls the hook on exit (modules imported inside stay checked)."""
    hook = ImportHook([packages] if isinstance(packages, str) else packages)
    sys.meta_path.insert(0, hook)
    return hook


#: The environment variable through which a process hands :func:`active_hooks` (as JSON) to the
#: processes it starts (read by :mod:`funcpar.testing.rank_preload`).
HOOKS_ENV = "FUNCPAR_RANK_PRELOAD"


def active_hooks() -> list[tuple[str, list[str]]]:
    """This process's type-check import hooks as ``(kind, packages)``: ``"funcpar"`` for
    :class:`ImportHook`, ``"jaxtyping"`` for jaxtyping's own (whose typechecker name it does not
    keep: :func:`install_hooks` gives it :data:`checker`). For processes that must check what
    this one checks (``funcpar.testing.run_ranks``' ranks)."""
    hooks = []
    for finder in sys.meta_path:
        if isinstance(finder, ImportHook):
            hooks.append(("funcpar", list(finder.packages)))
        elif type(finder).__module__.startswith("jaxtyping"):
            modules = getattr(finder, "modules", None)
            if modules:
                hooks.append(("jaxtyping", list(modules)))
    return hooks


def install_hooks(hooks: Iterable[tuple[str, list[str]]]) -> None:
    """Install hooks described by :func:`active_hooks` (in another process)."""
    for kind, packages in hooks:
        if kind == "funcpar":
            install_import_hook(packages)
        else:
            from jaxtyping import install_import_hook as jaxtyping_hook

            jaxtyping_hook(packages, "funcpar.typecheck.checker")
