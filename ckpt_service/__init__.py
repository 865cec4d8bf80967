"""The checkpoint service: one daemon per node per job and the client inside each rank.

README's Layout names each module and its one concern.  The login-node modules (layout, protocol, retention,
index) never import torch.
"""

from ckpt_service.layout import STEP_PREFIX, step_dirname, step_of

__all__ = ["STEP_PREFIX", "step_dirname", "step_of"]
