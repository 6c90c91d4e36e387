"""The runtime type checker for funcpar's annotations.

Tests (and users who want the checks) instrument the package with jaxtyping's import hook:
``pytest --jaxtyping-packages=funcpar,funcpar.typecheck.checker`` or
``jaxtyping.install_import_hook("funcpar", "funcpar.typecheck.checker")``. It is beartype with
PEP 484's numeric tower on, so an ``int`` is accepted where a ``float`` is annotated.
"""

from beartype import BeartypeConf, beartype

__all__ = ["checker"]

checker = beartype(conf=BeartypeConf(is_pep484_tower=True))
