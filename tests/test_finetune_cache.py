"""The latent / text cache: reused while nothing changed, invalidated when the model, the settings
or the image change, and its text entries equal what the pipeline encodes."""

from pathlib import Path

import pytest
import torch
from PIL import Image

from finetune.data.buckets import make_buckets, nearest_bucket
from finetune.data.cache import build_cache
from finetune.data import make_synthetic_dataset, scan_dataset
from krea2_diffusers import Krea2Pipeline

# Tiny models: one thread (conftest.one_thread; with 2 threads a busy 2-core machine spends most of the
# time synchronising them).
pytestmark = pytest.mark.usefixtures("one_thread")


def _build(pipe, folder: Path, cache: Path, max_sequence_length: int = 512):
    samples = scan_dataset(folder).samples
    buckets = [nearest_bucket(*s.size, make_buckets(64)) for s in samples]
    return samples, build_cache(pipe, samples, buckets, cache, max_sequence_length, torch.device("cpu"))


def _files(cache: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")}


def test_cache_is_reused_and_invalidated(tmp_path, tiny_pipe):
    data = make_synthetic_dataset(tmp_path / "data", num_prompts=3, size=64)
    cache = tmp_path / "cache"
    samples, first = _build(tiny_pipe, data, cache)
    written = _files(cache)
    assert len(written) == 3 + 4  # 3 latents, 3 captions + the empty prompt
    _, again = _build(tiny_pipe, data, cache)
    assert _files(cache) == written and again == first  # nothing re-encoded

    # A different model: new fingerprint folders, old entries never read.
    other = Krea2Pipeline.from_pretrained("tiny-random", seed=1)
    _, changed = _build(other, data, cache)
    assert changed.latent_files[0].parent != first.latent_files[0].parent
    assert changed.text_files[0].parent != first.text_files[0].parent
    # Another text setting invalidates the text entries only.
    _, shorter = _build(tiny_pipe, data, cache, max_sequence_length=64)
    assert shorter.latent_files == first.latent_files and shorter.text_files[0].parent != first.text_files[0].parent
    # Edited image content: a new latent entry for that image only.
    Image.new("RGB", (64, 64), (1, 2, 3)).save(samples[0].image_path)
    _, edited = _build(tiny_pipe, data, cache)
    assert edited.latent_files[0] != first.latent_files[0] and edited.latent_files[1:] == first.latent_files[1:]


def test_cached_text_equals_pipeline_encoding(tmp_path, tiny_pipe):
    data = make_synthetic_dataset(tmp_path / "data", num_prompts=3, size=64)
    samples, cache = _build(tiny_pipe, data, tmp_path / "cache")
    embeds, mask = cache.text([0, 1, 2], [False, True, False])
    captions = [samples[0].caption, "", samples[2].caption]
    with torch.no_grad():
        for row, caption in enumerate(captions):
            expected, expected_mask = tiny_pipe.encode_prompt(caption, device="cpu")
            real = expected[0][expected_mask[0]]
            assert int(mask[row].sum()) == real.shape[0]
            torch.testing.assert_close(embeds[row][mask[row]], real)
    assert not mask[1, int(mask[1].sum()):].any()  # right padding, masked
    latents = cache.latents([0, 1])
    assert latents.shape == (2, 16, 8, 8) and latents.dtype == torch.float32
