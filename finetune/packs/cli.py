"""``krea2 pack SOURCE OUT_DIR --resolution R --batch-size B [--seed S]``: write a ``krea2-pack-v1`` pack."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "pack",
        help="pre-resize, shuffle and bucket-group images into krea2-pack-v1 Parquet for `krea2 pretrain`",
        description="Write a krea2-pack-v1 pack: images resized and cropped to aspect buckets (PNG), globally "
                    "shuffled by --seed, grouped so that every --batch-size consecutive rows share a bucket.",
    )
    parser.add_argument("source", help="folder of images with same-name .txt captions, or a .jsonl / .parquet manifest")
    parser.add_argument("out_dir", help="new (or empty) folder for the pack's shards")
    parser.add_argument("--resolution", type=int, required=True, help="bucket area about RESOLUTION^2 pixels")
    parser.add_argument("--batch-size", type=int, required=True, help="per-process batch size of the stage that reads the pack")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    parser.add_argument("--rows-per-shard", type=int, default=None, help="rows per Parquet file (rounded to whole batches)")
    parser.add_argument("--text-encoder", default=None,
                        help="precompute caption features with this text encoder (hub id, folder, single file or "
                             "tiny-random) into the pack, so training needs no text encoder")
    parser.add_argument("--workers", type=int, default=1, help="processes decoding and resizing images (default 1)")
    parser.add_argument("--max-sequence-length", type=int, default=512, help="caption tokens kept with --text-encoder")
    return parser


def run(args: argparse.Namespace) -> int:
    from .sources import source_records
    from .writer import DEFAULT_ROWS_PER_SHARD, write_pack

    extra_columns = None
    if args.text_encoder:
        from .text_features import TextFeatureColumns

        extra_columns = TextFeatureColumns.load(args.text_encoder, args.max_sequence_length)
    stats = write_pack(
        source_records(args.source), args.out_dir, resolution=args.resolution, batch_size=args.batch_size,
        seed=args.seed, rows_per_shard=args.rows_per_shard or DEFAULT_ROWS_PER_SHARD, extra_columns=extra_columns,
        workers=args.workers,
    )
    print(json.dumps(stats.summary()))
    return 0
