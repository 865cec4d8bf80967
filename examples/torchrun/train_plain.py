"""A small next-token model, FSDP2 HSDP on a 2-D mesh (nodes x ranks of a node), AdamW, argparse.

train_plain.py is the plain torchrun script (``torchrun --nproc-per-node 4 train_plain.py --steps 20``); train.py is
the same script protected, 6 lines changed (docs/launch.md shows the diff), and runs both ways:
``accelpact-run --nnodes 2 --nproc-per-node 2 train.py --steps 20`` (protected) and
``torchrun --nproc-per-node 4 train.py --steps 20`` (unprotected: no repair, no snapshots).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from tiny_lm import Tokens, batches, build_model, lm_loss


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="a small next-token model, FSDP2 HSDP")
    p.add_argument("--steps", type=int, default=20, help="optimizer updates")
    p.add_argument("--seed", type=int, default=1234, help="weights, data order, dropout")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and update")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (dist.get_world_size() // local, local), mesh_dim_names=("replicate", "shard"))
    model = build_model(args.seed)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    data = Tokens(args.seed)
    loader = StatefulDataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, seed=args.seed))
    for tokens in batches(loader, args.steps):
        loss = lm_loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
