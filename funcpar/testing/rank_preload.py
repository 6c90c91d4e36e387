"""Imported once by :func:`funcpar.testing.run_ranks`'s forkserver, so that ranks start warm.

Every rank is forked from the forkserver; whatever the forkserver has imported, a rank has
without paying for it. Importing funcpar instrumented by a type-check import hook (the test
suite's) cost ~6 s of CPU per process on this project's CI machine with jaxtyping's hook,
against ~1.5 s plain: paid once here instead of once per rank, it was most of a multi-rank
test's time.

The hooks to install come from ``$FUNCPAR_RANK_PRELOAD`` (``typecheck_hook.HOOKS_ENV``, JSON of
:func:`funcpar.typecheck_hook.active_hooks` in the process that starts the forkserver), so the
preloaded modules are checked exactly as a cold rank's would be. Without the variable this
module imports funcpar unchecked. A failure here is harmless: the forkserver ignores a preload
that raises ImportError, and a rank imports whatever is missing itself.
"""

from __future__ import annotations

import importlib
import json
import os

from funcpar.typecheck_hook import HOOKS_ENV, install_hooks

#: funcpar's packages a rank imports (their ``__init__`` imports their modules). Optional
#: dependencies (datasets, transformers) stay lazy: only the tests that need them pay for them.
PACKAGES = (
    "funcpar.state", "funcpar.shard", "funcpar.kernels", "funcpar.optim", "funcpar.offload",
    "funcpar.train", "funcpar.init", "funcpar.models", "funcpar.pipeline",
    "funcpar.transforms", "funcpar.presets",
)


def _preload() -> None:
    install_hooks(json.loads(os.environ.get(HOOKS_ENV) or "[]"))
    for name in PACKAGES:
        importlib.import_module(name)


_preload()
