"""Paired samples for edit and reference LoRAs (``data.references``): each target image with 1 to
``max_references`` reference images and an instruction.

Two ways to give them:

* a folder ``DIR`` with ``DIR/targets/NAME.png`` + ``DIR/targets/NAME.txt`` (the instruction, beside
  its target) and ``DIR/references/NAME.png`` or ``DIR/references/NAME_1.png``, ``NAME_2.png`` ...
  (any image extension; ``NAME.png`` comes first, then ``NAME_k`` by k);
* a JSONL / Parquet manifest whose rows hold ``image`` (or ``path``), ``text`` (or ``caption``)
  and ``references`` (a list of paths relative to the manifest).

Everything a user can get wrong (a target without its reference, a reference that is not an image,
more references than allowed, a reference matching no target) is found here, by reading the files
only, and reported in ONE :class:`DatasetError` naming the files, before any model loads.

A reference keeps its own aspect: its latents are encoded at ``min(its area, max_pixels)`` pixels,
both sides multiples of 16, as the pipeline sizes them
(:func:`~krea2_diffusers.conditioning.reference_images.edit_reference_size`). The rows of one forward
must share one reference layout, so samples are batched by (target bucket, reference sizes)
(:func:`batch_keys`).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Iterable, Sequence

from PIL import Image

from krea2_diffusers.conditioning.reference_images import edit_reference_size

from .config import ReferencesConfig
from .dataset import IMAGE_EXTENSIONS, DatasetError, DatasetScan, Sample, scan_dataset, scan_folder

TARGETS, REFERENCES = "targets", "references"
# Problems listed in the one error message; the rest are counted.
_SHOWN_PROBLEMS = 5


def scan_pairs(path: str | Path, config: ReferencesConfig, key: str = "data.path") -> DatasetScan:
    """The paired samples of a folder or manifest (see the module docstring), every reference
    checked; ``key`` names the config key of ``path`` in messages."""
    path = Path(path)
    if path.is_dir():
        scan = _scan_pair_folder(path, key)
    else:
        scan = scan_dataset(path, key)
    check_pairs(scan.samples, config)
    return scan


def _scan_pair_folder(folder: Path, key: str) -> DatasetScan:
    targets, references = folder / TARGETS, folder / REFERENCES
    if not targets.is_dir() or not references.is_dir():
        raise DatasetError(f"data.references: {key} {folder} must hold {TARGETS}/ (NAME.png with its instruction NAME.txt) "
                           f"and {REFERENCES}/ (NAME.png or NAME_1.png, NAME_2.png ...); "
                           f"found {sorted(p.name + '/' for p in folder.iterdir() if p.is_dir()) or 'no folders'}")
    scan = scan_folder(targets)
    if not scan.samples:
        raise DatasetError(f"no usable targets in {targets} ({scan.summary()}); need images with same-name .txt instructions")
    names = {p.stem for p in targets.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS}
    owned = references_by_name(references, names)
    scan.samples = [dataclasses.replace(s, references=tuple(owned.get(s.image_path.stem, []))) for s in scan.samples]
    return scan


def references_by_name(folder: Path, names: Iterable[str]) -> dict[str, list[Path]]:
    """The files of ``folder`` by the target name they belong to: ``NAME.*`` first, then ``NAME_k.*``
    by k. A file belonging to none of ``names`` is an error (a misspelt name would silently leave
    a target without its reference)."""
    names = set(names)
    owned: dict[str, list[tuple[int, Path]]] = {}
    problems = []
    for file in sorted(p for p in folder.iterdir() if not p.name.startswith(".")):
        owner, order = _owner(file.stem, names)
        if owner is None:
            problems.append(f"{file} belongs to no target (expected a target named {file.stem}, or NAME for NAME_k)")
            continue
        owned.setdefault(owner, []).append((order, file))
    _raise(problems, "the paired samples")
    return {name: [f for _, f in sorted(files)] for name, files in owned.items()}


def _owner(stem: str, names: set[str]) -> tuple[str | None, int]:
    """Which target a reference named ``stem`` belongs to, and its order: ``NAME`` (0) exactly, else
    ``NAME_k`` (k)."""
    if stem in names:
        return stem, 0
    match = re.fullmatch(r"(.+)_(\d+)", stem)
    if match and match.group(1) in names:
        return match.group(1), int(match.group(2))
    return None, 0


def check_pairs(samples: Sequence[Sample], config: ReferencesConfig) -> None:
    """Every sample has 1 to ``max_references`` references, each a readable image; else one error."""
    problems = []
    for sample in samples:
        refs = sample.references
        if not refs:
            problems.append(f"target {sample.image_path} has no reference image (folder: references/{sample.image_path.stem}.png "
                            "or references/NAME_k.png; manifest: a 'references' list)")
        elif len(refs) > config.max_references:
            problems.append(f"target {sample.image_path} has {len(refs)} references ({', '.join(r.name for r in refs)}), "
                            f"more than data.references.max_references={config.max_references}")
        for ref in refs:
            problem = _image_problem(ref)
            if problem:
                problems.append(f"reference {ref} of target {sample.image_path.name} {problem}")
    _raise(problems, "the paired samples")


def check_reference_files(lists: Sequence[Sequence[str]], key: str) -> None:
    """Every path in ``lists`` (e.g. ``validation.reference_images``) is a readable image; else one error."""
    problems = [f"{key}[{i}] {path} {problem}" for i, paths in enumerate(lists) for path in paths
                if (problem := _image_problem(Path(path)))]
    _raise(problems, key)


def _image_problem(path: Path) -> str | None:
    if not path.is_file():
        return "does not exist"
    if path.suffix.lower() not in IMAGE_EXTENSIONS:
        return f"is not an image (extension {path.suffix or 'none'}; expected one of {sorted(IMAGE_EXTENSIONS)})"
    try:
        with Image.open(path) as image:
            image.load()  # decode fully: a truncated file must fail here, not in the cache pass
    except Exception as err:  # PIL raises many types for bad files; all mean "not an image"
        return f"is not an image ({type(err).__name__}: {err})"
    return None


def _raise(problems: list[str], what: str) -> None:
    if problems:
        more = f" (and {len(problems) - _SHOWN_PROBLEMS} more)" if len(problems) > _SHOWN_PROBLEMS else ""
        raise DatasetError(f"data.references: {len(problems)} problem(s) with {what}: "
                           + "; ".join(problems[:_SHOWN_PROBLEMS]) + more)


def reference_sizes(sample: Sample, max_pixels: int) -> tuple[tuple[int, int], ...]:
    """(height, width) in pixels each reference of ``sample`` is encoded at (read from the file headers)."""
    sizes = []
    for ref in sample.references:
        with Image.open(ref) as image:
            sizes.append(edit_reference_size(image.width, image.height, max_pixels))
    return tuple(sizes)


def batch_keys(samples: Sequence[Sample], buckets: Sequence, max_pixels: int) -> list:
    """Per sample its batching key: (target bucket, reference sizes); rows of one batch share both."""
    return [(bucket, reference_sizes(sample, max_pixels)) for sample, bucket in zip(samples, buckets)]
