"""Example models, laid out the way funcpar's sharding rules expect."""

from funcpar.models.llama import (
    Llama,
    LlamaConfig,
    MoEOutput,
    RMSNorm,
    causal_attention,
    lm_loss,
    moe_lm_loss,
    rotary_cos_sin,
)
from funcpar.models.moe import MoE, MoEStats

__all__ = ["Llama", "LlamaConfig", "MoE", "MoEOutput", "MoEStats", "RMSNorm", "causal_attention",
           "lm_loss", "moe_lm_loss", "rotary_cos_sin"]
