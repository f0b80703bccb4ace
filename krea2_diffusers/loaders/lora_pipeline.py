"""``Krea2LoraLoaderMixin``: diffusers' pipeline LoRA API (``LoraBaseMixin``) on our pipelines.

``Krea2Pipeline`` (and so ``Krea2Img2ImgPipeline`` / ``Krea2InpaintPipeline``) takes the calls a
``diffusers.Krea2Pipeline`` user writes, with the same signatures and results::

    pipe.load_lora_weights("style.safetensors", adapter_name="style")
    pipe.load_lora_weights("brand.safetensors", adapter_name="brand")
    pipe.set_adapters(["style", "brand"], adapter_weights=[0.8, 0.5])
    pipe.fuse_lora(lora_scale=0.8)        # merged into the base weights: no LoRA cost per step
    pipe.unfuse_lora()                    # the base weights back, bit for bit
    pipe.disable_lora(); pipe.enable_lora(); pipe.delete_adapters("brand")
    pipe.get_active_adapters()            # ["style"]
    pipe.get_list_adapters()              # {"transformer": ["style"]}

Only the transformer takes adapters (``components`` other than ``["transformer"]`` are refused).
Beyond diffusers: ``load_lora_weights`` reads every format of :mod:`.lora` (diffusers/PEFT,
ComfyUI/ai-toolkit, kohya, LyCORIS LoKr/LoHa), returns the adapter name, and its ``strength=``
adds the adapter at that weight beside the active ones (diffusers activates only the newest).
How the state behind these calls is kept, and where it is exact where diffusers is not:
:mod:`.adapters`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Mapping

import torch

from . import adapters

LORA_COMPONENTS = ("transformer",)


def _checked_components(components) -> None:
    if not components:
        raise ValueError("`components` cannot be an empty list.")
    unknown = [c for c in components if c not in LORA_COMPONENTS]
    if unknown:
        raise ValueError(f"{unknown} cannot take LoRAs; Krea 2 pipelines load them into {list(LORA_COMPONENTS)}")


class Krea2LoraLoaderMixin:
    """diffusers' ``LoraBaseMixin`` calls for a pipeline whose ``transformer`` takes the LoRAs."""

    # ------------------------------------------------------------------ loading
    def load_lora_weights(self, pretrained_model_name_or_path_or_dict: str | Path | Mapping[str, torch.Tensor],
                          adapter_name: str | None = None, strength: float = 1.0, **kwargs) -> str:
        """Load a LoRA (diffusers/PEFT, ComfyUI/native, kohya or LyCORIS; a ``.safetensors`` file, a
        folder holding one, or a state dict) onto the transformer as adapter ``adapter_name``
        (default ``lora_<n>``), active at ``strength`` beside the adapters already active. Returns the
        adapter name. ``weight_name=`` picks a file in a folder."""
        from .lora import load_lora_into_transformer

        return load_lora_into_transformer(self.transformer, pretrained_model_name_or_path_or_dict,
                                          adapter_name=adapter_name, strength=strength, **kwargs)

    def unload_lora_weights(self) -> None:
        """Remove every LoRA loaded with :meth:`load_lora_weights`. Unfused, the base weights were never
        modified; fused ones stay in the base weights (diffusers' ``fuse_lora`` then ``unload_lora_weights``)."""
        adapters.unload_loras(self.transformer)

    # ------------------------------------------------------------------ weights
    def set_adapters(self, adapter_names: list[str] | str,
                     adapter_weights: float | dict | list[float] | list[dict] | None = None) -> None:
        """Make exactly ``adapter_names`` active, at ``adapter_weights`` (one for all, or one each; None
        is 1.0; a dict is ``{"transformer": weight}``). The others stay loaded, inactive."""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        weights = copy.deepcopy(adapter_weights)
        if not isinstance(weights, list):
            weights = [weights] * len(names)
        if len(names) != len(weights):
            raise ValueError(f"Length of adapter names {len(names)} is not equal to the length of the weights {len(weights)}")
        missing = set(names) - set(adapters.all_adapters(self.transformer))
        if missing:
            raise ValueError(f"Adapter name(s) {missing} not in the list of present adapters: "
                             f"{set(adapters.all_adapters(self.transformer))}.")
        # A dict is keyed by component, as in diffusers: {"transformer": weight} (absent: 1.0).
        weights = [w.get("transformer") if isinstance(w, dict) else w for w in weights]
        adapters.activate(self.transformer, dict(zip(names, weights)))

    def disable_lora(self) -> None:
        """Every adapter off; their names and weights are kept for :meth:`enable_lora`. Fused adapters are
        unfused first (the base weights back bit for bit), as diffusers' layers unmerge when disabled."""
        adapters.disable(self.transformer)

    def enable_lora(self) -> None:
        """The active adapters on again, at their weights."""
        adapters.enable(self.transformer)

    def delete_adapters(self, adapter_names: list[str] | str) -> None:
        """Remove adapters; the others keep their weights. Fused adapters may only go all together (they
        then stay in the base weights, as in diffusers)."""
        adapters.delete_lora(self.transformer, adapter_names)

    def get_active_adapters(self) -> list[str]:
        """The active adapters' names, e.g. ``["style", "brand"]``."""
        return adapters.active_adapters(self.transformer)

    def get_list_adapters(self) -> dict[str, list[str]]:
        """Every loaded adapter by component: ``{"transformer": [names]}`` (``{}`` before any was added)."""
        if not hasattr(self.transformer, "peft_config"):
            return {}
        return {"transformer": adapters.all_adapters(self.transformer)}

    # ------------------------------------------------------------------ fusing
    def fuse_lora(self, components: list[str] = ["transformer"], lora_scale: float = 1.0, safe_fusing: bool = False,
                  adapter_names: list[str] | None = None, **kwargs) -> None:
        """Merge the active adapters (or ``adapter_names``), times ``lora_scale``, into the base weights.

        As in diffusers, ``lora_scale`` also multiplies the active adapters' weights, which stay so
        after :meth:`unfuse_lora` (``set_adapters`` sets them again), and a per-call
        ``attention_kwargs={"scale": s}`` no longer reaches fused adapters. The original weights
        are kept (a CPU copy of each fused layer) so that :meth:`unfuse_lora` restores them exactly.
        ``safe_fusing``: refuse (and change nothing) if a merged weight would hold NaN. Quantized
        bases (fp8, GGUF, bitsandbytes) are refused naming the layer: there the LoRA applies unfused.
        """
        _checked_components(components)
        adapters.fuse(self.transformer, lora_scale=lora_scale, safe_fusing=safe_fusing, adapter_names=adapter_names)

    def unfuse_lora(self, components: list[str] = ["transformer"], **kwargs) -> None:
        """Undo :meth:`fuse_lora`: the base weights come back bit for bit; the adapters stay loaded."""
        _checked_components(components)
        adapters.unfuse(self.transformer)

    @property
    def fused_loras(self) -> set[str]:
        """Names of the adapters merged into the base weights."""
        return adapters.fused_adapters(self.transformer)

    @property
    def num_fused_loras(self) -> int:
        return len(self.fused_loras)
