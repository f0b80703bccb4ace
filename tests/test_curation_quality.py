"""Curation quality on generated images with known answers, without the warehouse: the noise
measure against grainy photographs, and near-duplicate recall and precision of the dedup rule
(hash candidates, colour, crop-tolerant alignment) over crops, resizes, JPEG and their combinations."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from curation.config import CurationConfig, load_config
from curation.dedup import Deduplicator
from curation.filters import thumbnail, verdict, scores
from curation.screening import filter_outcome
from curation.synthetic import colour_variant, copy_of, layout, natural, noise, photo

CONFIG = CurationConfig()


def _decode(data: bytes) -> Image.Image:
    return thumbnail(Image.open(io.BytesIO(data)), CONFIG.filter.analysis_side)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


@pytest.mark.parametrize("size", [(512, 384), (1024, 768)])
def test_noise_is_dropped_and_grainy_photographs_kept(size):
    """Noise of any kind and strength is dropped at any size (a gradient energy would pass it once
    the source is large enough); natural-statistics photographs with film grain up to sigma 8 stay."""
    rng = np.random.default_rng(size[0])
    small = size[0] <= 512
    for kind in ("uniform", "gaussian", "grey"):
        picture = noise(rng, kind, size)
        for data in (_png(picture), copy_of(picture, quality=90)) if small else (copy_of(picture, quality=90),):
            values = scores(np.asarray(_decode(data)), CONFIG.filter)
            assert verdict(values, CONFIG.filter) == ("noise", values["neighbour_correlation"]), (kind, values)
            assert values["neighbour_correlation"] < 0.4
    for grain in (0.0, 4.0, 8.0) if small else (8.0,):
        picture = natural(rng, size, grain)
        for data in (_png(picture), copy_of(picture, quality=85)) if small else (copy_of(picture, quality=85),):
            values = scores(np.asarray(_decode(data)), CONFIG.filter)
            assert verdict(values, CONFIG.filter) is None, (grain, values)
            assert values["neighbour_correlation"] > 0.7


def _fingerprint(image_id: int, image: Image.Image | bytes) -> dict:
    """What the filter job stores for dedup, computed by the filter job's own function, from
    encoded bytes (a copy) or a picture (lossless: what a PNG decodes to)."""
    small = _decode(image) if isinstance(image, bytes) else thumbnail(image.copy(), CONFIG.filter.analysis_side)
    values = filter_outcome({"id": image_id}, small, CONFIG).values
    return {"phash": values["phash"], "colour": values["colour_hash"], "thumbnail": values["thumbnail"],
            "area": small.width * small.height}


def test_near_duplicate_recall_and_precision():
    """50 originals (smooth photographs and natural-statistics ones); of each, a copy cropped by up
    to 5% a side, one resized to 50-100%, one at JPEG q60-95 and one with all three; plus an
    equal-luma colour variant and a photograph sharing its layout (both must stay apart).
    Recall >= 0.95 over the 200 copies, precision >= 0.98 over every merge."""
    rng = np.random.default_rng(0)
    images: list[tuple[int, Image.Image | bytes]] = []  # (source, picture); source -1: an image of its own
    originals = 50
    for n in range(originals):
        shared = layout(rng)
        picture = photo(rng, (512, 384), layout=shared) if n % 2 else natural(rng, (512, 384), grain=4.0)
        images.append((n, picture))
        crops = lambda: tuple(rng.uniform(0, 0.05, 4))  # noqa: E731
        images += [(n, copy_of(picture, crops(), 1.0, 95)),
                   (n, copy_of(picture, (0, 0, 0, 0), float(rng.uniform(0.5, 1.0)), 95)),
                   (n, copy_of(picture, (0, 0, 0, 0), 1.0, int(rng.integers(60, 96)))),
                   (n, copy_of(picture, crops(), float(rng.uniform(0.5, 1.0)), int(rng.integers(60, 96))))]
        images.append((-1, colour_variant(picture)))
        if n % 2:
            images.append((-1, photo(rng, (512, 384), layout=shared)))
    dedup = Deduplicator(CONFIG.dedup)
    source_of, group_of = {}, {}
    for image_id, (source, data) in enumerate(images):
        f = _fingerprint(image_id, data)
        group_of[image_id], _ = dedup.place(image_id, f"md5-{image_id}", f["phash"], f["colour"], f["thumbnail"], f["area"])
        source_of[image_id] = source if source >= 0 else ("own", image_id)
    first = {}
    for image_id, source in source_of.items():
        first.setdefault(source, image_id)
    copies = [i for i, s in source_of.items() if first[s] != i]
    found = sum(group_of[i] == group_of[first[source_of[i]]] for i in copies)
    merged = [i for i in group_of if group_of[i] != i]
    correct = sum(source_of[i] == source_of[group_of[i]] for i in merged)
    recall, precision = found / len(copies), correct / max(len(merged), 1)
    print(f"near duplicates: recall {recall:.3f} ({found}/{len(copies)}), precision {precision:.3f} "
          f"({correct}/{len(merged)})")
    assert len(copies) == 4 * originals
    assert recall >= 0.95 and precision >= 0.98


def test_dedup_config_is_validated(tmp_path):
    from finetune.config import ConfigError

    for text, words in (("dedup: {max_hash_distance: 144}", ["max_hash_distance", "144"]),
                        ("dedup: {min_similarity: 1.5}", ["min_similarity", "[-1, 1]"]),
                        ("dedup: {bands: 2}", ["bands"]),
                        ("dedup: {hash_size: 8}", ["hash_size", "8", "index"])):
        path = tmp_path / "curate.yaml"
        path.write_text(text + "\n")
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert all(w in str(err.value) for w in words), str(err.value)
