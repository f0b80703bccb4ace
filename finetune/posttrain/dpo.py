"""``method: dpo``: Diffusion-DPO for flow matching, with two named anchors.

For a pair (chosen w, rejected l) noised with the same noise and time, with per-sample
flow-matching losses ``L`` of the trained model and ``L_ref`` of the reference (base weights)::

    margin = -beta / 2 * ((L(w) - L_ref(w)) - (L(l) - L_ref(l)))       # the implicit reward margin
    loss   = -log sigmoid(margin)
           + sft_weight * L(w)                                          # anchor 1: SFT on chosen
           + chosen_anchor_weight * relu(L(w) - L_ref(w))               # anchor 2: chosen stays >= reference

Plain DPO only needs the margin to grow, which it can do by making *both* samples less likely
(the drift Krea's report describes); the anchors keep the chosen sample's likelihood at or above
the reference's. Held-out pairs are scored every ``dpo.eval_every_n_steps`` with fixed noise, so
drift shows in ``metrics.jsonl`` (``heldout/*``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data import DatasetError
from ..data.buckets import BucketBatches, fits, make_buckets, nearest_bucket
from ..data.cache import build_cache
from ..data.encoding import pack_latents, position_ids
from ..engine.loader import Forward, ResumableSampler, make_loader, step_generator
from ..engine.parallel import no_sync
from ..optimization.objective import add_noise, flow_matching_losses
from ..optimization.timesteps import sample_timesteps
from ..trainer import NonFiniteLossError
from .pairs import make_synthetic_pairs, scan_pairs
from .trainer import PosttrainTrainer

# Noise/time draws per held-out pair: the flow-matching loss of one draw is very noisy.
HELDOUT_DRAWS = 4
# Generator index of the held-out noise, far from any training step's.
HELDOUT_SEED_INDEX = -1


@dataclass
class PairLosses:
    """(B,) per-sample flow-matching losses of the model and the reference on chosen / rejected."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor


def implicit_reward_margin(losses: PairLosses, beta: float) -> torch.Tensor:
    """(B,) ``-beta/2 ((L(w) - L_ref(w)) - (L(l) - L_ref(l)))``: positive when the model prefers
    the chosen sample more than the reference does."""
    return -0.5 * beta * ((losses.chosen - losses.ref_chosen) - (losses.rejected - losses.ref_rejected))


def dpo_loss(losses: PairLosses, beta: float, sft_weight: float = 0.0, chosen_anchor_weight: float = 0.0) -> torch.Tensor:
    """The scalar training loss (see the module docstring)."""
    loss = -F.logsigmoid(implicit_reward_margin(losses, beta)).mean()
    if sft_weight:
        loss = loss + sft_weight * losses.chosen.mean()
    if chosen_anchor_weight:
        loss = loss + chosen_anchor_weight * F.relu(losses.chosen - losses.ref_chosen).mean()
    return loss


@torch.no_grad()
def pair_statistics(losses: PairLosses, beta: float, prefix: str) -> dict[str, float]:
    margin = implicit_reward_margin(losses, beta)
    return {
        f"{prefix}margin": float(margin.mean()),
        f"{prefix}accuracy": float((margin > 0).float().mean()),
        f"{prefix}chosen_loss": float(losses.chosen.mean()),
        f"{prefix}rejected_loss": float(losses.rejected.mean()),
        f"{prefix}chosen_vs_reference": float((losses.chosen - losses.ref_chosen).mean()),
        f"{prefix}rejected_vs_reference": float((losses.rejected - losses.ref_rejected).mean()),
    }


