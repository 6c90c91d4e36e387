"""Sharding rules: module-name patterns -> tensor-parallel styles -> per-leaf layouts.

A rule names modules by a pattern over their dotted names (``*`` matches one name component,
as in Hugging Face's ``tp_plan``: ``"layers.*.self_attn.q_proj"``) and gives them a style:

=======================  ===============================================  ==================
style                    what the module computes on its shard            weight / bias
=======================  ===============================================  ==================
``colwise``              ``x @ W_r^T + b_r``: a slice of the outputs      Shard(out), Shard(0)
``rowwise``              ``sum_r x_r @ W_r^T + b``: partial sums reduced  Shard(in), Replicate
``embedding_rowwise``    vocab-parallel lookup (rows of the table split)  Shard(0)
``vocab_parallel``       the LM head's logits for a vocabulary slice;     Shard(out)
                         the loss is computed vocab-parallel, no gather
``colwise_gather_output`` column split, logits all-gathered (any loss)    Shard(out), Shard(0)
``replicate``            whole on every rank                              Replicate
``experts``              stacked SwiGLU experts (MoE), each rank an ffn   gate/up Shard(1),
                         slice of every expert; input entered once,       down Shard(2)
                         partial outputs summed once (Megatron's MLP)
``rowwise_split_input``  the input is whole (replicated): each rank takes  Shard(in), Replicate
                         its slice of the last dim (backward: the slices'
                         gradients all-gathered), then as ``rowwise``
``grad_sum``             whole parameters acting on this rank's heads      Replicate
                         only (Qwen3's q/k norms): the gradients are
                         partial, summed over the axis after the backward
``packed_experts``       Hugging Face's stacked experts (transformers 5:   gate_up Shard(1) in
                         ``gate_up_proj [E, 2 ffn, dim]`` = [gate; up],    2 blocks, down
                         ``down_proj [E, dim, ffn]``): an ffn slice of     Shard(2)
                         every expert's gate and of its up; the input and
                         the routing weights entered, the output summed
=======================  ===============================================  ==================

``nn.Linear`` stores ``(out, in)``; Hugging Face's ``Conv1D`` (GPT-2) stores ``(in, out)``: the
split dim follows the module type. A rule may carry ``unit``: the split dim must cut into whole
units (attention heads of ``head_dim`` features), so ``n_units % tp == 0`` is required and
checked before any compute. A rule may carry ``blocks`` for a fused projection (GPT-2's
``c_attn`` computes ``[q | k | v]``, ``blocks=3``): each block is split on its own (a blocked
:class:`~funcpar.shard.layout.Layout`), so every rank gets its heads of q, of k and of v. A model
that cuts such an output by a stored width (GPT-2's ``split_size``) names that attribute with a
:class:`LocalAttr`: inside the sharded forward it holds the local width.

An ``nn.Embedding`` or ``nn.Linear`` whose class overrides ``forward`` is refused (the sharded
forward replaces the module's, so whatever the override adds would be lost), except an
embedding that scales its lookup by an ``embed_scale`` attribute (Gemma's
``GemmaTextScaledWordEmbedding``, BART's ``BartScaledWordEmbedding``:
``lookup(ids) * embed_scale``): the vocab-parallel lookup is scaled the same way, and when the
weights are real (not meta) a probe of a few ids checks the module computes exactly that.

The ``experts`` style applies to :class:`funcpar.models.moe.Experts` (``gate_proj``/``up_proj``
``[E, ffn, dim]``, ``down_proj`` ``[E, dim, ffn]``): each expert is split as the dense MLP is,
``ffn`` over the axis, which must divide it; the MoE's router is left replicated (no rule).
``expert_parallel`` then cuts the expert dim over ``ep`` on top: ``{ep: Shard(0), tp: Shard(1)}``.

Leaves matched by no rule are replicated; a rule that matches no
module is an error (a typo would otherwise silently replicate everything).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcpar.shard.layout import Layout, Shard
from funcpar.shard.mesh import DeviceMesh

__all__ = [
    "STYLES",
    "LocalAttr",
    "ModulePlan",
    "Rule",
    "ShardingPlan",
    "bert_rules",
    "gpt2_rules",
    "hf_rules",
    "is_experts",
    "is_packed_experts",
    "llama_rules",
    "llama_rules_for",
    "plan_sharding",
    "scale_embedding",
]

STYLES = (
    "colwise",
    "rowwise",
    "embedding_rowwise",
    "vocab_parallel",
    "colwise_gather_output",
    "replicate",
    "experts",
    "rowwise_split_input",
    "grad_sum",
    "packed_experts",
)

#: Styles whose module may be of any type: they read or change no weight layout of their own
#: (``grad_sum``) or a stack of experts recognised by its parameters.
_ANY_MODULE = ("grad_sum", "experts", "packed_experts")


@dataclass(frozen=True)
class Rule:
    pattern: str
    style: str
    unit: int | None = None  # the split dim must cut into whole units of this many entries
    blocks: int = 1  # the split dim is this many equal blocks, each split on its own (fused qkv)

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"rule {self.pattern!r}: unknown style {self.style!r}; "
                             f"one of {STYLES}")
        if self.unit is not None and self.unit <= 0:
            raise ValueError(f"rule {self.pattern!r}: unit must be > 0, got {self.unit}")
        if self.blocks < 1:
            raise ValueError(f"rule {self.pattern!r}: blocks must be >= 1, got {self.blocks}")
        if self.blocks > 1 and self.style != "colwise":
            # (a gathered output would come back rank-major, not block-major)
            raise ValueError(f"rule {self.pattern!r}: blocks apply to the 'colwise' style only")
        if self.style in _ANY_MODULE and self.unit is not None:
            raise ValueError(f"rule {self.pattern!r}: unit does not apply to the 'experts' style "
                             "(the ffn dim is split evenly)")

    def matches(self, name: str) -> bool:
        return _matches(self.pattern, name)


@dataclass(frozen=True)
class LocalAttr:
    """An int attribute of the matched modules that counts features of a split dim (GPT-2
    attention's ``split_size``): divided by the axis size inside the sharded forward."""

    pattern: str
    attr: str

    def matches(self, name: str) -> bool:
        return _matches(self.pattern, name)


def _matches(pattern: str, name: str) -> bool:
    regex = "".join("[^.]+" if part == "*" else re.escape(part)
                    for part in re.split(r"(\*)", pattern))
    return re.fullmatch(regex, name) is not None


@dataclass(frozen=True)
class ModulePlan:
    name: str
    module: nn.Module
    style: str
    rule: Rule
    kind: str  # "linear", "conv1d", "embedding", "experts", "packed_experts" or "params"
    weight_name: str | None  # the weight's parameter name (a tied weight has its first name;
    # experts: gate_proj's, packed experts: gate_up_proj's; None for grad_sum)
    embed_scale: bool = False  # an embedding whose own forward scales the lookup by embed_scale


@dataclass(frozen=True)
class ShardingPlan:
    """The resolved rules: per module its style, per parameter its layout."""

    mesh: DeviceMesh
    axis: str
    modules: tuple[ModulePlan, ...]
    layouts: dict[str, Layout]  # by parameter name, every parameter
    matched_by: dict[str, str]  # parameter name -> rule pattern (or "(no rule)")
    local_attrs: tuple[tuple[nn.Module, str, int], ...] = ()  # (module, attr, local value)
    grad_sum: tuple[str, ...] = ()  # the grad_sum modules' parameters: whole, partial grads

    @property
    def vocab_parallel_head(self) -> ModulePlan | None:
        return next((m for m in self.modules if m.style == "vocab_parallel"), None)

    def report(self) -> str:
        """Which rule matched which leaf, and the leaf's layout."""
        width = max((len(n) for n in self.layouts), default=4)
        lines = [f"{'leaf'.ljust(width)}  rule -> layout"]
        for name, lay in self.layouts.items():
            lines.append(f"{name.ljust(width)}  {self.matched_by[name]} -> {lay!r}")
        return "\n".join(lines)


def _kind(name: str, module: nn.Module) -> str:
    for base, kind in ((nn.Linear, "linear"), (nn.Embedding, "embedding")):
        if isinstance(module, base):
            if type(module).forward is not base.forward and not (
                    kind == "embedding" and hasattr(module, "embed_scale")):
                raise TypeError(
                    f"sharding rule for {name!r}: {type(module).__qualname__} overrides "
                    f"{base.__name__}.forward, which the sharded forward would replace (losing "
                    "what the override adds); write the rule for a plain module, or leave it "
                    "unsharded")
            return kind
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return "conv1d"
    raise TypeError(f"sharding rule for {name!r}: {type(module).__name__} is not supported "
                    "(nn.Linear, nn.Embedding or transformers' Conv1D)")


def _scaled_embedding(name: str, module: nn.Embedding) -> bool:
    """Whether ``module`` is an embedding whose forward is ``lookup(ids) * embed_scale``
    (Gemma's, BART's), checked on a few ids when its weight is real; else a ValueError."""
    if type(module).forward is nn.Embedding.forward:
        return False
    w = module.weight
    if w.is_meta or w.numel() == 0:
        return True  # nothing to probe (lazy init): the shape of the class is all we have
    ids = torch.arange(min(w.shape[0], 4), device=w.device)
    with torch.no_grad():
        got = module(ids)
        want = _scale(F.embedding(ids, w, module.padding_idx), module)
    if got.shape != want.shape or not torch.equal(got, want):
        raise ValueError(
            f"{name!r}: {type(module).__qualname__} overrides nn.Embedding.forward and has an "
            "embed_scale, but its output is not lookup(ids) * embed_scale; funcpar's "
            "vocab-parallel lookup cannot reproduce it: leave it unsharded")
    return True


def _scale(out: Tensor, module: nn.Module) -> Tensor:
    """``out * module.embed_scale`` as Gemma computes it (a tensor scale cast to the weight's
    dtype first, so bf16 training rounds it as the model does)."""
    s = module.embed_scale
    return out * (s.to(module.weight.dtype) if torch.is_tensor(s) else s)


def scale_embedding(out: Tensor, mp: ModulePlan) -> Tensor:
    """The lookup ``out`` of ``mp``'s embedding as its own forward returns it (scaled by its
    ``embed_scale`` when it has one, :func:`_scaled_embedding`)."""
    return _scale(out, mp.module) if mp.embed_scale else out


def _weight_dims(kind: str, style: str) -> tuple[int | None, int | None]:
    """(weight dim, bias dim) split by ``style`` for a module of ``kind``; None: replicated."""
    out_dim = {"linear": 0, "conv1d": 1, "embedding": 0}[kind]
    in_dim = {"linear": 1, "conv1d": 0, "embedding": None}[kind]
    if style in ("colwise", "colwise_gather_output", "vocab_parallel"):
        return out_dim, 0
    if style in ("rowwise", "rowwise_split_input"):
        return in_dim, None
    if style == "embedding_rowwise":
        return 0, None
    return None, None


def plan_sharding(
    module: nn.Module, rules: Sequence[Rule | LocalAttr], mesh: DeviceMesh, axis: str = "tp"
) -> ShardingPlan:
    """Resolve ``rules`` against ``module``: a style per matched module, a layout per parameter.

    Errors, all before any compute: a rule matching no module, a module matched by two rules,
    an unsupported module type or style/type pair, a dim shorter than the axis, a split that
    does not cut whole units (heads), and a tied parameter given two different layouts.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has no axis {axis!r}: its axes are {mesh.axis_names}")
    size = mesh.size(axis)
    modules = dict(module.named_modules())
    # Parameters by identity, so a tied weight (embedding = LM head) is seen once.
    names = {id(p): n for n, p in module.named_parameters()}
    plans: list[ModulePlan] = []
    local_attrs: list[tuple[nn.Module, str, int]] = []
    used = set()
    for rule in rules:
        hits = [n for n in modules if n and rule.matches(n)]
        if isinstance(rule, LocalAttr):
            local_attrs += _local_attrs(rule, hits, modules, size, axis)
            continue
        if not hits:
            hint = (": the model has no MoE experts there (funcpar.models.moe.Experts; "
                    "LlamaConfig.n_experts > 0)" if rule.style == "experts" else "")
            raise ValueError(f"sharding rule {rule.pattern!r} ({rule.style}) matches no "
                             f"module{hint}")
        for n in hits:
            if n in used:
                raise ValueError(f"module {n!r} is matched by more than one rule")
            used.add(n)
            if rule.style == "replicate":
                continue
            if rule.style == "grad_sum":
                plans.append(ModulePlan(n, modules[n], "grad_sum", rule, "params", None))
                continue
            if rule.style == "packed_experts":
                plans.append(_packed_experts_plan(n, modules[n], rule, names))
                continue
            if rule.style == "experts" or is_experts(modules[n]):
                plans.append(_experts_plan(n, modules[n], rule, names))
                continue
            kind = _kind(n, modules[n])
            if (kind == "embedding") != (rule.style == "embedding_rowwise"):
                raise ValueError(f"rule {rule.pattern!r}: style {rule.style!r} does not apply to "
                                 f"{n!r} ({type(modules[n]).__name__})")
            if kind == "embedding" and (modules[n].max_norm or modules[n].scale_grad_by_freq
                                        or modules[n].sparse):
                raise ValueError(f"{n!r}: vocab-parallel embedding supports neither max_norm, "
                                 "scale_grad_by_freq nor sparse")
            weight = names[id(modules[n].weight)]
            scaled = kind == "embedding" and _scaled_embedding(n, modules[n])
            plans.append(ModulePlan(n, modules[n], rule.style, rule, kind, weight, scaled))

    layouts: dict[str, Layout] = {}
    matched_by: dict[str, str] = {}
    grad_sum: list[str] = []
    for mp in plans:
        if mp.kind == "params":
            for p in mp.module.parameters():
                full = names[id(p)]
                if full in matched_by:
                    raise ValueError(f"{full!r} (of {mp.name!r}, style grad_sum) is also "
                                     f"matched by rule {matched_by[full]!r}")
                layouts[full] = Layout(mesh, tuple(p.shape), None, name=full)
                matched_by[full] = mp.rule.pattern
                grad_sum.append(full)
            continue
        if mp.kind in ("experts", "packed_experts"):
            # [E, ffn, dim] / [E, dim, ffn]; the packed [E, 2 ffn, dim] is cut per half.
            dims = _EXPERT_DIMS if mp.kind == "experts" else _PACKED_EXPERT_DIMS
            for pname, (dim, k) in dims.items():
                full = names[id(getattr(mp.module, pname))]
                shape = tuple(getattr(mp.module, pname).shape)
                if (shape[dim] // k) % size:
                    raise ValueError(f"{full!r}: the experts' ffn dim ({dim}) of "
                                     f"{shape[dim] // k} is not divisible by {axis}={size} "
                                     f"(rule {mp.rule.pattern!r})")
                layouts[full] = Layout(mesh, shape, {axis: Shard(dim)}, blocks={dim: k},
                                       name=full)
                matched_by[full] = mp.rule.pattern
            continue
        wdim, bdim = _weight_dims(mp.kind, mp.style)
        for pname, dim in (("weight", wdim), ("bias", bdim)):
            p = getattr(mp.module, pname, None)
            if p is None or id(p) not in names:
                continue
            full = names[id(p)]
            shape = tuple(p.shape)
            if dim is None:
                lay = Layout(mesh, shape, None, name=full)
            else:
                k = mp.rule.blocks
                if shape[dim] % k:
                    raise ValueError(f"{full!r}: dim {dim} of {shape[dim]} is not {k} equal "
                                     f"blocks (rule {mp.rule.pattern!r})")
                _check_split(full, shape[dim] // k, size, mp.rule, axis)
                lay = Layout(mesh, shape, {axis: Shard(dim)}, blocks={dim: k}, name=full)
            if full in layouts and layouts[full] != lay:
                raise ValueError(f"{full!r} is tied between modules given different layouts "
                                 f"({layouts[full]!r} and {lay!r})")
            layouts[full] = lay
            matched_by[full] = mp.rule.pattern
    for n, p in module.named_parameters():
        if n not in layouts:
            layouts[n] = Layout(mesh, tuple(p.shape), None, name=n)
            matched_by[n] = "(no rule)"
    ordered = {n: layouts[n] for n, _ in module.named_parameters()}
    return ShardingPlan(mesh, axis, tuple(plans), ordered, matched_by, tuple(local_attrs),
                        tuple(grad_sum))


#: The stacked experts' leaves, their ffn dim (the one split by the ``experts`` style) and its
#: number of blocks.
_EXPERT_DIMS = {"gate_proj": (1, 1), "up_proj": (1, 1), "down_proj": (2, 1)}
#: Hugging Face's (transformers 5) packed experts: gate_up_proj [E, 2 ffn, dim] is [gate; up]
#: on dim 1, split per half (each rank: its ffn slice of gate, then of up).
_PACKED_EXPERT_DIMS = {"gate_up_proj": (1, 2), "down_proj": (2, 1)}


def is_experts(module: nn.Module) -> bool:
    """A stack of experts by shape (:class:`funcpar.models.moe.Experts`, without importing the
    models): 3-dim ``gate_proj``/``up_proj`` ``[E, ffn, dim]`` and ``down_proj`` ``[E, dim,
    ffn]`` parameters."""
    ps = {n: getattr(module, n, None) for n in _EXPERT_DIMS}
    if not all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in ps.values()):
        return False
    g, u, d = (tuple(p.shape) for p in ps.values())
    return g == u and d == (g[0], g[2], g[1])


def is_packed_experts(module: nn.Module) -> bool:
    """Hugging Face's stacked experts (transformers 5) by shape: 3-dim ``gate_up_proj``
    ``[E, 2 ffn, dim]`` (gate and up concatenated, not interleaved or transposed) and
    ``down_proj`` ``[E, dim, ffn]``, no biases."""
    gu, d = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(d, nn.Parameter)
            and gu.dim() == 3 and d.dim() == 3):
        return False
    if (getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True)
            or getattr(module, "has_bias", False)):
        return False
    e, two_f, dim = gu.shape
    return two_f % 2 == 0 and tuple(d.shape) == (e, dim, two_f // 2)


def _packed_experts_plan(name: str, module: nn.Module, rule: Rule,
                         names: dict[int, str]) -> ModulePlan:
    if not is_packed_experts(module):
        raise ValueError(
            f"rule {rule.pattern!r}: style 'packed_experts' applies to Hugging Face's stacked "
            "experts (gate_up_proj [E, 2 ffn, dim] = [gate; up], down_proj [E, dim, ffn], not "
            f"transposed, no biases), not to {name!r} ({type(module).__name__})")
    extra = sorted(n for n, _ in module.named_parameters() if n not in _PACKED_EXPERT_DIMS)
    if extra:
        raise ValueError(f"rule {rule.pattern!r}: the experts {name!r} hold parameters "
                         f"{extra} besides gate_up_proj and down_proj, which the style "
                         "'packed_experts' does not split")
    return ModulePlan(name, module, "packed_experts", rule, "packed_experts",
                      names[id(module.gate_up_proj)])


def _experts_plan(name: str, module: nn.Module, rule: Rule,
                  names: dict[int, str]) -> ModulePlan:
    if not is_experts(module):
        raise ValueError(f"rule {rule.pattern!r}: style 'experts' applies to stacked MoE "
                         f"experts (funcpar.models.moe.Experts: gate_proj/up_proj [E, ffn, dim], "
                         f"down_proj [E, dim, ffn]), not to {name!r} ({type(module).__name__})")
    if rule.style != "experts":
        raise ValueError(f"rule {rule.pattern!r}: {name!r} is a stack of MoE experts; its style "
                         f"must be 'experts' (or 'replicate'), not {rule.style!r}")
    return ModulePlan(name, module, "experts", rule, "experts", names[id(module.gate_proj)])


def _local_attrs(rule: LocalAttr, hits: list[str], modules: dict[str, nn.Module], size: int,
                 axis: str) -> list[tuple[nn.Module, str, int]]:
    if not hits:
        raise ValueError(f"sharding rule LocalAttr({rule.pattern!r}, {rule.attr!r}) matches no "
                         "module")
    out = []
    for n in hits:
        value = getattr(modules[n], rule.attr, None)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{n!r} has no int attribute {rule.attr!r} (got {value!r})")
        if value % size:
            raise ValueError(f"{n!r}.{rule.attr} = {value} does not divide by {axis}={size}")
        out.append((modules[n], rule.attr, value // size))
    return out


def _check_split(name: str, n: int, size: int, rule: Rule, axis: str) -> None:
    if n < size:
        raise ValueError(f"{name!r}: cannot split a dim of {n} over {axis}={size}")
    if rule.unit is not None:
        if n % rule.unit:
            raise ValueError(f"{name!r}: dim {n} is not a whole number of units of {rule.unit}")
        units = n // rule.unit
        if units % size:
            raise ValueError(f"{name!r}: {axis} size {size} does not divide the number of "
                             f"heads {units} (rule {rule.pattern!r})")


def llama_rules(head_dim: int, *, prefix: str = "", vocab_parallel_loss: bool = True,
                embedding: bool = True, dense_mlp: bool = True,
                experts: bool = False) -> list[Rule]:
    """Rules for :class:`funcpar.models.Llama` (and, with ``prefix="model."``, the decoder of
    Hugging Face's ``LlamaForCausalLM``): attention and MLP input projections column-split,
    output projections row-split (heads kept whole), embedding and LM head split on the vocab.
    With ``vocab_parallel_loss`` the head's logits stay split and the loss is computed
    vocab-parallel; otherwise they are gathered.

    Mixture of Experts: ``experts`` adds the style ``"experts"`` for the MoE blocks' stacked
    experts (``layers.*.mlp.experts``; the router stays replicated); ``dense_mlp=False`` drops
    the dense MLP rules, for a model whose every block is MoE (a rule matching nothing is an
    error). :func:`llama_rules_for` sets both from a config."""
    p = prefix
    rules = [
        Rule(f"{p}layers.*.self_attn.q_proj", "colwise", head_dim),
        Rule(f"{p}layers.*.self_attn.k_proj", "colwise", head_dim),
        Rule(f"{p}layers.*.self_attn.v_proj", "colwise", head_dim),
        Rule(f"{p}layers.*.self_attn.o_proj", "rowwise", head_dim),
    ]
    if dense_mlp:
        rules += [
            Rule(f"{p}layers.*.mlp.gate_proj", "colwise"),
            Rule(f"{p}layers.*.mlp.up_proj", "colwise"),
            Rule(f"{p}layers.*.mlp.down_proj", "rowwise"),
        ]
    if experts:
        rules.append(Rule(f"{p}layers.*.mlp.experts", "experts"))
    rules.append(Rule("lm_head", "vocab_parallel" if vocab_parallel_loss
                      else "colwise_gather_output"))
    if embedding:
        rules.append(Rule(f"{p}embed_tokens", "embedding_rowwise"))
    return rules


def llama_rules_for(cfg: Any, **kwargs: Any) -> list[Rule]:
    """:func:`llama_rules` for a :class:`funcpar.models.LlamaConfig`: the dense MLP rules when
    some block is dense, the experts rule when some block is MoE (``kwargs``: the other
    arguments of :func:`llama_rules`)."""
    blocks = range(cfg.n_layers)
    return llama_rules(cfg.head_dim, dense_mlp=not all(cfg.is_moe(i) for i in blocks),
                       experts=any(cfg.is_moe(i) for i in blocks), **kwargs)


def gpt2_rules(head_dim: int, *, prefix: str = "transformer.",
               vocab_parallel_loss: bool = True) -> list[Rule | LocalAttr]:
    """Rules for Hugging Face's ``GPT2LMHeadModel`` (``prefix=""`` for ``GPT2Model``).

    The fused ``c_attn`` (``Conv1D`` storing ``(in, 3 * embed)``) is column-split per block of
    q, k and v, with the attention's ``split_size`` made local; ``c_proj`` and the MLP's
    ``c_proj`` are row-split, ``c_fc`` column-split; the token embedding and the LM head tied to
    it are vocab-split. Position embeddings and layer norms are replicated.
    """
    p = prefix
    rules: list[Rule | LocalAttr] = [
        Rule(f"{p}h.*.attn.c_attn", "colwise", head_dim, blocks=3),
        LocalAttr(f"{p}h.*.attn", "split_size"),
        Rule(f"{p}h.*.attn.c_proj", "rowwise", head_dim),
        Rule(f"{p}h.*.mlp.c_fc", "colwise"),
        Rule(f"{p}h.*.mlp.c_proj", "rowwise"),
        Rule(f"{p}wte", "embedding_rowwise"),
    ]
    if p:
        rules.append(Rule("lm_head", "vocab_parallel" if vocab_parallel_loss
                          else "colwise_gather_output"))
    return rules


def bert_rules(head_dim: int, *, prefix: str = "bert.", mlm_head: bool = True,
               vocab_parallel_loss: bool = True) -> list[Rule]:
    """Rules for Hugging Face's ``BertForMaskedLM`` (``prefix=""``, ``mlm_head=False`` for
    ``BertModel``): query/key/value and the intermediate dense column-split, the attention and
    layer output dense row-split, word embeddings and the MLM decoder (tied to them) vocab-split.
    Position and token-type embeddings, layer norms, the pooler and the MLM transform are
    replicated."""
    p = prefix
    layer = f"{p}encoder.layer.*"
    rules = [
        Rule(f"{layer}.attention.self.query", "colwise", head_dim),
        Rule(f"{layer}.attention.self.key", "colwise", head_dim),
        Rule(f"{layer}.attention.self.value", "colwise", head_dim),
        Rule(f"{layer}.attention.output.dense", "rowwise", head_dim),
        Rule(f"{layer}.intermediate.dense", "colwise"),
        Rule(f"{layer}.output.dense", "rowwise"),
        Rule(f"{p}embeddings.word_embeddings", "embedding_rowwise"),
    ]
    if mlm_head:
        rules.append(Rule("cls.predictions.decoder", "vocab_parallel" if vocab_parallel_loss
                          else "colwise_gather_output"))
    return rules


def hf_rules(model: nn.Module, *, vocab_parallel_loss: bool = True) -> list[Rule | LocalAttr]:
    """Rules for a Hugging Face model: :func:`funcpar.shard.hf_plan.hf_rules` (its own
    ``tp_plan`` mapped style by style, funcpar's rules for some families without one, or a
    refusal naming the style, the module and the reason)."""
    from funcpar.shard.hf_plan import hf_rules as from_plan

    return from_plan(model, vocab_parallel_loss=vocab_parallel_loss)
