"""Lazy initialization: build on the meta device, materialize only this rank's shards.

A model larger than one rank's memory cannot be built whole and then sharded. Here it is built
on the ``meta`` device (shapes and dtypes, no storage), the parallel transforms run on that
meta state exactly as on a real one (a shard or ZeRO part of a meta tensor is a meta tensor of
the local shape: no transform reads values when it is applied), and :func:`materialize`, the
last transform before ``amp_cast``/``offload``, gives every meta leaf the values of *its local
shard* and initializes the optimizer state on them::

    with meta_device():                      # every tensor built inside is meta
        model = Llama(cfg)
    apply_fn, params, buffers = functionalize(model)
    step = make_train_step(apply_fn, lm_loss, opt)
    step, state = compose(shard_params(llama_rules(cfg.head_dim), mesh), data_parallel(mesh),
                          zero_partition(3, mesh), materialize(seed=0))(
        step, init_state(params, buffers, opt))

The state is then exactly what the same composition gives on a model built whole with the
same values (the optimizer state too: ``materialize`` re-runs the step's optimizer ``init``,
which is what the last transform did); ``tests/test_lazy_init.py`` checks this shard for shard
under tp2 x dp2 + ZeRO-3 and trains from it.

**Values independent of the layout.** A leaf's entry ``x[i0, i1, ...]`` is a function of the
seed, the leaf's dotted name and the entry's flat (row-major) index ``c`` in the *global*
tensor, nothing else, so any slice of any leaf - a tensor-parallel shard, a ZeRO part of it, a
blocked split of a fused projection - is computed without computing the rest. The random bits
come from a counter-based generator (as Salmon et al. 2011, "Parallel random numbers: as easy
as 1, 2, 3", whose Philox is what torch's CUDA generator uses): a 32-bit word
``h = f(f((c mod 2^32) xor k0) xor (c div 2^32) xor k1)``, with ``f`` Wellons' ``triple32``
integer hash (a bijection of 32-bit words with near-ideal avalanche) and ``(k0, k1)`` 64 bits
of BLAKE2b over ``(seed, name, stream)``. Uniforms are ``(h + 1/2) / 2^32``; normals are
Box-Muller over two streams, ``sqrt(-2 ln u1) cos(2 pi u2)`` (Box & Muller 1958). This is not
torch's generator, so the values differ from ``nn.Linear(...)``'s own draw; the distributions
are torch's defaults (below). The arithmetic is int64 with every product below 2^49 (no
overflow), so CPU and CUDA give the same bits.

**Init rules.** Per leaf, mirroring each module type's ``reset_parameters``:

==============================  ====================================================
``nn.Linear``, ``nn.Bilinear``  weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                                (``kaiming_uniform_(a=sqrt(5))`` is that bound)
``nn.Conv*d``, transposed       the same with fan_in = ``weight.size(1) * prod(kernel)``
``nn.Embedding``, ``EmbeddingBag``  N(0, 1), the ``padding_idx`` row 0
norms (``LayerNorm``, ``RMSNorm``,  weight 1, bias 0; BatchNorm's ``running_mean`` 0,
``GroupNorm``, ``BatchNorm*``, any  ``running_var`` 1, ``num_batches_tracked`` 0
class named ``*Norm``)
``transformers``' ``Conv1D``     weight N(0, 0.02^2), bias 0 (its own ``__init__``)
==============================  ====================================================

``inits={pattern: init}`` overrides them by leaf name (``fnmatch`` globs over the dotted
names, first match wins; each pattern must match a leaf); :func:`llama_inits` gives the scheme
of :class:`funcpar.models.Llama`. A meta leaf with no rule (a custom module's parameter, a
buffer computed in ``__init__`` such as rotary frequencies, which the meta device loses) is a
ValueError naming it; :func:`values` turns a tensor computed elsewhere into an init.

**Memory.** Each leaf is produced in chunks of at most :data:`CHUNK` entries, so besides the
local shards themselves materialization holds at most ``CHUNK x 48`` bytes of temporaries (six
int64/float64 arrays of a chunk; five measured), 3 MiB: peak memory is the local shards plus
that, never the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from funcpar.shard.layout import Layout
from funcpar.state.train_state import TrainState, generator_state
from funcpar.state.tree import (
    Tree,
    device_of,
    leaves_like,
    named_leaves,
    tree_flatten,
    tree_unflatten,
)
from funcpar.train.step import TrainStep

__all__ = [
    "CHUNK",
    "Init",
    "Slab",
    "check_materialized",
    "constant",
    "fan_in_uniform",
    "init_rules",
    "llama_inits",
    "materialize",
    "materialize_tree",
    "meta_device",
    "normal",
    "uniform",
    "values",
]

#: Entries per chunk of a leaf generated at once (bounds the temporaries, see module docstring).
CHUNK = 1 << 16

_M32 = 0xFFFFFFFF


# ------------------------------------------------------------------ counter-based random bits
def _mul32_(x: Tensor, c: int) -> Tensor:
    """``x <- (x * c) mod 2^32`` in place, for int64 ``x`` in ``[0, 2^32)``: split in 16-bit
    halves of ``c`` so that no int64 product exceeds 2^49 (signed overflow is undefined)."""
    t = x * (c >> 16)
    t &= 0xFFFF
    t <<= 16
    x *= c & 0xFFFF
    x += t
    x &= _M32
    return x


def _triple32_(x: Tensor) -> Tensor:
    """Wellons' ``triple32`` (hash-prospector), in place: a bijective 32-bit integer hash."""
    for shift, mul in ((17, 0xED5AD4BB), (11, 0xAC4C1B51), (15, 0x31848BAB)):
        x ^= x >> shift
        _mul32_(x, mul)
    x ^= x >> 14
    return x


