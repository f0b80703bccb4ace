"""Which pack rows each step trains on, and the per-sample randomness, all pure functions of
``(seed, global step, row position)``: resuming, replaying and changing the process count never
change a batch.

A stage's global batch is ``G = batch_size * W`` rows (W = the processes the run started with):
batch ``k`` of the stage is rows ``[k*G, (k+1)*G)`` of its pack, wrapping at the end of an epoch
(``len(pack) // G`` batches; the incomplete tail is not used). Process ``r`` of ``W'`` takes rows
``[k*G + r*G/W', k*G + (r+1)*G/W')`` and runs them as micro-batches cut at multiples of
``batch_size``, so each micro-batch holds one bucket whatever ``W'`` is.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import torch

from ..config import ConfigError
from ..packs import CAPTION_COLUMNS, PackError, PackReader, decode_image
from ..packs.text_features import EMPTY_PROMPT_KEY, FEATURE_COLUMNS, features_from_bytes
from .config import CaptionConfig, PretrainConfig, StageConfig

logger = logging.getLogger("finetune")

LATENT_CHANNELS = 16
PIXELS_PER_TOKEN = 16
TOKEN_FEATURES = LATENT_CHANNELS * 4


def sample_generator(seed: int, step: int, position: int) -> torch.Generator:
    """The generator of one sample of one global step (noise, timestep, caption choice, dropout)."""
    digest = hashlib.sha256(f"{seed}:{step}:{position}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def open_stage_pack(stage: StageConfig) -> PackReader:
    """The stage's pack, refused when it was made for another batch size or resolution."""
    try:
        reader = PackReader(stage.data)
    except PackError as err:
        raise ConfigError(f"stage {stage.name!r}: {err}") from None
    info = reader.info
    if (info.batch_size, info.resolution) != (stage.batch_size, stage.resolution):
        raise ConfigError(
            f"stage {stage.name!r}: pack {stage.data} was made for batch_size={info.batch_size}, "
            f"resolution={info.resolution}; the stage has batch_size={stage.batch_size}, resolution={stage.resolution}. "
            f"Re-pack it with krea2 pack --batch-size {stage.batch_size} --resolution {stage.resolution}"
        )
    return reader


@dataclass
class StageBatches:
    stage: StageConfig
    reader: PackReader
    run_world_size: int
    """W: the processes the run started with (fixes the global batch)."""

    def __post_init__(self) -> None:
        self.global_batch = self.stage.batch_size * self.run_world_size
        self.batches_per_epoch = len(self.reader) // self.global_batch
        if self.batches_per_epoch == 0:
            raise ConfigError(f"stage {self.stage.name!r}: pack {self.stage.data} has {len(self.reader)} rows, "
                              f"fewer than one global batch ({self.global_batch})")

    def global_rows(self, k: int) -> range:
        start = (k % self.batches_per_epoch) * self.global_batch
        return range(start, start + self.global_batch)

    def epoch(self, k: int) -> int:
        return k // self.batches_per_epoch

    def repa_on(self, k: int) -> bool:
        return self.stage.repa is not None and self.epoch(k) < self.stage.repa.epochs

    def local_micro_batches(self, k: int, rank: int, world_size: int) -> list[range]:
        """This process's rows of batch ``k``, cut into one-bucket micro-batches."""
        if self.global_batch % world_size:
            raise ConfigError(f"stage {self.stage.name!r}: the global batch of {self.global_batch} rows does not split "
                              f"over {world_size} processes")
        rows = self.global_rows(k)
        per = self.global_batch // world_size
        mine = range(rows.start + rank * per, rows.start + (rank + 1) * per)
        bounds = sorted({mine.start, mine.stop, *range(mine.start - mine.start % self.stage.batch_size + self.stage.batch_size,
                                                           mine.stop, self.stage.batch_size)})
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def choose_caption(row: dict, ratios: CaptionConfig, generator: torch.Generator) -> tuple[str | None, str]:
    """(column, text): a caption column drawn by ``ratios``; a missing one falls back to the nearest
    present (long <-> medium <-> short); dropout (or no caption at all) gives the empty prompt."""
    drop = float(torch.rand(1, generator=generator)) < ratios.dropout
    weights = torch.tensor([ratios.long, ratios.medium, ratios.short], dtype=torch.float64)
    pick = int(torch.multinomial(weights, 1, generator=generator))
    if drop:
        return None, ""
    order = sorted(range(len(CAPTION_COLUMNS)), key=lambda i: (abs(i - pick), i))
    for index in order:
        column = CAPTION_COLUMNS[index]
        if row.get(column):
            return column, row[column]
    return None, ""


