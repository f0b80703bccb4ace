"""The images of a Train-tab run: a folder (or uploaded files), their captions, and captions for the
missing ones from the pipeline's own Qwen3-VL through curation's captioner.

Captions are read from same-name ``.txt`` files (what ``krea2 train`` reads from a folder) but never
written next to the images: the run's manifest in the run folder carries them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from finetune.data.dataset import IMAGE_EXTENSIONS
from finetune.data.masks import MASK_SUFFIX

from .errors import TrainInputError

if TYPE_CHECKING:
    from .roots import DataRoots

COLUMNS = ["image", "caption"]
# Short captions on tiny-random (random text anyway); real VLMs get curation's own budget.
TINY_CAPTION_TOKENS = 4
THUMBNAIL_SIDE = 256


def find_images(folder: str | Path, roots: DataRoots | None = None) -> list[Path]:
    """The readable images directly in ``folder``, sorted; a clear error for a missing or empty
    folder, a folder without images, or a file that claims to be an image but is not one.
    With ``roots``, the folder and each image (a symlink may point elsewhere) must lie inside them,
    checked before the folder is read."""
    if not str(folder or "").strip():
        raise TrainInputError("Choose a folder of images (or upload them) first.")
    folder = Path(folder).expanduser() if roots is None else roots.folder(folder)
    if not folder.is_dir():
        raise TrainInputError(f"{folder} is not a folder.")
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise TrainInputError(f"{folder} is empty: put the training images (PNG, JPEG or WebP) in it.")
    # NAME.mask.png is NAME.png's loss mask (finetune.data.masks), not a training image.
    images = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS and not p.stem.endswith(MASK_SUFFIX)]
    if not images:
        names = ", ".join(p.name for p in files[:3])
        raise TrainInputError(f"{folder} holds no images ({len(files)} other file(s): {names}); "
                              f"expected {', '.join(sorted(IMAGE_EXTENSIONS))} files.")
    for path in images:
        if roots is not None and not roots.contains(path):
            raise roots.refusal(f"{path.name} (in {folder})")
        check_image(path)
    return images


def check_image(path: Path) -> None:
    try:
        with Image.open(path) as image:
            image.load()
    except Exception as err:  # PIL raises many types for bad files; any of them means "not an image"
        raise TrainInputError(f"{path.name} is not a readable image ({type(err).__name__}: {err}).") from None


def caption_table(images: list[Path], roots: DataRoots | None = None) -> list[list[str]]:
    """Rows ``[image path, caption]``; the caption from a same-name ``.txt`` file, else empty (with
    ``roots``, a caption file outside them, a symlink pointing out, counts as no caption)."""
    rows = []
    for path in images:
        caption_file = path.with_suffix(".txt")
        readable = caption_file.is_file() and (roots is None or roots.contains(caption_file))
        rows.append([str(path), caption_file.read_text(encoding="utf-8").strip() if readable else ""])
    return rows


def thumbnail(path: str | Path, side: int = THUMBNAIL_SIDE) -> Image.Image:
    """The image at ``path`` shrunk to at most ``side`` pixels a side (RGB), for the UI's grid."""
    with Image.open(path) as image:
        image.draft("RGB", (side, side))  # JPEG: decode at a reduced scale, not at full size
        small = image.convert("RGB")
    small.thumbnail((side, side))
    return small


def table_rows(table) -> list[list[str]]:
    """A Gradio Dataframe value (a pandas frame, ``{"data": ...}`` or a list of rows) -> rows."""
    if table is None:
        return []
    if hasattr(table, "values") and hasattr(table, "columns"):
        table = table.values.tolist()
    elif isinstance(table, dict):
        table = table.get("data") or []
    return [[str(row[0] or ""), str(row[1] or "")] for row in table if row and str(row[0] or "").strip()]


class Captioner:
    """Captions from curation's caption job (:class:`curation.captions.CaptionJob`), loaded on
    first use: the medium caption (two or three sentences), the length LoRA captions usually have."""

    def __init__(self, model: str, tiny: bool):
        self.model_name = model
        self.tiny = tiny
        self._job = None

    def _loaded(self):
        if self._job is None:
            from curation.captions import CaptionJob, load_captioner
            from curation.config import CaptionConfig

            config = CaptionConfig(model=self.model_name)
            if self.tiny:
                config.max_new_tokens = config.rewrite_max_new_tokens = TINY_CAPTION_TOKENS
            job = CaptionJob(config)
            job.model, job.tokenizer = load_captioner(self.model_name)
            self._job = job
        return self._job

    def caption_missing(self, rows: list[list[str]], progress=None) -> list[list[str]]:
        """``rows`` with every empty caption filled; ``progress(done, total)`` after each image."""
        import torch

        missing = [i for i, (_, caption) in enumerate(rows) if not caption.strip()]
        out = [list(row) for row in rows]
        threads = torch.get_num_threads()
        if self.tiny:  # token-by-token decoding of tiny matrices: extra threads only synchronise
            torch.set_num_threads(1)
        try:
            self._fill(out, missing, progress)
        finally:
            torch.set_num_threads(threads)
        return out

    def _fill(self, out: list[list[str]], missing: list[int], progress) -> None:
        for done, i in enumerate(missing, 1):
            with Image.open(out[i][0]) as image:
                picture = image.convert("RGB")
            captions = self._loaded().caption(picture, None, seed=i)
            out[i][1] = (captions.get("caption_medium") or captions["caption_long"]).strip() or Path(out[i][0]).stem
            if progress is not None:
                progress(done, len(missing))
