"""The reference workload: a small causal decoder on a deterministic token stream."""

from accelpact_slurm.workload.data import TokenStream
from accelpact_slurm.workload.model import Block, CausalDecoder, build_model

__all__ = ["Block", "CausalDecoder", "TokenStream", "build_model"]
