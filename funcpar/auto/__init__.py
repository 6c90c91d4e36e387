"""Automatic layouts: choose ``tp (1D or 2D) x pp x dp x ep x cp x ZeRO x remat x offload`` for
a model and a cluster from a cost model priced by a device profile (docs/AUTO_PARALLEL.md).

* :mod:`funcpar.auto.model`: parameters, FLOPs and activations of a Llama config;
* :mod:`funcpar.auto.analytic`: the plan's collectives and memory per rank, analytically;
* :mod:`funcpar.auto.profile`: device profiles (measured: ``python -m funcpar.profile``;
  shipped: ``h100``, ``a100``);
* :mod:`funcpar.auto.cost`: step time, memory and MFU of one layout;
* :mod:`funcpar.auto.search`: :func:`auto_parallel`, the ranked feasible layouts and the
  winner as a preset.
"""

from funcpar.auto.analytic import Choice, analytic_plan
from funcpar.auto.cost import Estimate, estimate
from funcpar.auto.model import ModelSpec, model_spec
from funcpar.auto.profile import DeviceProfile, Figure, load_profile, measure
from funcpar.auto.search import (
    AutoResult,
    NoFeasibleLayout,
    auto_parallel,
    parse_bytes,
    preset_for,
    what_if,
)

__all__ = [
    "AutoResult",
    "Choice",
    "DeviceProfile",
    "Estimate",
    "Figure",
    "ModelSpec",
    "NoFeasibleLayout",
    "analytic_plan",
    "auto_parallel",
    "estimate",
    "load_profile",
    "measure",
    "model_spec",
    "parse_bytes",
    "preset_for",
    "what_if",
]