def _keys(seed: int, name: str, stream: int) -> tuple[int, int]:
    digest = hashlib.blake2b(f"{seed}\x00{name}\x00{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


@dataclasses.dataclass(frozen=True)
class Slab:
    """A block of one leaf to initialize: the entries at ``index`` (per dim, global indices)
    of the leaf ``name`` of global shape ``global_shape``. An :data:`Init` maps a slab to its
    values; :meth:`uniform` and :meth:`normal` are the leaf's random numbers at those entries,
    the same whichever slab asks for them."""

    name: str
    global_shape: tuple[int, ...]
    index: tuple[Tensor, ...]
    seed: int
    device: torch.device

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(i) for i in self.index)

    def counters(self) -> Int[Tensor, "*shape"]:
        """Each entry's flat row-major index in the global leaf."""
        flat = torch.zeros(self.shape, dtype=torch.int64, device=self.device)
        stride = 1
        for d in reversed(range(len(self.index))):
            view = [1] * len(self.index)
            view[d] = -1
            flat += self.index[d].to(self.device).view(view) * stride
            stride *= self.global_shape[d]
        return flat

    def bits(self, stream: int = 0) -> Int[Tensor, "*shape"]:
        """32 random bits per entry (int64 in ``[0, 2^32)``) of ``stream``."""
        k0, k1 = _keys(self.seed, self.name, stream)
        # In place throughout: a chunk's temporaries are a few arrays (module docstring).
        c = self.counters()
        h = c & _M32
        h ^= k0
        _triple32_(h)
        c >>= 32
        c ^= k1
        h ^= c
        del c
        return _triple32_(h)

    def uniform(self, stream: int = 0) -> Float[Tensor, "*shape"]:
        """U(0, 1) per entry, float64 in ``(0, 1)``."""
        u = self.bits(stream).double()
        u += 0.5
        u *= 2.0**-32
        return u

    def normal(self, stream: int = 0) -> Float[Tensor, "*shape"]:
        """N(0, 1) per entry, float64 (Box-Muller over streams ``2 stream`` and ``+1``)."""
        r = self.uniform(2 * stream).log_().mul_(-2.0).sqrt_()
        return r.mul_(self.uniform(2 * stream + 1).mul_(2.0 * math.pi).cos_())


#: ``init(slab) -> values of slab.shape`` (any dtype; cast to the leaf's).
Init = Callable[[Slab], Tensor]


def normal(std: float = 1.0, mean: float = 0.0) -> Init:
    """N(mean, std^2)."""
    return lambda s: s.normal() * std + mean


def uniform(low: float, high: float) -> Init:
    """U(low, high)."""
    if not high >= low:
        raise ValueError(f"uniform init: high ({high}) must be >= low ({low})")
    return lambda s: s.uniform() * (high - low) + low


def constant(value: float) -> Init:
    """Every entry ``value``."""
    return lambda s: torch.full(s.shape, value, dtype=torch.float64, device=s.device)


