"""Turn an ``nn.Module`` into a pure function over parameter and buffer trees."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ApplyFn", "functionalize"]

#: ``apply_fn(params, buffers, *args, **kwargs) -> (output, new_buffers)``
ApplyFn = Callable[..., tuple[Any, dict[str, Tensor]]]


def functionalize(module: nn.Module, *, release: bool = False
                  ) -> tuple[ApplyFn, dict[str, Tensor], dict[str, Tensor]]:
    """``(apply_fn, params, buffers)`` for ``module``: ``torch.func.functional_call``'s
    swap, resolved once (the owner and attribute of every leaf, tied aliases included) rather
    than on every call; under ``torch.compile`` the call is ``functional_call`` itself.

    ``params`` and ``buffers`` are flat dicts keyed by the dotted names of
    ``named_parameters`` / ``named_buffers`` (tied weights appear once). They are detached
    *views* of the module's tensors, not copies: funcpar never writes a tensor in place, so the
    module's own tensors stay as they are and no memory is doubled.

    ``apply_fn(params, buffers, *args, **kwargs) -> (output, new_buffers)`` is pure. Modules
    that update buffers in their forward (BatchNorm's running statistics) work on copies of the
    buffers, which are returned as ``new_buffers``; the ``buffers`` passed in are never mutated.
    The train/eval mode of the module and of each submodule is fixed at the time of
    ``functionalize`` (it decides, for example, whether BatchNorm updates its statistics; a
    frozen BatchNorm left in eval mode inside a training model stays so), so a later
    ``module.eval()`` does not change ``apply_fn``: functionalize again for the other mode.
    ``apply_fn.module`` is the module, for transforms that need its structure.

    ``release=True`` hands the tensors over: the module's own parameters and buffers are
    moved to the ``meta`` device (same shapes, dtypes and strides, no storage) after they are
    taken, so the returned trees are the only owners of their memory. Without it the module
    keeps the initial tensors alive for as long as it lives, and once a train step produces
    new parameters that is one extra copy of the model (4 bytes per float32 parameter) for
    the whole run. ``apply_fn`` and every transform are unaffected (they swap the tree's
    tensors in for each call and read only shapes from the module, as for a model built on
    the meta device, docs/LAZY_INIT.md). The module itself is then a shell: calling it
    directly is a RuntimeError naming a released tensor, and its ``state_dict()``,
    ``parameters()`` and tied-weight reads give meta tensors, so use ``release=True`` only
    where nothing reads the module's tensors afterwards (save checkpoints from the state, or
    functionalize without it). The caller must also drop its own references to the initial
    trees (``params``/``buffers`` once ``init_state`` has taken them) for the memory to go.
    Parameter *objects* stay the same (only their ``.data`` changes), so transforms that key
    on them (``shard_params``' rules) see the same module.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"functionalize expects an nn.Module, got {type(module).__name__}")
    params = {k: v.detach() for k, v in module.named_parameters()}
    buffers = {k: v.detach() for k, v in module.named_buffers()}
    param_names, buffer_names = set(params), set(buffers)
    slots = _slots(module)
    modes = [(m, m.training) for m in module.modules()]
    if release:
        _release(module)

    def apply_fn(params: dict[str, Tensor], buffers: dict[str, Tensor], *args, **kwargs):
        if params.keys() != param_names:
            _mismatch("params", param_names, set(params))
        if buffers.keys() != buffer_names:
            _mismatch("buffers", buffer_names, set(buffers))
        # Copies, so that in-place buffer updates land in the returned tree, not the caller's.
        new_buffers = {k: v.clone() for k, v in buffers.items()}
        if torch.compiler.is_compiling():
            # Dynamo knows functional_call's swap; a hand-made one it would trace as
            # mutations of module dicts.
            was = [m.training for m, _ in modes]
            for m, mode in modes:
                m.training = mode
            try:
                out = torch.func.functional_call(
                    module, (params, new_buffers), args, kwargs, tie_weights=True, strict=True
                )
            finally:
                for (m, _), mode in zip(modes, was, strict=True):
                    m.training = mode
            return out, new_buffers
        with _swapped(slots, params, new_buffers, modes):
            out = module(*args, **kwargs)
        return out, new_buffers

    # Transforms (tensor parallel, remat) look at the module's structure through this.
    apply_fn.module = module
    return apply_fn, params, buffers


#: Where each tree leaf goes in the module: ``(owner's _parameters or _buffers dict, attr,
#: tree, key)``, tied aliases included (each gets its canonical name's tensor).
_Slot = tuple[dict, str, bool, str]


def _slots(module: nn.Module) -> list[_Slot]:
    """The swap ``apply_fn`` makes on every call, resolved once: ``functional_call`` walks the
    module tree, builds key sets and checks ties on every call (most of the per-forward Python
    of a small model), although the module's structure does not change between calls."""
    slots = []
    for is_param, named in ((True, module.named_parameters(remove_duplicate=False)),
                            (False, module.named_buffers(remove_duplicate=False))):
        canonical: dict[int, str] = {}
        for name, t in named:
            key = canonical.setdefault(id(t), name)  # a tied alias takes the first name's leaf
            prefix, _, attr = name.rpartition(".")
            owner = module.get_submodule(prefix)
            store = owner._parameters if is_param else owner._buffers
            slots.append((store, attr, is_param, key))
    return slots


@contextlib.contextmanager
def _swapped(slots: list[_Slot], params: dict[str, Tensor], buffers: dict[str, Tensor],
             modes: list[tuple[nn.Module, bool]]) -> Iterator[None]:
    """The trees' tensors in the module's slots and every submodule in its recorded mode for
    the duration of one call; the module's own tensors and modes restored after, whatever
    happens (as ``functional_call`` does)."""
    saved = [store[attr] for store, attr, _, _ in slots]
    flipped = [(m, mode) for m, mode in modes if m.training != mode]
    try:
        for store, attr, is_param, key in slots:
            store[attr] = params[key] if is_param else buffers[key]
        for m, mode in flipped:
            m.training = mode
        yield
    finally:
        for (store, attr, _, _), t in zip(slots, saved, strict=True):
            store[attr] = t
        for m, mode in flipped:
            m.training = not mode


def _release(module: nn.Module) -> None:
    """Move ``module``'s own parameters and buffers to the meta device (see functionalize),
    and make a direct call of the module fail with an error that names one of them."""
    named = [("parameter", n, t) for n, t in module.named_parameters()]
    named += [("buffer", n, t) for n, t in module.named_buffers()]
    for kind, name, t in named:  # each tensor once: tied ones are one object
        if t.is_meta:
            continue
        meta = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=t.requires_grad)
        try:
            # Swaps the contents, not the object: the module, ties between its modules and
            # any reference to the Parameter now see the meta tensor (and its ``.grad``,
            # none), while the tree's detached view keeps the storage.
            torch.utils.swap_tensors(t, meta)
        except RuntimeError as e:
            raise ValueError(f"functionalize(release=True) cannot release the {kind} "
                             f"{name!r}: {e}") from e
    if not named:
        return
    kind, name, _ = named[0]
    prefix, _, attr = name.rpartition(".")
    owner = module.get_submodule(prefix)

    def check(m, args):  # unannotated: the type-check hook would wrap it, and dynamo trace that
        # Inside apply_fn, functional_call has swapped the tree's tensors in: not meta.
        if getattr(owner, attr).is_meta:
            raise RuntimeError(
                f"{type(module).__name__} was functionalized with release=True: its {kind} "
                f"{name!r} (and every other parameter and buffer) is on the meta device. "
                "Call apply_fn(params, buffers, *inputs) instead of the module, or "
                "functionalize(module) without release to keep the module usable")

    module.register_forward_pre_hook(check)


def _mismatch(what: str, expected: set[str], got: set[str]) -> None:
    missing, extra = sorted(expected - got), sorted(got - expected)
    raise KeyError(
        f"{what} do not match the module: missing {missing[:5]}, unexpected {extra[:5]}"
    )
