"""Run by tests/test_pretrain_recipe.py under torchrun (2 processes, gloo): GatheredMuon on FSDP2
shards must give the weights torch.optim.Muon gives on the whole matrices in one process.

Teardown: FSDP2's modules and their DTensors sit in reference cycles that hold the gloo process
group, so returning from ``main`` left the group to the interpreter's final garbage collection. A
gloo thread then asked for the GIL during finalisation and Python 3.11 ended that thread with a
forced unwind through a noexcept frame: ``terminate called without an active exception`` (SIGABRT),
after the checks had passed, in 9 of 40 runs here (gdb: ``pt_gloo_runloop`` unwinding while the
main thread ran ``Py_FinalizeEx``'s collection). Freeing them and collecting before
``destroy_process_group`` ends the group while the interpreter is alive: 0 of 40."""

import gc
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
    del sharded, ours
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
