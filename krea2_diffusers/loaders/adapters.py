"""The state of the PEFT adapters on a transformer: which are active at what weight, fusing them
into the base weights and back, and the per-call scale (``attention_kwargs={"scale": s}``).

:mod:`.lora` reads LoRA / LoKr / LoHa files and adds each as a PEFT adapter; this module is what
happens to them afterwards. Beside PEFT's own layers it keeps, per transformer, an
:class:`AdapterState`: the adapters this loader added (what ``unload_loras`` removes), the active
ones with their weights (a newly loaded adapter joins them at its ``strength``), and the original
weights of the layers ``fuse`` changed.

Semantics follow diffusers' ``LoraBaseMixin`` / ``PeftAdapterMixin`` (what the pipeline API in
:mod:`.lora_pipeline` promises), with three differences, all exact where diffusers is approximate:

* ``unfuse`` writes the saved original weights back (bit for bit) instead of subtracting the
  merged delta again (float addition does not round-trip);
* the per-call scale saves and restores every layer's scaling instead of dividing it back out
  (diffusers resets the weights to 1.0 after a call with scale 0);
* fusing into a quantized base (fp8, GGUF, bitsandbytes) is refused naming the layer, instead of
  writing a float delta into packed bytes or re-quantizing.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn

# Base-layer weight dtypes a merged delta can be added to exactly as PEFT computes it.
FUSABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class LoraFuseError(ValueError):
    """``fuse_lora`` cannot merge into a layer (a quantized base, or disabled adapters); the message names it."""


@dataclass
class AdapterState:
    """What this loader keeps beside PEFT's layers on one transformer.

    Attributes:
        loaded: adapters added by :mod:`.lora` (``unload_loras`` removes these and no others, e.g. not a
            training run's own adapter).
        weights: the active adapters -> weight (a float, or diffusers' per-layer dict), in activation order.
        originals: each base layer ``fuse`` changed -> its (weight, bias) before fusing, CPU copies.
    """

    loaded: list[str] = field(default_factory=list)
    weights: dict[str, Any] = field(default_factory=dict)
    originals: dict[nn.Module, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)


def adapter_state(transformer: nn.Module) -> AdapterState:
    state = getattr(transformer, "_krea2_adapters", None)
    if state is None:
        state = AdapterState()
        transformer._krea2_adapters = state
    return state


def tuner_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every PEFT adapter layer (LoRA, LoKr, LoHa; nested ones each count)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


def all_adapters(transformer: nn.Module) -> list[str]:
    """Every adapter on ``transformer``, in loading order."""
    return list(getattr(transformer, "peft_config", None) or {})


def active_adapters(transformer: nn.Module) -> list[str]:
    """The active adapters, as the first adapter layer lists them (diffusers' ``get_active_adapters``)."""
    layers = tuner_layers(transformer)
    return list(layers[0][1].active_adapters) if layers else []


def fused_adapters(transformer: nn.Module) -> set[str]:
    """Adapters merged into the base weights of at least one layer."""
    return {name for _, layer in tuner_layers(transformer) for name in layer.merged_adapters}


def scaled_weight(weight, factor: float):
    """An adapter weight (float or per-layer dict) times ``factor``."""
    if isinstance(weight, Mapping):
        return {key: scaled_weight(value, factor) for key, value in weight.items()}
    return weight * factor


# ------------------------------------------------------------------------------------------
# Which adapters are active


def activate(transformer: nn.Module, weights: Mapping[str, Any]) -> None:
    """Make exactly ``weights``' adapters active, each at its weight (None: 1.0); the others stay loaded."""
    unknown = sorted(set(weights) - set(all_adapters(transformer)))
    if unknown:
        raise ValueError(f"no adapter named {unknown}; loaded: {all_adapters(transformer)}")
    state = adapter_state(transformer)
    state.weights = {name: 1.0 if weight is None else weight for name, weight in weights.items()}
    transformer.set_adapters(list(state.weights), weights=list(state.weights.values()))


def join_active(transformer: nn.Module, adapter_name: str, strength: float) -> None:
    """Record ``adapter_name`` (just added by this loader) and activate it at ``strength`` beside the active ones."""
    state = adapter_state(transformer)
    state.loaded.append(adapter_name)
    activate(transformer, {**state.weights, adapter_name: float(strength)})


def set_lora_strength(transformer: nn.Module, adapter_name: str, strength: float) -> None:
    """Set one adapter's weight (activating it if it was not), the others keep theirs."""
    if adapter_name not in all_adapters(transformer):
        raise KeyError(f"no adapter {adapter_name!r}; loaded: {all_adapters(transformer)}")
    activate(transformer, {**adapter_state(transformer).weights, adapter_name: float(strength)})


def delete_lora(transformer: nn.Module, names: str | Iterable[str]) -> None:
    """Remove adapters (the others keep their weights). An adapter fused into the base weights stays
    there when every fused adapter goes (diffusers' fuse-then-unload); deleting only some of them is
    refused, since the others could no longer be unfused exactly."""
    names = [names] if isinstance(names, str) else list(names)
    unknown = sorted(set(names) - set(all_adapters(transformer)))
    if unknown:
        raise ValueError(f"no adapter named {unknown}; loaded: {all_adapters(transformer)}")
    fused = fused_adapters(transformer)
    if fused & set(names):
        if not fused <= set(names):
            raise ValueError(f"adapters {sorted(fused)} are fused into the same base weights: unfuse_lora() before deleting "
                             f"{sorted(fused & set(names))}, or delete all of them to keep them fused")
        keep_fused(transformer)
    transformer.delete_adapters(names)
    state = adapter_state(transformer)
    state.loaded = [name for name in state.loaded if name not in names]
    # PEFT keeps the remaining active adapters active at their scaling: only the record changes.
    state.weights = {name: weight for name, weight in state.weights.items() if name not in names}
    if not all_adapters(transformer):
        # The last one gone: put the base layers back in place of PEFT's empty wrappers (diffusers'
        # unload_lora), so the state dict has its own keys again (``to_q.weight``, not
        # ``to_q.base_layer.weight``) and a later save or conversion sees the plain transformer.
        transformer.unload_lora()
        state.originals.clear()


def unload_loras(transformer: nn.Module) -> None:
    """Remove every adapter this loader added (fused ones stay in the base weights, as in diffusers)."""
    present = set(all_adapters(transformer))
    names = [name for name in adapter_state(transformer).loaded if name in present]
    if names:
        delete_lora(transformer, names)
    adapter_state(transformer).loaded = []


# ------------------------------------------------------------------------------------------
# Fusing


def fusable(base: nn.Module) -> bool:
    """A plain float ``nn.Linear``: quantized layers subclass it (fp8, GGUF) or replace it (bitsandbytes)."""
    return type(base) is nn.Linear and base.weight.dtype in FUSABLE_DTYPES


def fuse(transformer: nn.Module, lora_scale: float = 1.0, safe_fusing: bool = False,
         adapter_names: list[str] | None = None) -> None:
    """diffusers' ``fuse_lora`` on ``transformer``: every layer's active adapters are scaled by
    ``lora_scale`` (the scaling stays so, unfused or not, as in diffusers), then ``adapter_names``
    (default: the active ones) are merged into the base weights. The bases' original weights are kept
    (CPU copies, as much memory as the fused layers) for :func:`unfuse`. All or nothing: a refused
    layer or a NaN found by ``safe_fusing`` leaves the transformer as it was."""
    layers = tuner_layers(transformer)
    if adapter_names is not None:
        unknown = sorted(set(adapter_names) - set(all_adapters(transformer)))
        if unknown:
            raise ValueError(f"no adapter named {unknown}; loaded: {all_adapters(transformer)}")
    targets = []
    for name, layer in layers:
        wanted = adapter_names if adapter_names is not None else layer.active_adapters
        if not any(a in layer.scaling and a not in layer.merged_adapters for a in wanted):
            continue
        if layer.disable_adapters:
            raise LoraFuseError("the LoRAs are disabled (disable_lora): enable_lora() before fuse_lora()")
        base = layer.get_base_layer()
        if not fusable(base):
            raise LoraFuseError(
                f"fuse_lora cannot merge into {name!r}: its base layer is {type(base).__name__} ({base.weight.dtype} "
                "weights), not a float nn.Linear. Quantized bases (fp8, GGUF, bitsandbytes) keep their LoRAs unfused: "
                "they apply on top of the quantized weights as they are")
        targets.append(base)
    state = adapter_state(transformer)
    before = [(layer, dict(layer.scaling), list(layer.merged_adapters)) for _, layer in layers]
    current = {base: copied(base) for base in dict.fromkeys(targets)}  # what a failure goes back to
    new = [base for base in current if base not in state.originals]
    state.originals.update({base: current[base] for base in new})  # a later fuse adds on top of the first's originals
    try:
        transformer.fuse_lora(lora_scale, safe_fusing=safe_fusing, adapter_names=adapter_names)
    except Exception:
        for layer, scaling, merged in before:
            layer.scaling.update(scaling)
            layer.merged_adapters[:] = merged
        for base, weights in current.items():
            restore(base, weights)
        for base in new:
            del state.originals[base]
        raise
    if lora_scale != 1.0:  # PEFT scaled every active adapter's scaling: the record follows
        state.weights = {name: scaled_weight(weight, lora_scale) for name, weight in state.weights.items()}


def copied(base: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's (weight, bias) as CPU copies."""
    bias = None if base.bias is None else base.bias.detach().to("cpu", copy=True)
    return base.weight.detach().to("cpu", copy=True), bias


def restore(base: nn.Module, original: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    weight, bias = original
    with torch.no_grad():
        base.weight.copy_(weight)
        if bias is not None:
            base.bias.copy_(bias)


def unfuse(transformer: nn.Module) -> None:
    """Undo :func:`fuse`: the base weights come back bit for bit; the adapters stay loaded, unmerged."""
    for _, layer in tuner_layers(transformer):
        if layer.merged:
            layer.unmerge()  # PEFT's own bookkeeping (DoRA caches); the bits come from the saved copies below
    state = adapter_state(transformer)
    for base, original in state.originals.items():
        restore(base, original)
    state.originals.clear()


def keep_fused(transformer: nn.Module) -> None:
    """Make the fused weights the base (diffusers' fuse-then-unload): the saved originals are dropped."""
    for _, layer in tuner_layers(transformer):
        layer.merged_adapters.clear()
    adapter_state(transformer).originals.clear()


def disable(transformer: nn.Module) -> None:
    """Every adapter off, weights kept. Fused ones are unfused first (diffusers' layers unmerge on
    their next call when disabled; here the originals come back exactly)."""
    if adapter_state(transformer).originals or fused_adapters(transformer):
        unfuse(transformer)
    transformer.disable_lora()


def enable(transformer: nn.Module) -> None:
    transformer.enable_lora()


# ------------------------------------------------------------------------------------------
# Per-call scale


@contextlib.contextmanager
def scaled_adapters(model: nn.Module, scale: float):
    """Inside the block every active adapter acts at ``scale`` times its weight; afterwards each
    layer's scaling is what it was, exactly (saved, not divided back out)."""
    if scale == 1.0:
        yield
        return
    layers = [layer for _, layer in tuner_layers(model)]
    saved = [dict(layer.scaling) for layer in layers]
    try:
        for layer in layers:
            layer.scale_layer(scale)
        yield
    finally:
        for layer, scaling in zip(layers, saved):
            layer.scaling.update(scaling)


def per_call_lora_scale(method):
    """Decorator of a model method taking ``attention_kwargs``: ``{"scale": s}`` runs the call under
    :func:`scaled_adapters` (diffusers' ``apply_lora_scale``); the method gets the rest of the dict."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        attention_kwargs = kwargs.get("attention_kwargs")
        scale = 1.0
        if attention_kwargs is not None:
            attention_kwargs = dict(attention_kwargs)
            scale = attention_kwargs.pop("scale", 1.0)
            kwargs["attention_kwargs"] = attention_kwargs
        with scaled_adapters(self, scale):
            return method(self, *args, **kwargs)

    return wrapper
