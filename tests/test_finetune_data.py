"""Datasets, buckets, batch order, and the errors raised before any model is loaded."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from finetune.data.buckets import BucketBatches, fits, make_buckets, nearest_bucket, resize_to_bucket
from finetune.config import build_config
from finetune.data import DatasetError, make_synthetic_dataset, scan_dataset
from finetune.rundir import config_fingerprint
from finetune.trainer import RunDirectoryError, check_output_dir, prepare_samples

MAIN = SimpleNamespace(is_main=True, barrier=lambda: None)


def _image(path: Path, size=(64, 48), caption: str | None = "a caption"):
    Image.new("RGB", size, (200, 10, 10)).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)


def test_buckets_are_multiples_of_16_near_the_target_area():
    buckets = make_buckets(1024, 16, 0.5, 2.0)
    assert (1024, 1024) in buckets
    for w, h in buckets:
        assert w % 16 == 0 and h % 16 == 0
        assert 0.5 <= w / h <= 2.0
        assert 0.9 * 1024**2 <= w * h <= 1024**2
    assert nearest_bucket(1920, 1080, buckets) == (1360, 768)
    assert nearest_bucket(1000, 1000, buckets) == (1024, 1024)
    assert fits(1024, 1024, (1024, 1024)) and not fits(1000, 1000, (1024, 1024))
    cropped = resize_to_bucket(Image.new("RGB", (300, 200)), (96, 64))
    assert cropped.size == (96, 64)


def test_batch_order_is_a_pure_function_of_seed_and_index():
    bucket_of = [(64, 64)] * 5 + [(80, 48)] * 3
    order = BucketBatches(bucket_of, global_batch_size=2, seed=3)
    again = BucketBatches(bucket_of, global_batch_size=2, seed=3)
    assert order.batches_per_epoch == 3 + 2
    for index in range(12):
        batch = order.global_batch(index)
        assert batch == again.global_batch(index)
        assert len({bucket_of[i] for i in batch}) == 1  # one bucket per batch
        assert order.local_batch(index, 0, 2) + order.local_batch(index, 1, 2) == batch
    epoch = [i for b in order.epoch(0) for i in b]
    assert set(epoch) == set(range(8))  # every sample once per epoch (small buckets cycle)
    assert order.epoch(0) != order.epoch(1)  # reshuffled


def test_broken_images_and_missing_captions_are_skipped_and_counted(tmp_path):
    _image(tmp_path / "good.png")
    _image(tmp_path / "nocaption.png", caption=None)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "broken.txt").write_text("broken")
    scan = scan_dataset(tmp_path)
    assert [s.image_path.name for s in scan.samples] == ["good.png"]
    assert scan.skipped == {"broken image": [str(tmp_path / "broken.png")], "missing caption": [str(tmp_path / "nocaption.png")]}
    assert "1 skipped (broken image)" in scan.summary()


def test_jsonl_manifest_with_crop(tmp_path):
    _image(tmp_path / "a.png", size=(128, 64), caption=None)
    rows = [{"path": "a.png", "caption": "left half", "crop": [0, 0, 64, 64]}, {"path": "missing.png", "caption": "x"}]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    scan = scan_dataset(tmp_path / "data.jsonl")
    assert len(scan.samples) == 1 and scan.samples[0].size == (64, 64)
    assert scan.samples[0].caption == "left half"
    assert "missing image" in scan.skipped


def test_empty_dataset_is_an_error(tmp_path):
    (tmp_path / "notes.txt").write_text("no images here")
    with pytest.raises(DatasetError, match="no usable samples"):
        scan_dataset(tmp_path)
    with pytest.raises(DatasetError, match="neither a folder nor"):
        scan_dataset(tmp_path / "nothing")


def test_images_smaller_than_their_bucket_are_an_error_naming_them(tmp_path):
    _image(tmp_path / "big.png", size=(512, 512))
    _image(tmp_path / "small.png", size=(200, 150))
    config = build_config({"data": {"path": str(tmp_path), "resolution": 256}})
    with pytest.raises(DatasetError, match=r"1 of 2 images are smaller.*small.png 200x150 < bucket.*lower data.resolution \(e.g. to 144\)"):
        prepare_samples(config, tmp_path / "out", MAIN)
    config = build_config({"data": {"path": str(tmp_path), "resolution": 144}})
    samples, buckets, _ = prepare_samples(config, tmp_path / "out", MAIN)
    assert len(samples) == 2 and all(w * h <= 144 * 144 for w, h in buckets)


def test_synthetic_dataset_is_deterministic_and_distinct(tmp_path):
    make_synthetic_dataset(tmp_path / "a", num_prompts=4, size=32)
    make_synthetic_dataset(tmp_path / "b", num_prompts=4, size=32)
    scan = scan_dataset(tmp_path / "a")
    assert len({s.caption for s in scan.samples}) == 4
    pixels = [Image.open(s.image_path).tobytes() for s in scan.samples]
    assert len(set(pixels)) == 4
    assert pixels == [Image.open(s.image_path).tobytes() for s in scan_dataset(tmp_path / "b").samples]


def test_output_dir_holding_another_run_is_refused(tmp_path):
    config = build_config({"data": {"path": "x"}, "output_dir": str(tmp_path)})
    check_output_dir(tmp_path, config, resume=False)  # empty: fine
    (tmp_path / "run.json").write_text(json.dumps({"fingerprint": {}}))
    with pytest.raises(RunDirectoryError, match="already holds a training run; pass --resume"):
        check_output_dir(tmp_path, config, resume=False)
    with pytest.raises(RunDirectoryError, match="differs from the run"):
        check_output_dir(tmp_path, config, resume=True)


def test_text_fusion_default_follows_the_command_and_a_run_recorded_before_resumes_as_it_was(tmp_path, capsys):
    from finetune.posttrain.config import PosttrainConfig

    train = {"data": {"path": "x"}, "output_dir": str(tmp_path)}
    assert build_config(train).lora.train_text_fusion is True
    assert build_config({**train, "lora": {"train_text_fusion": False}}).lora.train_text_fusion is False
    posttrain = {"method": "dpo", "dpo": {"data": "pairs.jsonl"}, "model": {"pretrained_model_name_or_path": "tiny-random"}}
    assert build_config(posttrain, cls=PosttrainConfig).lora.train_text_fusion is False

    # A run recorded when the default was false, resumed from a config that leaves the key out.
    recorded = build_config({**train, "lora": {"train_text_fusion": False}})
    (tmp_path / "run.json").write_text(json.dumps({"fingerprint": config_fingerprint(recorded)}))
    resumed = build_config(train)
    check_output_dir(tmp_path, resumed, resume=True)
    assert resumed.lora.train_text_fusion is False
    assert "lora.train_text_fusion stays False" in capsys.readouterr().out
    # Any other change is still refused.
    with pytest.raises(RunDirectoryError, match="lora.rank: 32 -> 8"):
        check_output_dir(tmp_path, build_config({**train, "lora": {"rank": 8}}), resume=True)
    # A run recorded with it on keeps it on.
    (tmp_path / "run.json").write_text(json.dumps({"fingerprint": config_fingerprint(build_config(train))}))
    again = build_config(train)
    check_output_dir(tmp_path, again, resume=True)
    assert again.lora.train_text_fusion is True
