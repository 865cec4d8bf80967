"""A user's script with a bug in it: the decoder example, whose loss raises on one rank at one update.

``BUGGY_AT=STEP:RANK`` (default ``3:1``): RANK's loss raises ``ValueError`` in update STEP, as a shape bug would.
``BUGGY_IMPORT=raise``: the module raises ``RuntimeError`` while it is imported; ``BUGGY_IMPORT=dependency``: it
imports a package that is not installed.
"""

import os
import sys

if os.environ.get("BUGGY_IMPORT") == "raise":
    raise RuntimeError("the configuration this module reads at import is broken")
if os.environ.get("BUGGY_IMPORT") == "dependency":
    import accelpact_no_such_dependency  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "decoder"))

import train_decoder  # noqa: E402

STEP, RANK = (int(x) for x in os.environ.get("BUGGY_AT", "3:1").split(":"))


def checked_loss(real, job):
    def lm_loss(model, tokens):
        if job.run is not None and job.run.step + 1 == STEP and job.rank == RANK:
            raise ValueError(f"logits and targets disagree in shape at update {STEP}")
        return real(model, tokens)

    return lm_loss


def main(job):
    train_decoder.lm_loss = checked_loss(train_decoder.lm_loss, job)
    train_decoder.main(job)
