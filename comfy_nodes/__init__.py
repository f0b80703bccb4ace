"""Krea 2 nodes for ComfyUI, over the krea2-diffusers library.

Install: link this folder into ``ComfyUI/custom_nodes/`` (see README.md here). When the library is
not pip-installed, it is imported from the repository this folder sits in.
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("krea2_diffusers") is None:
    sys.path.append(str(Path(__file__).resolve().parent.parent))
    if importlib.util.find_spec("krea2_diffusers") is None:
        raise ImportError("Krea 2 nodes: the krea2-diffusers library is missing. Link this folder from the krea2-diffusers "
                          "repository instead of copying it, or run: pip install -e /path/to/krea2-diffusers")

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
