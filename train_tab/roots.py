"""The folders the Train tab may read images (and base models) from: the data roots the operator
allows with ``python app.py --data-root DIR`` (repeatable; default: the runs folder's parent),
plus the app's upload folder (where uploaded images arrive). That is a private temporary folder the
app gives Gradio (:func:`app.private_upload_folder`), holding this app's uploads only: Gradio's
default, ``<temp>/gradio``, is shared by every Gradio app on the machine, and a root there would
let a request read what other apps' users uploaded (an operator-set ``GRADIO_TEMP_DIR`` is used as
it is, a root then too).

Relative paths in a request are taken from the app's working directory (the folder it was started
in; it never changes), and every path the tab accepts comes back absolute, so the ``train.yaml`` it
writes names the same files from the run folder, where ``krea2 train`` runs.

The app may be exposed (``--share``, ``--host 0.0.0.0``): a path from a request is resolved
(``..`` and symlinks too) and must lie inside a root before anything reads, lists or checks it, and
a refusal names the roots, never what lies outside them (not even whether the path exists).

Base model names (:meth:`DataRoots.base_model`): the app's configured models as they are (made
absolute at start-up when local), ``tiny-random``, hub ids (``owner/name``, when no such local path
exists) and files or folders inside a root (absolute). Anything else is refused before the plan
walks a folder.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from krea2_diffusers.models.tiny import is_tiny

from .errors import TrainInputError

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


class DataRoots:
    """Args:
        roots: the allowed folders (each must exist; duplicates and nested ones are kept once each).
    """

    def __init__(self, roots: Iterable[str | Path]):
        resolved = []
        for root in roots:
            path = Path(root).expanduser().resolve()
            if not path.is_dir():
                raise ValueError(f"data root {root} is not a folder")
            if path not in resolved:
                resolved.append(path)
        if not resolved:
            raise ValueError("at least one data root is needed")
        self.roots: tuple[Path, ...] = tuple(resolved)

    def __str__(self) -> str:
        return ", ".join(str(r) for r in self.roots)

    def contains(self, path: str | Path) -> bool:
        """Whether ``path`` (relative paths: from the working folder), once resolved, lies inside a root."""
        try:
            resolved = Path(path).expanduser().resolve()
        except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop, ~nobody: not a path we read
            return False
        return any(resolved == root or resolved.is_relative_to(root) for root in self.roots)

    def refusal(self, what: str) -> TrainInputError:
        return TrainInputError(f"{what} is outside the allowed data roots ({self}); the app's operator can allow "
                               "another folder with --data-root.")

    def folder(self, folder: str | Path) -> Path:
        """``folder`` (the user's own input, so named in the refusal), absolute, if it lies inside a root."""
        if not self.contains(folder):
            raise self.refusal(str(folder))
        return absolute(folder)

    def image(self, path: str | Path, row: int) -> Path:
        """Row ``row``'s image path, absolute, if it lies inside a root (the refusal names the row, not the file)."""
        if not str(path or "").strip():
            raise TrainInputError(f"Row {row} has no image path.")
        if not self.contains(path):
            raise self.refusal(f"The image of row {row}")
        return absolute(path)

    def base_model(self, name: str, configured: Iterable[str]) -> str:
        """``name`` if it is a base model the tab may plan and train on (see the module docstring),
        a local one as an absolute path."""
        if name in configured or is_tiny(name):
            return name
        if not self.contains(name):
            if HUB_ID.fullmatch(name) and not os.path.lexists(name):
                return name  # read from the Hugging Face hub (or its cache), not from this machine's folders
            raise self.refusal(f"Base model {name!r}")
        return str(absolute(name))


def absolute(path: str | Path) -> Path:
    """``path`` (``~`` expanded) from the working directory, made absolute without following symlinks
    (the name the user gave stays recognisable; :meth:`DataRoots.contains` checks the target)."""
    return Path(os.path.abspath(Path(path).expanduser()))
