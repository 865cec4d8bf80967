"""``python -m accelpact_slurm.workload.replay CKPT_DIR``: the replay check, in a fresh process.

Builds the model from the configuration recorded in the snapshot's manifest,
loads the weights with stock ``dcp.load`` (no process group), computes the loss
on the recorded fixed batch in eval mode and compares it bitwise with the loss
recorded at save time.  Exit 0 on a match, 1 on a mismatch, 2 when it cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence


def replay_loss(path: str) -> tuple[float, dict]:
    import torch
    import torch.distributed.checkpoint as dcp

    from accelpact_slurm.core.config import from_dict
    from accelpact_slurm.workload.data import TokenStream
    from accelpact_slurm.workload.model import build_model
    from accelpact_slurm.workload.trainer import lm_loss

    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as fh:
        manifest = json.load(fh)
    cfg = from_dict(manifest["config"])
    torch.set_num_threads(cfg.train.threads_per_rank)
    model = build_model(cfg.model, cfg.seed)
    sd = {"model": model.state_dict()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    model.load_state_dict(sd["model"])
    ev = manifest["eval"]
    tokens = TokenStream(cfg.model.vocab, cfg.model.seq_len, cfg.seed).fixed_batch(ev["batch_size"])
    model.eval()
    with torch.no_grad():
        return float(lm_loss(model, tokens)), manifest


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m accelpact_slurm.workload.replay", description=__doc__.split("\n")[0])
    p.add_argument("path", metavar="CKPT_DIR")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    try:
        loss, manifest = replay_loss(args.path)
    except Exception as exc:
        out = {"match": False, "reason": f"replay could not load: {exc.__class__.__name__}: {exc}"[:400]}
        print(json.dumps(out) if args.json else out["reason"])
        return 2
    want = manifest["eval"]["loss"]
    match = loss == want
    reason = (f"replay loss {loss!r} equals the recorded {want!r} bitwise" if match
              else f"replay loss {loss!r} differs from the recorded {want!r}")
    out = {"match": match, "loss": loss, "recorded": want, "step": manifest["step"], "reason": reason}
    print(json.dumps(out) if args.json else reason)
    return 0 if match else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
