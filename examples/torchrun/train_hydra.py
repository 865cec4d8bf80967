"""The torchrun example configured with Hydra: FSDP2 HSDP on a 2-D mesh (nodes x ranks of a node), AdamW.

train_hydra_plain.py is the plain torchrun script (``torchrun --nproc-per-node 4 train_hydra_plain.py steps=20``),
its settings in ``conf/config.yaml``, overridden by ``key=value`` arguments after the script's path (every rank runs
the decorated ``main`` with the same configuration).  train_hydra.py is the same script protected, 6 lines changed
(docs/launch.md shows the diff), and runs both ways: ``accelpact-run --nnodes 2 --nproc-per-node 2 train_hydra.py
steps=20`` (protected; the job's steps and seed are the config's, through ``accelpact_slurm.init``) and ``torchrun
--nproc-per-node 4 train_hydra.py steps=20`` (unprotected: no repair, no snapshots).  The model and data are the
argparse example's (tiny_lm.py).
"""

import os

import hydra
import torch
import accelpact_slurm
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from tiny_lm import Tokens, batches, build_model, lm_loss


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    job = accelpact_slurm.init(steps=cfg.steps, seed=cfg.seed)
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (dist.get_world_size() // local, local), mesh_dim_names=("replicate", "shard"))
    model = build_model(cfg.seed, vocab=cfg.model.vocab, width=cfg.model.width, layers=cfg.model.layers)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, foreach=False)
    data = Tokens(cfg.seed, vocab=cfg.model.vocab, length=cfg.data.length, size=cfg.data.size)
    loader = StatefulDataLoader(data, batch_size=cfg.batch, sampler=DistributedSampler(data, seed=cfg.seed))
    run = job.protect(model, opt, state={"data": loader})
    for tokens in run.batches(loader):
        with run.update() as update:
            loss = lm_loss(model, tokens)
            loss.backward()
            update.loss = loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    if dist.get_rank() == 0:
        print(f"trained {cfg.steps} updates; rank 0's last loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
