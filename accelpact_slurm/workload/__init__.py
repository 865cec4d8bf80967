"""The reference workload: a small causal decoder on a deterministic token stream."""

from .data import TokenStream
from .model import Block, CausalDecoder, build_model

__all__ = ["Block", "CausalDecoder", "TokenStream", "build_model"]