def fan_in_uniform(fan_in: int | None = None) -> Init:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): torch's ``kaiming_uniform_(a=sqrt(5))`` of Linear
    and Conv weights and the bound of their biases. ``fan_in`` defaults to the leaf's
    ``prod(global_shape[1:])`` (torch's fan-in of a weight); 0 gives zeros, as torch skips."""

    def init(s: Slab) -> Tensor:
        n = math.prod(s.global_shape[1:]) if fan_in is None else fan_in
        if n == 0:
            return torch.zeros(s.shape, dtype=torch.float64, device=s.device)
        bound = 1.0 / math.sqrt(n)
        return s.uniform() * (2 * bound) - bound

    return init


def values(tensor: Tensor) -> Init:
    """The entries of a whole ``tensor`` computed elsewhere (a buffer the meta device lost)."""

    def init(s: Slab) -> Tensor:
        if tuple(tensor.shape) != s.global_shape:
            raise ValueError(f"values init for {s.name!r}: tensor of shape "
                             f"{tuple(tensor.shape)}, leaf of global shape {s.global_shape}")
        grid = torch.meshgrid(*[i.to(tensor.device) for i in s.index], indexing="ij")
        return tensor[grid] if s.index else tensor.clone()

    return init


def _zero_row(init: Init, row: int | None) -> Init:
    if row is None:
        return init

    def zeroed(s: Slab) -> Tensor:
        out = init(s)
        hit = (s.index[0] == row).to(out.device)
        out[hit] = 0
        return out

    return zeroed


# ------------------------------------------------------------------------------- init rules
_ONES, _ZEROS = constant(1.0), constant(0.0)


def _is_norm(m: nn.Module) -> bool:
    norms = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)
    return isinstance(m, norms) or type(m).__name__.endswith("Norm") or (
        hasattr(nn, "RMSNorm") and isinstance(m, nn.RMSNorm))


def _default(m: nn.Module, attr: str, leaf: Tensor) -> Init | None:
    """torch's (or the module's own) ``reset_parameters`` distribution for ``m.<attr>``."""
    if isinstance(m, (nn.Linear, nn.Bilinear)) and attr in ("weight", "bias"):
        return fan_in_uniform(m.weight.shape[1])
    if isinstance(m, nn.modules.conv._ConvNd) and attr in ("weight", "bias"):
        return fan_in_uniform(math.prod(m.weight.shape[1:]))
    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and attr == "weight":
        return _zero_row(normal(1.0), m.padding_idx)
    if _is_norm(m):
        rule = {"weight": _ONES, "scale": _ONES, "bias": _ZEROS, "running_mean": _ZEROS,
                "running_var": _ONES, "num_batches_tracked": _ZEROS}
        return rule.get(attr)
    if type(m).__name__ == "Conv1D" and hasattr(m, "nf"):  # transformers' GPT-2 linear
        return {"weight": normal(0.02), "bias": _ZEROS}.get(attr)
    return None


def init_rules(module: nn.Module, inits: Mapping[str, Init] | None = None) -> dict[str, Init]:
    """The init of every parameter and buffer of ``module`` (dotted names, as
    :func:`~funcpar.state.functionalize` names them) that has one: the first pattern of
    ``inits`` matching the name (fnmatch), else the module type's default (module docstring).
    A pattern that matches no leaf is a ValueError."""
    leaves: dict[str, tuple[nn.Module, str, Tensor]] = {}
    for kind in ("named_parameters", "named_buffers"):
        for name, t in getattr(module, kind)():
            prefix, _, attr = name.rpartition(".")
            leaves.setdefault(name, (module.get_submodule(prefix) if prefix else module,
                                     attr, t))
    patterns = dict(inits or {})
    for pat, fn in patterns.items():
        if not callable(fn):
            raise TypeError(f"inits[{pat!r}] must be an init (slab -> tensor), got {fn!r}")
        if not any(fnmatch.fnmatchcase(n, pat) for n in leaves):
            raise ValueError(f"inits pattern {pat!r} matches no parameter or buffer (e.g. "
                             f"{list(leaves)[:3]})")
    out: dict[str, Init] = {}
    for name, (owner, attr, t) in leaves.items():
        rule = next((fn for pat, fn in patterns.items() if fnmatch.fnmatchcase(name, pat)),
                    None)
        rule = rule if rule is not None else _default(owner, attr, t)
        if rule is not None:
            out[name] = rule
    return out


