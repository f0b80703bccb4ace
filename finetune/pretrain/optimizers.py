"""AdamW, or Muon for the hidden matrices with AdamW for the rest, as the report's recipe has it.

Muon (torch's ``torch.optim.Muon``: Nesterov momentum, Newton-Schulz orthogonalisation, update RMS
matched to AdamW's so one learning rate serves both) takes every 2-D weight of a linear layer
except the first and last ones (``img_in``, ``final_layer``) and the timestep embedding. AdamW
takes those, every 1-D parameter (biases, norm scales) and the modulation tables. Weight decay
applies to matrices and, with ``norm_weight_decay``, to the zero-centred RMSNorm scales (which
decays them towards a scale of 1); never to biases or modulation tables.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from krea2_diffusers.models.layers import RMSNorm

from .config import PretrainOptimizerConfig

logger = logging.getLogger("finetune")


# torch.optim.Muon's two steps, as torch 2.13 writes them in its private torch.optim._muon (BSD
# licence): the gathered variant below must give torch's update bit for bit (tested), and a private
# module may change without notice.
def newton_schulz(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float) -> torch.Tensor:
    """Quintic Newton-Schulz orthogonalisation of a 2-D ``grad`` (in bf16), as torch's Muon."""
    a, b, c = ns_coefficients
    ortho_grad = grad.bfloat16()
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def muon_lr(lr: float, adjust_lr_fn: str | None, param_shape: torch.Size) -> float:
    """torch's Muon learning-rate adjustment for a (A, B) matrix."""
    rows, cols = param_shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio

# First and last layers and the timestep embedding stay on AdamW (the report: Muon only beat AdamW
# once the first and last linear layers were excluded).
ADAMW_ONLY = re.compile(r"^(img_in|final_layer|time_embed|text_fusion\.projector)\.")


@dataclass
class ParameterSplit:
    muon: list[tuple[str, nn.Parameter]]
    adamw_decay: list[tuple[str, nn.Parameter]]
    adamw_no_decay: list[tuple[str, nn.Parameter]]

    def describe(self) -> str:
        # Block indices collapsed to `*`, so the full-size model's list stays readable.
        adamw = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n, _ in self.adamw_decay + self.adamw_no_decay))
        return (f"Muon: {len(self.muon)} matrices ({sum(p.numel() for _, p in self.muon):,} parameters); "
                f"AdamW: {len(self.adamw_decay) + len(self.adamw_no_decay)} tensors: {', '.join(adamw)}")


def split_parameters(model: nn.Module, config: PretrainOptimizerConfig) -> ParameterSplit:
    norm_names = {f"{m}.{n}" if m else n for m, mod in model.named_modules() if isinstance(mod, RMSNorm)
                  for n, _ in mod.named_parameters(recurse=False)}
    linear_weights = {f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    split = ParameterSplit([], [], [])
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matrix = name in linear_weights and param.ndim == 2
        if config.name == "muon" and matrix and not ADAMW_ONLY.match(name):
            split.muon.append((name, param))
        elif matrix or (name in norm_names and config.norm_weight_decay):
            split.adamw_decay.append((name, param))
        else:
            split.adamw_no_decay.append((name, param))
    return split


class GatheredMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose orthogonalisation sees whole matrices under FSDP2.

    Momentum and the Nesterov blend are element-wise, so they run on each process's shard; only
    the Newton-Schulz step needs the whole matrix: a sharded (DTensor) update is gathered, every
    process orthogonalises the same matrix and keeps its own rows. On plain tensors this is
    exactly torch's step (same private helpers), which the tests check.
    """

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(param.grad, 1 - momentum)
                update = param.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = _orthogonalise(update, group)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-muon_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


def _orthogonalise(update: torch.Tensor, group: dict) -> torch.Tensor:
    args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    if not hasattr(update, "full_tensor"):
        return newton_schulz(update, *args)
    from torch.distributed.tensor import distribute_tensor

    whole = newton_schulz(update.full_tensor(), *args).to(update.dtype)
    # Every process holds the same `whole`: cut out the local shard without communication.
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


def make_optimizers(model: nn.Module, config: PretrainOptimizerConfig) -> tuple[list[torch.optim.Optimizer], ParameterSplit]:
    """[AdamW] or [Muon, AdamW]; ``initial_lr`` in each group is the base rate the schedule scales."""
    split = split_parameters(model, config)
    adamw = torch.optim.AdamW(
        [{"params": [p for _, p in split.adamw_decay], "weight_decay": config.weight_decay},
         {"params": [p for _, p in split.adamw_no_decay], "weight_decay": 0.0}],
        lr=config.learning_rate, betas=tuple(config.betas), eps=config.eps,
    )
    optimizers: list[torch.optim.Optimizer] = [adamw]
    if split.muon:
        muon = GatheredMuon([p for _, p in split.muon], lr=config.learning_rate, weight_decay=config.weight_decay,
                            momentum=config.momentum, nesterov=True, adjust_lr_fn="match_rms_adamw")
        optimizers.insert(0, muon)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["initial_lr"] = config.learning_rate
    return optimizers, split


def set_learning_rate(optimizers: list[torch.optim.Optimizer], multiplier: float) -> float:
    """Scale every group's base rate (the schedule is a pure function of the step: nothing to save)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
    return optimizers[0].param_groups[0]["lr"]
