"""Reading a ``krea2-pack-v1`` pack by row range, shard boundaries hidden."""

from __future__ import annotations

import bisect
import io
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from .schema import (KEY_BATCH_SIZE, KEY_NUM_ROWS, KEY_RESOLUTION, KEY_SCHEMA, KEY_SEED, METADATA_KEYS, PACK_SCHEMA,
                     SHARD_PATTERN, PackInfo)
from .writer import PackError


def _shard_info(path: Path, metadata: dict[bytes, bytes] | None) -> PackInfo:
    meta = {k.decode(): v.decode() for k, v in (metadata or {}).items() if k.decode() in METADATA_KEYS}
    schema = meta.get(KEY_SCHEMA)
    if schema != PACK_SCHEMA:
        raise PackError(f"{path}: not a {PACK_SCHEMA} shard (key-value metadata {KEY_SCHEMA!r} is {schema!r})")
    try:
        return PackInfo(resolution=int(meta[KEY_RESOLUTION]), batch_size=int(meta[KEY_BATCH_SIZE]),
                        seed=int(meta[KEY_SEED]), num_rows=int(meta[KEY_NUM_ROWS]), schema=schema)
    except (KeyError, ValueError) as err:
        raise PackError(f"{path}: malformed {PACK_SCHEMA} header ({err})") from None


class PackReader:
    """Random access by row index over a pack's shards (sorted file-name order = row order).

    Args:
        path: the pack folder.
    Raises:
        PackError: no shards, a shard of another format, or shards that disagree on the header or
            do not add up to the pack's row count.
    """

    def __init__(self, path: str | Path):
        import pyarrow.parquet as pq

        self.path = Path(path)
        if not self.path.is_dir():
            raise PackError(f"pack {str(self.path)!r} is not a folder")
        self.shards = sorted(self.path.glob(SHARD_PATTERN))
        if not self.shards:
            raise PackError(f"pack {str(self.path)!r} holds no {SHARD_PATTERN} shards")
        self._files = [pq.ParquetFile(p) for p in self.shards]
        infos = [_shard_info(p, f.schema_arrow.metadata) for p, f in zip(self.shards, self._files)]
        self.info = infos[0]
        for shard, info in zip(self.shards, infos):
            if info != self.info:
                raise PackError(f"{shard}: header {info} differs from {self.shards[0].name}'s {self.info}")
        counts = [f.metadata.num_rows for f in self._files]
        self._starts = list(np.cumsum([0, *counts]))
        if self._starts[-1] != self.info.num_rows:
            raise PackError(f"pack {self.path}: shards hold {self._starts[-1]} rows, the header says {self.info.num_rows} (a shard is missing?)")
        self.columns = self._files[0].schema_arrow.names
        self.key_value_metadata = dict(self._files[0].schema_arrow.metadata)

    def __len__(self) -> int:
        return self.info.num_rows

    def rows(self, start: int, stop: int, columns: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Rows ``[start, stop)`` as dicts (only ``columns`` when given), reading only the row
        groups that hold them."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"rows [{start}, {stop}) outside pack {self.path} of {len(self)} rows")
        out: list[dict[str, Any]] = []
        shard = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            file, base = self._files[shard], int(self._starts[shard])
            local, local_stop = start - base, min(stop, int(self._starts[shard + 1])) - base
            groups, row = [], 0
            first_row = None
            for g in range(file.metadata.num_row_groups):
                size = file.metadata.row_group(g).num_rows
                if row + size > local and row < local_stop:
                    groups.append(g)
                    first_row = row if first_row is None else first_row
                row += size
            table = file.read_row_groups(groups, columns=list(columns) if columns else None)
            out += table.slice(local - first_row, local_stop - local).to_pylist()
            start = base + local_stop
            shard += 1
        return out

    def sample_ids(self, start: int, stop: int) -> list[str]:
        return [r["sample_id"] for r in self.rows(start, stop, ["sample_id"])]


def decode_image(row: dict[str, Any]):
    """A row's pixels as (3, height, width) float32 in [0, 1]; raises if the bytes do not decode to
    the row's bucket."""
    import torch

    with Image.open(io.BytesIO(row["image_bytes"])) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    if pixels.shape[:2] != (row["height"], row["width"]):
        raise ValueError(f"image is {pixels.shape[1]}x{pixels.shape[0]}, its row says {row['width']}x{row['height']}")
    return torch.from_numpy(pixels).permute(2, 0, 1)
