"""Example models, laid out the way funcpar's sharding rules expect."""

from funcpar.models.llama import Llama, LlamaConfig, RMSNorm, lm_loss, rotary_cos_sin

__all__ = ["Llama", "LlamaConfig", "RMSNorm", "lm_loss", "rotary_cos_sin"]
