"""The reference loss of a snapshot: the fixed-batch loss of the staged weights, computed in the daemon.

The replay check (:mod:`accelpact_slurm.workload.replay`, in a fresh process) later loads the
written files and must reproduce this loss bitwise, so it proves the write path (boxes, DCP chunks,
disk). The capture path (which boxes of which flat parameter) is proved separately: on the first
snapshot of every start the ranks also send the live model's loss, and :func:`writer.write_snapshot`
refuses a snapshot whose staged state does not reproduce it. Training ranks thus pay for one
fixed-batch forward per start instead of one per snapshot.

The model is built once per configuration and kept; per snapshot the staged boxes are copied into
its parameters (the weights only, about a third of the state) and one forward pass runs with the
ranks' thread count, in eval mode, on the batch :meth:`TokenStream.fixed_batch` gives.
"""

from __future__ import annotations

from typing import Any


class ReferenceModel:
    def __init__(self) -> None:
        self._digest: str | None = None
        self._model: Any = None

    def __call__(self, meta: dict[str, Any], tensors: dict[tuple[str, ...], Any]) -> float:
        import torch

        from accelpact_slurm.core.config import from_dict
        from accelpact_slurm.workload.data import TokenStream
        from accelpact_slurm.workload.model import build_model
        from accelpact_slurm.workload.trainer import lm_loss

        cfg = from_dict(meta["config"])
        if self._digest != meta.get("config_digest") or self._model is None:
            self._model = build_model(cfg.model, cfg.seed)
            self._digest = meta.get("config_digest")
        model = self._model
        torch.set_num_threads(cfg.train.threads_per_rank)
        params = dict(model.state_dict(keep_vars=True))
        staged = {key[1]: ct for key, ct in tensors.items() if len(key) == 2 and key[0] == "model"}
        missing = sorted(set(params) - set(staged))
        if missing:
            raise KeyError(f"the snapshot holds no staged values for {missing[:5]}")
        with torch.no_grad():
            for fqn, ct in staged.items():
                dst = params[fqn].data
                if list(dst.shape) != list(ct.shape):
                    raise ValueError(f"{fqn}: staged shape {list(ct.shape)}, model shape {list(dst.shape)}")
                for offsets, chunk in ct.chunks:
                    dst[tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape))].copy_(chunk)
        tokens = TokenStream(cfg.model.vocab, cfg.model.seq_len, cfg.seed).fixed_batch(meta["eval"]["batch_size"])
        model.eval()
        with torch.no_grad():
            return float(lm_loss(model, tokens))
