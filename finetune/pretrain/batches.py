"""Which pack rows each step trains on, and the per-sample randomness, all pure functions of
``(seed, global step, row position)``: resuming, replaying and changing the process count never
change a batch.

A pack holds ``batch_size``-row groups of one bucket each. Every epoch visits them in a new order,
a permutation drawn from ``(seed, stage, epoch)``; a stage's global batch is ``G = batch_size * W``
rows (W = the processes the run started with): batch ``k`` of the stage (epoch ``k // (len(pack)
// G)``) is the next ``W`` groups of its epoch's order (groups left over at an epoch's end wait
for another epoch's order). Row position ``p`` of the global batch is row ``p % batch_size`` of
its ``p // batch_size``-th group. Process ``r`` of ``W'`` takes positions ``[r*G/W', (r+1)*G/W')``
and runs them as micro-batches cut at multiples of ``batch_size``, so each micro-batch holds one
bucket whatever ``W'`` is.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError
from ..engine.loader import step_generator
from ..packs import CAPTION_COLUMNS, PackError, PackReader, decode_image
from ..packs.text_features import EMPTY_PROMPT_KEY, FEATURE_COLUMNS, features_from_bytes
from .config import CaptionConfig, PretrainConfig, StageConfig

logger = logging.getLogger("finetune")

LATENT_CHANNELS = 16
PIXELS_PER_TOKEN = 16
TOKEN_FEATURES = LATENT_CHANNELS * 4


# Row positions inside one global batch stay below this, so (step, position) -> one index.
MAX_ROWS_PER_STEP = 1 << 32


def sample_generator(seed: int, step: int, position: int) -> torch.Generator:
    """The generator of one sample of one global step (noise, timestep, caption choice, dropout):
    the engine's per-index generator, indexed by (step, row position in the global batch)."""
    return step_generator(seed, step * MAX_ROWS_PER_STEP + position)


def open_stage_pack(stage: StageConfig) -> PackReader:
    """The stage's pack, refused when it was made for another batch size or resolution."""
    if not Path(stage.data).is_dir():  # e.g. an example run before its `krea2 pack` commands
        raise ConfigError(f"stage {stage.name!r}: pack {stage.data!r} is not a folder; write it first with "
                          f"`krea2 pack SOURCE {stage.data} --resolution {stage.resolution} --batch-size {stage.batch_size}`")
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
    seed: int
    """The run's ``training.seed``: with the stage's name and the epoch, it fixes each epoch's order."""

    def __post_init__(self) -> None:
        self.global_batch = self.stage.batch_size * self.run_world_size
        self.groups = len(self.reader) // self.stage.batch_size
        self.batches_per_epoch = len(self.reader) // self.global_batch
        if self.batches_per_epoch == 0:
            raise ConfigError(f"stage {self.stage.name!r}: pack {self.stage.data} has {len(self.reader)} rows, "
                              f"fewer than one global batch ({self.global_batch})")
        self._orders: dict[int, list[int]] = {}

    def epoch_order(self, epoch: int) -> list[int]:
        """The pack's one-bucket groups (indices) in the order epoch ``epoch`` visits them."""
        if epoch not in self._orders:
            generator = step_generator(self.seed, f"epoch-{epoch}-of-stage-{self.stage.name}")
            self._orders = {epoch: torch.randperm(self.groups, generator=generator).tolist()}  # one epoch at a time
        return self._orders[epoch]

    def rows(self, k: int, positions: range) -> range:
        """Pack rows of positions ``positions`` (inside one group) of global batch ``k``."""
        size = self.stage.batch_size
        group = self.epoch_order(self.epoch(k))[(k % self.batches_per_epoch) * self.run_world_size + positions.start // size]
        first = group * size + positions.start % size
        return range(first, first + len(positions))

    def global_rows(self, k: int) -> list[range]:
        """Pack rows of global batch ``k``, one range per group, in position order."""
        size = self.stage.batch_size
        return [self.rows(k, range(p, p + size)) for p in range(0, self.global_batch, size)]

    def epoch(self, k: int) -> int:
        return k // self.batches_per_epoch

    def repa_on(self, k: int) -> bool:
        return self.stage.repa is not None and self.epoch(k) < self.stage.repa.epochs

    def local_micro_batches(self, k: int, rank: int, world_size: int) -> list[range]:
        """This process's positions in global batch ``k``, cut into one-bucket micro-batches
        (their pack rows: :meth:`rows`)."""
        if self.global_batch % world_size:
            raise ConfigError(f"stage {self.stage.name!r}: the global batch of {self.global_batch} rows does not split "
                              f"over {world_size} processes")
        per = self.global_batch // world_size
        mine = range(rank * per, (rank + 1) * per)
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
        from ..optimization.timesteps import sample_timesteps

        index, k = self.config.stage_at(step)
        batches = self.stages[index]
        stage = batches.stage
        objective = self.config.timestep_objective(stage)
        micro, failures = [], 0
        for positions in batches.local_micro_batches(k, self.rank, self.world_size):
            rows = batches.rows(k, positions)
            pixels, valid, ids, captions, features, noise, t = [], [], [], [], [], [], []
            for position, row in zip(positions, batches.reader.rows(rows.start, rows.stop)):
                generator = sample_generator(self.config.training.seed, step, position)
                column, caption = choose_caption(row, self.config.captions, generator)
                tokens = (row["height"] // PIXELS_PER_TOKEN) * (row["width"] // PIXELS_PER_TOKEN)
                noise.append(torch.randn((tokens, TOKEN_FEATURES), generator=generator))
                t.append(sample_timesteps(1, tokens, objective, generator))
                try:
                    pixels.append(decode_image(row))
                    valid.append(True)
                    ids.append(row["sample_id"])
                except Exception as err:  # a broken row costs its sample, never the run
                    logger.warning("step %d: skipping pack row %d (%s) of %s: %s", step, position, row["sample_id"], stage.data, err)
                    failures += 1
                    # A black stand-in with zero loss weight keeps the batch shape (and, with several
                    # processes, every collective) the same as without the failure.
                    pixels.append(torch.zeros(3, row["height"], row["width"]))
                    valid.append(False)
                captions.append(caption)
                if FEATURE_COLUMNS[CAPTION_COLUMNS[0]] in row:
                    features.append(self._features(row, column, batches))
            micro.append({"pixels": torch.stack(pixels), "valid": torch.tensor(valid), "captions": captions,
                          "sample_ids": ids, "noise": torch.stack(noise), "t": torch.cat(t), "text_features": features or None})
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
    batches = StageBatches(stage, open_stage_pack(stage), run_world_size, config.training.seed)
    ids = [i for rows in batches.global_rows(k) for i in batches.reader.sample_ids(rows.start, rows.stop)]
    return {"stage": stage.name, "step": step, "sample_ids": ids}


def replay_line(config: PretrainConfig, step: int, run_world_size: int) -> str:
    return json.dumps(replay(config, step, run_world_size))