class StepData(torch.utils.data.Dataset):
    """Map-style dataset: item = global step (1-based) -> this process's decoded micro-batches.

    Runs in DataLoader workers: PNG decoding, caption choice, noise and timesteps (CPU).
    """

    def __init__(self, config: PretrainConfig, stages: list[StageBatches], rank: int, world_size: int):
        self.config, self.stages, self.rank, self.world_size = config, stages, rank, world_size

    def __len__(self) -> int:
        return self.config.total_steps

    def __getitem__(self, step: int) -> dict:
        from ..objective import sample_timesteps

        index, k = self.config.stage_at(step)
        batches = self.stages[index]
        stage = batches.stage
        objective = self.config.timestep_objective(stage)
        micro, failures = [], 0
        base = batches.global_rows(k).start
        for rows in batches.local_micro_batches(k, self.rank, self.world_size):
            pixels, ids, captions, features, noise, t = [], [], [], [], [], []
            for position, row in zip(rows, batches.reader.rows(rows.start, rows.stop)):
                generator = sample_generator(self.config.training.seed, step, position - base)
                column, caption = choose_caption(row, self.config.captions, generator)
                tokens = (row["height"] // PIXELS_PER_TOKEN) * (row["width"] // PIXELS_PER_TOKEN)
                sample_noise = torch.randn((tokens, TOKEN_FEATURES), generator=generator)
                sample_t = sample_timesteps(1, tokens, objective, generator)
                try:
                    image = decode_image(row)
                except Exception as err:  # a broken row costs its sample, never the run
                    logger.warning("step %d: skipping pack row %d (%s) of %s: %s", step, position, row["sample_id"], stage.data, err)
                    failures += 1
                    continue
                pixels.append(image)
                ids.append(row["sample_id"])
                captions.append(caption)
                noise.append(sample_noise)
                t.append(sample_t)
                if FEATURE_COLUMNS[CAPTION_COLUMNS[0]] in row:
                    features.append(self._features(row, column, batches))
            if pixels:
                micro.append({"pixels": torch.stack(pixels), "captions": captions, "sample_ids": ids,
                              "noise": torch.stack(noise), "t": torch.cat(t), "text_features": features or None})
        return {"step": step, "stage": index, "k": k, "micro": micro, "failures": failures,
                "repa": batches.repa_on(k)}

    @staticmethod
    def _features(row: dict, column: str | None, batches: StageBatches) -> torch.Tensor:
        if column is None:
            return features_from_bytes(batches.reader.key_value_metadata[EMPTY_PROMPT_KEY.encode()])
        return features_from_bytes(row[FEATURE_COLUMNS[column]])


def replay(config: PretrainConfig, step: int, run_world_size: int) -> dict:
    """``{"stage", "step", "sample_ids"}`` of a global step: every row it trained on, all processes."""
    index, k = config.stage_at(step)
    stage = config.stages[index]
    batches = StageBatches(stage, open_stage_pack(stage), run_world_size)
    rows = batches.global_rows(k)
    return {"stage": stage.name, "step": step, "sample_ids": batches.reader.sample_ids(rows.start, rows.stop)}


def replay_line(config: PretrainConfig, step: int, run_world_size: int) -> str:
    return json.dumps(replay(config, step, run_world_size))
