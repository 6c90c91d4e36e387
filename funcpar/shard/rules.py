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
=======================  ===============================================  ==================

``nn.Linear`` stores ``(out, in)``; Hugging Face's ``Conv1D`` (GPT-2) stores ``(in, out)``: the
split dim follows the module type. A rule may carry ``unit``: the split dim must cut into whole
units (attention heads of ``head_dim`` features), so ``n_units % tp == 0`` is required and
checked before any compute. A rule may carry ``blocks`` for a fused projection (GPT-2's
``c_attn`` computes ``[q | k | v]``, ``blocks=3``): each block is split on its own (a blocked
:class:`~funcpar.shard.layout.Layout`), so every rank gets its heads of q, of k and of v. A model
that cuts such an output by a stored width (GPT-2's ``split_size``) names that attribute with a
:class:`LocalAttr`: inside the sharded forward it holds the local width.

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

from torch import nn

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
    "llama_rules",
    "llama_rules_for",
    "plan_sharding",
]

STYLES = (
    "colwise",
    "rowwise",
    "embedding_rowwise",
    "vocab_parallel",
    "colwise_gather_output",
    "replicate",
    "experts",
)


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
            raise ValueError(f"rule {self.pattern!r}: blocks apply to the 'colwise' style only")
        if self.style == "experts" and self.unit is not None:
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
    kind: str  # "linear", "conv1d", "embedding" or "experts"
    weight_name: str  # the weight's parameter name (a tied weight has its first name; experts:
    # gate_proj's)


@dataclass(frozen=True)
class ShardingPlan:
    """The resolved rules: per module its style, per parameter its layout."""

    mesh: DeviceMesh
    axis: str
    modules: tuple[ModulePlan, ...]
    layouts: dict[str, Layout]  # by parameter name, every parameter
    matched_by: dict[str, str]  # parameter name -> rule pattern (or "(no rule)")
    local_attrs: tuple[tuple[nn.Module, str, int], ...] = ()  # (module, attr, local value)

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
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return "conv1d"
    raise TypeError(f"sharding rule for {name!r}: {type(module).__name__} is not supported "
                    "(nn.Linear, nn.Embedding or transformers' Conv1D)")


def _weight_dims(kind: str, style: str) -> tuple[int | None, int | None]:
    """(weight dim, bias dim) split by ``style`` for a module of ``kind``; None: replicated."""
    out_dim = {"linear": 0, "conv1d": 1, "embedding": 0}[kind]
    in_dim = {"linear": 1, "conv1d": 0, "embedding": None}[kind]
    if style in ("colwise", "colwise_gather_output"):
        return out_dim, 0
    if style == "vocab_parallel":
        return out_dim, 0
    if style == "rowwise":
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
            plans.append(ModulePlan(n, modules[n], rule.style, rule, kind, weight))

    layouts: dict[str, Layout] = {}
    matched_by: dict[str, str] = {}
    for mp in plans:
        if mp.kind == "experts":
            for pname, dim in _EXPERT_DIMS.items():
                full = names[id(getattr(mp.module, pname))]
                shape = tuple(getattr(mp.module, pname).shape)
                if shape[dim] % size:
                    raise ValueError(f"{full!r}: the experts' ffn dim ({dim}) of {shape[dim]} "
                                     f"is not divisible by {axis}={size} (rule "
                                     f"{mp.rule.pattern!r})")
                layouts[full] = Layout(mesh, shape, {axis: Shard(dim)}, name=full)
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
    return ShardingPlan(mesh, axis, tuple(plans), ordered, matched_by, tuple(local_attrs))


#: The stacked experts' leaves and their ffn dim, the one split by the ``experts`` style.
_EXPERT_DIMS = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}


def is_experts(module: nn.Module) -> bool:
    """A stack of experts by shape (:class:`funcpar.models.moe.Experts`, without importing the
    models): 3-dim ``gate_proj``/``up_proj`` ``[E, ffn, dim]`` and ``down_proj`` ``[E, dim,
    ffn]`` parameters."""
    ps = {n: getattr(module, n, None) for n in _EXPERT_DIMS}
    if not all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in ps.values()):
        return False
    g, u, d = (tuple(p.shape) for p in ps.values())
    return g == u and d == (g[0], g[2], g[1])


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


_HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "embedding_rowwise": "embedding_rowwise",
    "colwise_gather_output": "colwise_gather_output",
    "colwise_rep": "colwise_gather_output",
}


def hf_rules(model: nn.Module, *, vocab_parallel_loss: bool = True) -> list[Rule]:
    """Rules from a Hugging Face model's own ``tp_plan`` (heads kept whole via the config).

    Styles funcpar does not implement (sequence-parallel or packed variants) are an error naming
    them. With ``vocab_parallel_loss`` the LM head's ``colwise_gather_output`` becomes
    ``vocab_parallel`` (no logits gather; the loss must be funcpar's cross-entropy).
    """
    plan = getattr(model, "tp_plan", None) or {}
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tp_plan; write rules for it by hand")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rules = []
    for pattern, style in plan.items():
        if style not in _HF_STYLES:
            raise ValueError(f"tp_plan style {style!r} of {pattern!r} is not supported; "
                             f"supported: {sorted(_HF_STYLES)}")
        ours = _HF_STYLES[style]
        if ours == "colwise_gather_output" and vocab_parallel_loss and pattern == "lm_head":
            ours = "vocab_parallel"
        unit = head_dim if re.search(r"(q|k|v|o)_proj$", pattern) else None
        rules.append(Rule(pattern, ours, unit))
    return rules
