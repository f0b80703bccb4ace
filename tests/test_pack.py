"""`krea2 pack` and the krea2-pack-v1 reader: every valid row once, one bucket per group,
a global shuffle reproducible from the seed, broken images skipped and counted."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from finetune.packs import PACK_SCHEMA, PackError, PackReader, PackRecord, decode_image, write_pack
from krea2_diffusers.cli import main as krea2

SIZES = [(64, 64), (128, 64), (64, 128), (96, 72), (80, 80), (160, 96)]


def _folder(root, count=27):
    rng = np.random.default_rng(0)
    root.mkdir()
    for i in range(count):
        w, h = SIZES[i % len(SIZES)]
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / f"img_{i:03d}.png")
        (root / f"img_{i:03d}.txt").write_text(f"caption {i}")
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (root / "tiny.png").write_bytes(b"")
    Image.new("RGB", (20, 20)).save(root / "small.png")  # smaller than every 64 px bucket
    return root


def _pack(tmp_path, name, seed, rows_per_shard=8, workers=1):
    out = tmp_path / name
    assert krea2(["pack", str(tmp_path / "images"), str(out), "--resolution", "64", "--batch-size", "4",
                  "--seed", str(seed), "--rows-per-shard", str(rows_per_shard), "--workers", str(workers)]) == 0
    return out


def test_pack_holds_every_valid_row_once_in_one_bucket_groups_shuffled_by_seed(tmp_path, capsys):
    _folder(tmp_path / "images")
    out = _pack(tmp_path, "a", seed=1)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["skipped"] == {"broken image": 2, "smaller than its bucket": 1}
    reader = PackReader(out)
    assert (reader.info.schema, reader.info.resolution, reader.info.batch_size, reader.info.seed) == (PACK_SCHEMA, 64, 4, 1)
    shards = sorted(out.glob("*.parquet"))
    assert len(shards) == 4  # 27 rows, 8 per shard (two groups of 4)
    meta = pq.ParquetFile(shards[0]).schema_arrow.metadata
    assert meta[b"krea2.pack.schema"] == PACK_SCHEMA.encode() and meta[b"krea2.pack.batch_size"] == b"4"
    assert meta[b"krea2.pack.resolution"] == b"64" and meta[b"krea2.pack.seed"] == b"1"

    # Reading by shard file in sorted order gives the same rows as the reader's row ranges.
    by_files = [r for s in shards for r in pq.read_table(s).to_pylist()]
    rows = reader.rows(0, len(reader))
    assert [r["sample_id"] for r in rows] == [r["sample_id"] for r in by_files]
    assert reader.rows(5, 19) == rows[5:19]  # a range across shard boundaries
    ids = [r["sample_id"] for r in rows]
    assert sorted(ids) == [f"img_{i:03d}.png" for i in range(27)]  # every valid row exactly once
    for k in range(0, len(rows), 4):
        group = rows[k:k + 4]
        assert len({(r["width"], r["height"]) for r in group}) == 1, f"group {k // 4} mixes buckets"
        for r in group:
            assert r["width"] % 16 == 0 and r["height"] % 16 == 0
            assert decode_image(r).shape == (3, r["height"], r["width"])
    first = rows[0]
    assert first["caption_long"] == f"caption {int(first['sample_id'][4:7])}" and first["caption_short"] is None
    assert first["source"].endswith(first["sample_id"]) and json.loads(first["metadata"]) == {}
    # Several buckets are in use, and the 2:1 images land in a wide one.
    assert len({(r["width"], r["height"]) for r in rows}) >= 3
    wide = [r for r in rows if r["sample_id"] in {f"img_{i:03d}.png" for i in range(1, 27, 6)}]
    assert any(r["width"] > r["height"] for r in wide)

    again = _pack(tmp_path, "b", seed=1, rows_per_shard=100, workers=2)
    other = _pack(tmp_path, "c", seed=2)
    assert PackReader(again).rows(0, 27) == rows  # reproducible, whatever the shard size and worker count
    assert PackReader(other).sample_ids(0, 27) != ids  # the seed shuffles
    assert ids != sorted(ids)
    assert krea2(["pack", str(tmp_path / "images"), str(out), "--resolution", "64", "--batch-size", "4"]) == 2


def test_pack_from_records_manifests_and_bytes(tmp_path):
    images = tmp_path / "src"
    images.mkdir()
    lines = []
    for i in range(6):
        Image.new("RGB", (64 + 16 * i, 64), (10 * i, 0, 0)).save(images / f"{i}.png")
        lines.append(json.dumps({"path": f"src/{i}.png", "caption": f"long {i}", "caption_short": f"s{i}", "score": i}))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(lines))
    assert krea2(["pack", str(manifest), str(tmp_path / "p"), "--resolution", "64", "--batch-size", "2"]) == 0
    rows = PackReader(tmp_path / "p").rows(0, 6)
    by_source = {r["source"].rsplit("/", 1)[-1]: r for r in rows}
    assert by_source["3.png"]["caption_long"] == "long 3" and by_source["3.png"]["caption_short"] == "s3"
    assert json.loads(by_source["3.png"]["metadata"]) == {"score": 3}

    # The writer API (what curation's export calls): bytes in, ids kept, bad bytes counted.
    records = [PackRecord(image=(images / f"{i}.png").read_bytes(), caption_long=f"c{i}", sample_id=f"id{i}",
                          source=f"s3://bucket/{i}.png", metadata={"cluster": i % 2}) for i in range(6)]
    records.append(PackRecord(image=b"not an image", sample_id="bad"))
    stats = write_pack(records, tmp_path / "q", resolution=64, batch_size=3, seed=0)
    assert stats.skipped == {"broken image": 1} and stats.info.num_rows == 6
    rows = PackReader(tmp_path / "q").rows(0, 6)
    assert sorted(r["sample_id"] for r in rows) == [f"id{i}" for i in range(6)]
    with pytest.raises(PackError, match="duplicate sample_id 'id0'"):
        write_pack(records[:1] * 2, tmp_path / "r", resolution=64, batch_size=1)
    with pytest.raises(PackError, match="no usable images"):
        write_pack(records[-1:], tmp_path / "s", resolution=64, batch_size=1)
    with pytest.raises(PackError, match="not a krea2-pack-v1 shard"):
        pq.write_table(pq.read_table(manifest.with_suffix(".jsonl").parent / "q" / "part-000000.parquet").replace_schema_metadata({}),
                       tmp_path / "t.parquet")
        (tmp_path / "t").mkdir()
        (tmp_path / "t.parquet").rename(tmp_path / "t" / "part-000000.parquet")
        PackReader(tmp_path / "t")
