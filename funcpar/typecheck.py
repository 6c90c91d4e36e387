"""The runtime type checker of funcpar's annotations.

Tests (and users who want the checks) instrument the package with
:func:`funcpar.typecheck_hook.install_import_hook` (``tests/conftest.py`` does), which checks
every annotated function with this checker (array annotations through ``jaxtyping.jaxtyped``);
jaxtyping's own hook works too: ``jaxtyping.install_import_hook("funcpar",
"funcpar.typecheck.checker")``. It is beartype with PEP 484's numeric tower on, so an ``int`` is
accepted where a ``float`` is annotated. This module stays this small: it is imported (by
funcpar/__init__) before any hook is installed, and a hook names it as a path.
"""

from beartype import BeartypeConf, beartype

__all__ = ["checker"]

checker = beartype(conf=BeartypeConf(is_pep484_tower=True))
