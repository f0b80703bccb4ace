"""Run by tests/test_pretrain_recipe.py under torchrun (2 processes, gloo): GatheredMuon on FSDP2
shards must give the weights torch.optim.Muon gives on the whole matrices in one process."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from finetune.pretrain.optimizers import GatheredMuon


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 20, bias=False), nn.Tanh(), nn.Linear(20, 6, bias=False)).double()


def main() -> int:
    dist.init_process_group("gloo")
    sharded, reference = model(), model()
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(sharded)
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, adjust_lr_fn="match_rms_adamw")
    ours, theirs = GatheredMuon(sharded.parameters(), **kwargs), torch.optim.Muon(reference.parameters(), **kwargs)
    for step in range(3):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        sharded(x).pow(2).mean().backward()  # same input on both ranks: the averaged gradient is the full one
        reference(x).pow(2).mean().backward()
        ours.step(), theirs.step()
        ours.zero_grad(), theirs.zero_grad()
    for (name, p), q in zip(sharded.named_parameters(), reference.parameters()):
        assert p.to_local().shape[0] < q.shape[0], f"{name} is not sharded"
        torch.testing.assert_close(p.full_tensor(), q, rtol=0, atol=1e-12, msg=name)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