def pair_tensors(cache, pair_ids: list[int]) -> dict:
    """Packed ``chosen`` / ``rejected`` latents (B, N, 64), the prompt's ``embeds`` (B, L, layers,
    dim) with ``mask`` (B, L) and the token ``grid`` (h/2, w/2) of pairs ``pair_ids`` (one bucket)
    from the cache, which holds pair i's chosen at 2i and rejected at 2i + 1."""
    chosen = cache.latents([2 * i for i in pair_ids])
    embeds, mask = cache.text([2 * i for i in pair_ids], [False] * len(pair_ids))
    return dict(chosen=pack_latents(chosen), rejected=pack_latents(cache.latents([2 * i + 1 for i in pair_ids])),
                embeds=embeds, mask=mask, grid=torch.tensor([chosen.shape[2] // 2, chosen.shape[3] // 2]))


class PairFeatures(torch.utils.data.Dataset):
    """Item ``(step, Forward)`` -> one forward's pairs (:func:`pair_tensors`), its ``noise`` (B, N,
    64) and times ``t`` (B,) drawn for the whole global micro-batch from ``(seed, micro-batch)``
    (the same whatever the process count) and the pair ``ids``; for the engine's DataLoader."""

    def __init__(self, cache, batches: BucketBatches, accumulation: int, seed: int, objective):
        self.cache, self.batches, self.accumulation, self.seed, self.objective = cache, batches, accumulation, seed, objective

    def __getitem__(self, item: tuple[int, Forward]) -> dict:
        step, forward = item
        index = step * self.accumulation + forward.micro
        global_ids = self.batches.global_batch(index)
        local = global_ids[forward.start:forward.stop]
        tensors = pair_tensors(self.cache, local)
        generator = step_generator(self.seed, index)
        noise = torch.randn((len(global_ids), *tensors["chosen"].shape[1:]), generator=generator)
        t = sample_timesteps(len(global_ids), tensors["chosen"].shape[1], self.objective, generator)
        return dict(tensors, noise=noise[forward.start:forward.stop], t=t[forward.start:forward.stop], ids=torch.tensor(local))

    def __len__(self) -> int:
        raise TypeError("PairFeatures is indexed by (step, Forward) items from ResumableSampler")


class DPOTrainer(PosttrainTrainer):
    @classmethod
    def model_copies(cls, config):
        """Chosen and rejected go through the model in one forward, at the largest pair bucket."""
        data = config.data
        buckets = make_buckets(config.dpo.resolution, data.bucket_step, data.min_aspect_ratio, data.max_aspect_ratio)
        return super().model_copies(config, forward_batch=2 * config.training.batch_size,
                                    image_size=max(buckets, key=lambda b: b[0] * b[1]))

    def prepare_inputs(self) -> None:
        section, runtime = self.config.dpo, self.runtime
        manifest = Path(section.data) if section.data else self.out / "synthetic_pairs" / "pairs.jsonl"
        if section.synthetic is not None:
            if runtime.is_main:
                make_synthetic_pairs(manifest, section.synthetic.num_pairs, section.synthetic.size)
            runtime.barrier()
        self.pairs, self.scan = scan_pairs(manifest)
        if len(self.pairs) <= section.heldout_pairs:
            raise DatasetError(f"{manifest}: {len(self.pairs)} usable pairs, but dpo.heldout_pairs={section.heldout_pairs} "
                               "leaves none to train on")
        buckets = make_buckets(section.resolution, self.config.data.bucket_step, self.config.data.min_aspect_ratio,
                               self.config.data.max_aspect_ratio)
        self.pair_buckets = [nearest_bucket(*p.chosen.size, buckets) for p in self.pairs]
        small = [(p, b) for p, b in zip(self.pairs, self.pair_buckets) if not (fits(*p.chosen.size, b) and fits(*p.rejected.size, b))]
        if small:
            p, b = small[0]
            raise DatasetError(f"{len(small)} pairs have an image smaller than their bucket (e.g. {p.chosen.image_path.name} / "
                               f"{p.rejected.image_path.name} < {b[0]}x{b[1]}); lower dpo.resolution")
        self.num_train = len(self.pairs) - section.heldout_pairs

    def encode_inputs(self) -> None:
        config, runtime = self.config, self.runtime
        samples = [s for p in self.pairs for s in (p.chosen, p.rejected)]
        sample_buckets = [b for b in self.pair_buckets for _ in range(2)]
        cache_dir = config.dpo.cache_dir or self.out / "cache"
        self.cache = build_cache(self.pipe, samples, sample_buckets, cache_dir, config.model.max_sequence_length,
                                 runtime.device, runtime.rank, runtime.world_size, runtime.barrier)
        # The run's global micro-batch (kept on resume with another number of processes).
        self.batches = BucketBatches(self.pair_buckets[: self.num_train], self.global_batch.micro_batch,
                                     seed=config.training.seed, shuffle=config.data.shuffle)

    # ---------------------------------------------------------------- losses
    def step_inputs(self):
        """The engine's DataLoader (workers, prefetch) over this process's share of each
        micro-batch, from the resumed step on."""
        runtime, data = self.runtime, self.config.data
        per_rank = self.global_batch.micro_batch // runtime.world_size
        layout = [Forward(micro, runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
                  for micro in range(self.global_batch.accumulation)]
        dataset = PairFeatures(self.cache, self.batches, self.global_batch.accumulation, self.config.training.seed,
                               self.config.objective)
        return make_loader(dataset, ResumableSampler(layout, self.start_step, self.config.training.max_steps),
                           num_workers=data.num_workers, prefetch_factor=data.prefetch_factor,
                           pin_memory=runtime.device.type == "cuda")

    def _inputs(self, item: dict):
        """Chosen and rejected tokens (B, N, 64), text (B, L, ...), mask and positions on the device."""
        device = self.runtime.device
        h, w = item["grid"].tolist()
        positions = position_ids(item["embeds"].shape[1], h, w, device)
        return (item["chosen"].to(device), item["rejected"].to(device), item["embeds"].to(device), item["mask"].to(device),
                positions)

    def pair_losses(self, model, chosen, rejected, embeds, mask, positions, noise, t, with_grad: bool) -> PairLosses:
        """Model and reference losses of chosen and rejected under the same noise and time."""
        x0 = torch.cat([chosen, rejected])
        noise, t = torch.cat([noise, noise]), torch.cat([t, t])
        inputs = dict(hidden_states=add_noise(x0, noise, t), encoder_hidden_states=torch.cat([embeds, embeds]), timestep=t,
                      position_ids=positions, encoder_attention_mask=torch.cat([mask, mask]))
        weighting = self.config.objective.loss_weighting
        with torch.set_grad_enabled(with_grad), self.runtime.autocast():
            pred = model(**inputs, return_dict=False)[0]
        ref = self.reference(model, **inputs)
        model_losses = flow_matching_losses(pred, x0, noise, t, weighting).chunk(2)
        ref_losses = flow_matching_losses(ref, x0, noise, t, weighting).chunk(2)
        return PairLosses(*model_losses, *ref_losses)

    def train_step(self, step: int, items=None) -> tuple[float, float]:
        runtime, section = self.runtime, self.config.dpo
        accumulation = self.global_batch.accumulation
        total, stats = 0.0, {}
        for micro in range(accumulation):
            item = next(items)
            global_ids = self.batches.global_batch(step * accumulation + micro)
            chosen, rejected, embeds, mask, positions = self._inputs(item)
            # Forward and backward inside: DDP prepares its gradient all-reduce in the forward.
            with no_sync(self.model, runtime, sync=micro == accumulation - 1):
                losses = self.pair_losses(self.model, chosen, rejected, embeds, mask, positions,
                                          item["noise"].to(chosen.device), item["t"].to(chosen.device), with_grad=True)
                loss = dpo_loss(losses, section.beta, section.sft_weight, section.chosen_anchor_weight)
                mean_loss = float(runtime.mean(loss))
                if not math.isfinite(mean_loss):
                    prompts = [self.pairs[i].prompt for i in global_ids]
                    raise NonFiniteLossError(f"DPO loss is {mean_loss} at step {step + 1} on pairs with prompts {prompts}; "
                                             f"stopped without saving, the last good checkpoint is kept in {self.checkpointer.folder}")
                (loss / accumulation).backward()
            total += mean_loss / accumulation
            for key, value in pair_statistics(losses, section.beta, "train/").items():
                stats[key] = stats.get(key, 0.0) + value / accumulation
        grad_norm = self.optimizer_step()
        self.lr_scheduler.step()
        stats = runtime.means(stats)  # each process's pairs -> the global batch's
        if self.eval_due(step, section.eval_every_n_steps):
            stats.update(self.heldout_statistics())
        self.extra_metrics = stats
        return total, grad_norm

    @torch.no_grad()
    def heldout_statistics(self) -> dict[str, float]:
        """``heldout/*`` over the held-out pairs, with the same noise at every evaluation."""
        section = self.config.dpo
        ids = list(range(self.num_train, len(self.pairs)))
        if not ids:
            return {}
        generator = self.generator(HELDOUT_SEED_INDEX)
        totals: dict[str, float] = {}
        self.model.eval()
        try:
            for pair_id in ids:
                chosen, rejected, embeds, mask, positions = self._inputs(pair_tensors(self.cache, [pair_id]))
                repeat = lambda x: x.repeat_interleave(HELDOUT_DRAWS, 0)
                noise = torch.randn((HELDOUT_DRAWS, *chosen.shape[1:]), generator=generator).to(chosen.device)
                t = sample_timesteps(HELDOUT_DRAWS, chosen.shape[1], self.config.objective, generator).to(chosen.device)
                losses = self.pair_losses(self.model, repeat(chosen), repeat(rejected), repeat(embeds), repeat(mask),
                                          positions, noise, t, with_grad=False)
                for key, value in pair_statistics(losses, section.beta, "heldout/").items():
                    totals[key] = totals.get(key, 0.0) + value / len(ids)
        finally:
            self.model.train()
        return totals