def llama_inits(cfg: Any) -> dict[str, Init]:
    """The distribution of :class:`funcpar.models.Llama`'s own init (norms 1, the residual
    outputs ``o_proj``/``down_proj`` N(0, (init_std / sqrt(2 n_layers))^2), every other
    matrix and the embedding N(0, init_std^2)) as lazy ``inits``; ``cfg`` a ``LlamaConfig``.
    With experts (``cfg.n_experts > 0``) the MoE blocks' stacked expert leaves too: ``down_proj``
    as the residual outputs, ``gate_proj``/``up_proj`` N(0, init_std^2) (the router is a
    ``*.weight``)."""
    std = cfg.init_std
    residual = normal(std / math.sqrt(2 * cfg.n_layers))
    rules = {
        "*norm.weight": _ONES,
        "*.o_proj.weight": residual,
        "*.down_proj.weight": residual,
        "*.weight": normal(std),
    }
    if cfg.n_experts:  # only then: each pattern must match a leaf
        rules.update({"*.experts.down_proj": residual, "*.experts.gate_proj": normal(std),
                      "*.experts.up_proj": normal(std)})
    return rules


# -------------------------------------------------------------------------- materialization
def _local_index(name: str, x: Tensor, layout: Layout | None) -> tuple[tuple[int, ...],
                                                                       tuple[Tensor, ...]]:
    if layout is None:
        shape = tuple(x.shape)
        return shape, tuple(torch.arange(n, dtype=torch.int64) for n in shape)
    index = layout.local_indices()
    if tuple(len(i) for i in index) != tuple(x.shape):
        raise ValueError(f"{name!r}: the meta leaf has shape {tuple(x.shape)} but its layout "
                         f"{layout!r} gives this rank a shard of "
                         f"{tuple(len(i) for i in index)}")
    return layout.global_shape, index


def _chunks(index: tuple[Tensor, ...]) -> Iterator[tuple[tuple[Any, ...], tuple[Tensor, ...]]]:
    """(where in the local shard, the slab's index) pieces of at most CHUNK entries: the
    trailing dims whole from the first dim ``d`` whose tail fits, dim ``d`` cut in runs, the
    dims before it one entry at a time."""
    shape = [len(i) for i in index]
    d = next((k for k in range(len(shape)) if math.prod(shape[k + 1:]) <= CHUNK), len(shape))
    if d == len(shape):  # a 0-d leaf
        yield (), index
        return
    run = max(1, CHUNK // max(1, math.prod(shape[d + 1:])))
    for outer in itertools.product(*[range(n) for n in shape[:d]]):
        for a in range(0, shape[d], run):
            b = min(a + run, shape[d])
            where = (*outer, slice(a, b))
            yield where, (*[index[k][o:o + 1] for k, o in enumerate(outer)], index[d][a:b],
                          *index[d + 1:])


def _fill(name: str, x: Tensor, layout: Layout | None, init: Init, seed: int,
          device: torch.device) -> Tensor:
    global_shape, index = _local_index(name, x, layout)
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    for where, idx in _chunks(index):
        slab = Slab(name, global_shape, idx, seed, device)
        value = init(slab)
        if not torch.is_tensor(value) or tuple(value.shape) != slab.shape:
            got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"the init of {name!r} returned {got} for a slab of {slab.shape}")
        # Keep the chunk's own dims (the dims before the cut were taken one entry at a time).
        out[where] = value.reshape(out[where].shape).to(dtype=x.dtype, device=device)
    return out


