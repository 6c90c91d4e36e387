"""funcpar: a functional, stateless trainer for PyTorch built on torch.func."""

try:
    # Imported before any import hook is installed: a hook names it as a path
    # ("funcpar.typecheck.checker") and must find it loaded, not instrument it.
    from funcpar import typecheck  # noqa: F401
except ModuleNotFoundError as err:  # beartype absent: funcpar runs, only the checks cannot
    if err.name != "beartype":
        raise

__version__ = "0.1.0"
