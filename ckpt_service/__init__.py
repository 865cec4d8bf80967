"""The checkpoint service: one daemon per node per job and the client inside each rank.

Modules, one concern each:

- :mod:`.layout`     where things live (node directory, socket, shared-memory staging, step names)
- :mod:`.protocol`   JSON-lines messages over the daemon's Unix socket, peer-credential check
- :mod:`.staging`    the shared-memory format a rank stages its shards in
- :mod:`.dcp_write`  the node's staged boxes as DCP chunks (no reassembly), DCP write, manifest, atomic commit
- :mod:`.sink`       the write fast path: files past the page cache, large boxes from the slot, hashed as written
- :mod:`.writecheck` what the writer checks before the commit: capture proofs, file sizes, digests from the disk
- :mod:`.compat`     every private torch and DCP name the package touches
- :mod:`.verify`     checksums, metadata coverage, replay in a fresh process
- :mod:`.retention`  pure: which snapshots to delete (node directory, shared tier), the newest common step
- :mod:`.index`      pure selection + state records + the login-node index
- :mod:`.tiers`      which snapshots go to the shared tier (once per job), the atomic copy, the tier's retention
- :mod:`.daemon`     ``accelpact-ckptd``
- :mod:`.client`     the rank side: stage, hand over, restore
- :mod:`.export`     ``accelpact-ckpt export``: a verified snapshot as one torch.save or safetensors file
- :mod:`.safetensors_file` the safetensors format, written without the safetensors package
- :mod:`.faults`     fault-injection points for the kill -9 tests

The login-node modules (layout, protocol, retention, index) never import torch.
"""

from ckpt_service.layout import STEP_PREFIX, step_dirname, step_of

__all__ = ["STEP_PREFIX", "step_dirname", "step_of"]