def materialize_tree(tree: Tree, layouts: Tree | None, rules: Mapping[str, Init], *,
                     seed: int = 0, device: torch.device | str | None = None) -> Tree:
    """``tree`` with every meta leaf given the values of its local shard (``layouts[leaf]``,
    None: the whole leaf) by ``rules[name]``; other leaves are kept. ``device``: where the new
    tensors go (default: the layouts' mesh device, else the CPU). A meta leaf without a rule,
    or whose shape is not its layout's local shape, is a ValueError naming it."""
    lays = leaves_like(tree, layouts, what="layouts", against="tree")
    if device is None:
        mesh = next((lay.mesh for lay in lays if isinstance(lay, Layout)), None)
        device = mesh.device if mesh is not None else torch.device("cpu")
    device = torch.device(device)
    spec = tree_flatten(tree)[1]
    out = []
    for (name, x), lay in zip(named_leaves(tree), lays):
        if not (torch.is_tensor(x) and x.is_meta):
            out.append(x)
            continue
        if name not in rules:
            raise ValueError(
                f"{name!r} is on the meta device and no init rule gives it values (no default "
                "for its module type and no inits pattern matches it): pass inits={"
                f"{name!r}: ...}} (funcpar.init.normal/uniform/constant/values)"
            )
        out.append(_fill(name, x, lay, rules[name], seed, device))
    return tree_unflatten(spec, out)


def check_materialized(state: TrainState | Tree, what: str = "state") -> None:
    """A ValueError naming the first leaf still on the meta device (an offloaded optimizer
    state's meta handles excepted: they stand for leaves in a store)."""
    parts = state._asdict().items() if isinstance(state, TrainState) else [("", state)]
    for field, tree in parts:
        if type(tree).__name__ == "OffloadedState":
            continue
        for name, x in named_leaves(tree):
            if torch.is_tensor(x) and x.is_meta:
                where = ".".join(p for p in (field, name) if p)
                raise ValueError(f"{what}: {where!r} is still on the meta device (shape "
                                 f"{tuple(x.shape)}); materialize it first "
                                 "(funcpar.init.materialize)")


def materialize(*, seed: int = 0, inits: Mapping[str, Init] | None = None,
                device: torch.device | str | None = None
                ) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The transform that gives a meta-built state its values (module docstring).

    Apply it after ``shard_params``, ``data_parallel`` and ``zero_partition`` (their layouts,
    ``step.layouts``, say which shard each rank holds) and before ``amp_cast`` and ``offload``
    (which read values); on one process without them it is the full init. Meta params and
    buffers get their values from :func:`init_rules` (``inits`` overriding the defaults) and
    ``seed``; the optimizer state is then ``step.optimizer.init(params)``, as the last transform
    would have made it. The step is unchanged; the returned state holds no meta leaf (checked).
    """

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        module = getattr(step.apply_fn, "module", None)
        if module is None:
            raise TypeError("materialize needs a step built on functionalize(module)'s apply_fn "
                            "(the module's types give the default inits)")
        if step.precision is not None:
            raise ValueError(f"materialize after amp_cast({step.precision!r}): apply it before "
                             "amp_cast, which must come last")
        if type(state.opt_state).__name__ == "OffloadedState":
            raise ValueError("materialize after offload: apply it before offload, whose store "
                             "would hold the meta optimizer state")
        rules = init_rules(module, inits)
        params = materialize_tree(state.params, step.layouts, rules, seed=seed, device=device)
        buffers = materialize_tree(state.buffers, None, rules, seed=seed, device=device)
        opt_state = state.opt_state
        if any(torch.is_tensor(x) and x.is_meta for x in tree_flatten(opt_state)[0]):
            opt_state = step.optimizer.init(params)
        # A lazily built state holds a CPU generator's state; parameters materialized on CUDA
        # draw from a CUDA generator, whose state is of another kind (seeded from ``seed``).
        rng, where = state.rng, device_of(params)
        if rng.numel() != generator_state(where, 0).numel():
            rng = generator_state(where, seed)
        new = state._replace(params=params, buffers=buffers, opt_state=opt_state, rng=rng)
        check_materialized(new, "materialize")
        return step, new

    return transform


# ----------------------------------------------------------------------------- meta device
class _ForceMeta(TorchFunctionMode):
    """Every tensor factory and device move lands on ``meta``, explicit devices included
    (a module that calls ``to_empty(device="cpu")`` in its ``__init__``, as funcpar's Llama
    does, would otherwise allocate itself whole)."""

    _MOVES = frozenset({torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda})

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = "meta"
        if func in self._MOVES:
            if func is not torch.Tensor.to:
                return args[0].to("meta")
            args = tuple("meta" if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """Inside, every tensor is created on the ``meta`` device, whatever device the code asks
    for: ``with meta_device(): model = Llama(cfg)`` allocates nothing. Plain
    ``with torch.device("meta")`` is enough for modules that never name a device."""
    with torch.device("meta"), _ForceMeta():
        yield
