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
from curation.synthetic import COPY_KINDS, colour_variant, copy_of, layout, natural, near_copies, noise, photo

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
            "windows": values["crop_windows"], "area": small.width * small.height}


def test_near_duplicate_recall_and_precision():
    """50 originals (smooth photographs and natural-statistics ones); of each, a copy cropped by up
    to 5% a side, one resized to 50-100%, one at JPEG q60-95 and one with all three; copies cropped
    by 5-10% and by 10-15% on each side, and the 16:9 and 1:1 centre crops of the 4:3 frame (each
    also resized to 70-100% and saved at JPEG q60-95: the crop windows' candidates); plus an
    equal-luma colour variant and a photograph sharing its layout (both must stay apart).
    Recall >= 0.95 for every kind of copy, precision >= 0.98 over every merge."""
    rng = np.random.default_rng(0)
    images: list[tuple[int, str, Image.Image | bytes]] = []  # (source, kind, picture); source -1: its own
    originals = 50
    for n in range(originals):
        shared = layout(rng)
        picture = photo(rng, (512, 384), layout=shared) if n % 2 else natural(rng, (512, 384), grain=4.0)
        images.append((n, "original", picture))
        images += [(n, kind, data) for kind, data in near_copies(rng, picture)]
        images.append((-1, "colour variant", colour_variant(picture)))
        if n % 2:
            images.append((-1, "layout", photo(rng, (512, 384), layout=shared)))
    dedup = Deduplicator(CONFIG.dedup)
    source_of, group_of, kind_of = {}, {}, {}
    for image_id, (source, kind, data) in enumerate(images):
        f = _fingerprint(image_id, data)
        group_of[image_id], _ = dedup.place(image_id, f"md5-{image_id}", f["phash"], f["colour"], f["thumbnail"],
                                            f["area"], f["windows"])
        source_of[image_id] = source if source >= 0 else ("own", image_id)
        kind_of[image_id] = kind
    first = {}
    for image_id, source in source_of.items():
        first.setdefault(source, image_id)
    copies = [i for i, s in source_of.items() if first[s] != i]
    merged = [i for i in group_of if group_of[i] != i]
    correct = sum(source_of[i] == source_of[group_of[i]] for i in merged)
    precision = correct / max(len(merged), 1)
    recall = {}
    for kind in dict.fromkeys(kind_of[i] for i in copies):
        of_kind = [i for i in copies if kind_of[i] == kind]
        recall[kind] = sum(group_of[i] == group_of[first[source_of[i]]] for i in of_kind) / len(of_kind)
        assert len(of_kind) == originals
    print("near duplicates: recall " + ", ".join(f"{k} {v:.2f}" for k, v in recall.items()) +
          f"; precision {precision:.3f} ({correct}/{len(merged)})")
    assert len(copies) == len(COPY_KINDS) * originals
    assert min(recall.values()) >= 0.95 and precision >= 0.98, (recall, precision)


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
