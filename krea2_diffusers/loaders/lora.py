"""LoRA files in every format Krea 2 users have, loaded onto our transformer through PEFT.

Formats (ECOSYSTEM.md), detected per key:

==========  =========================================================  ===================
format      example key                                                alpha
==========  =========================================================  ===================
diffusers   ``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``  = rank (or metadata)
native      ``diffusion_model.blocks.0.attn.wq.lora_A.weight``            = rank
            (ComfyUI; also ``base_model.model.`` from ai-toolkit)
kohya       ``lora_unet_blocks_0_attn_wq.lora_down.weight`` / ``lora_up`` per-module ``.alpha``
==========  =========================================================  ===================

LoKr and LoHa (LyCORIS: ``.lokr_w1``, ``.lokr_w2_a`` ..., ``.hada_w1_a`` ...) are read under any
of these module spellings (and SimpleTuner's ``lycoris_<diffusers_name>``); their math is in
:mod:`.lycoris`, and they load as PEFT LoKr / LoHa adapters.

Kohya names are matched against a table built from the transformer's own module names (each
original name with dots turned to underscores), never by guessing where underscores were dots,
so ``txtfusion_layerwise_blocks_0_attn_wq`` maps back correctly.

On load, each module's ``alpha / rank`` is folded into ``lora_B``, so the adapter is stored at
alpha = rank and every exporter writes files whose effect does not depend on how a reader treats
alpha. Only safetensors files are read: pickled LoRAs can run code and are refused.

What happens to an adapter once added (weights, fusing, deletion) is :mod:`.adapters`; the
pipelines' diffusers-style API over both is :mod:`.lora_pipeline`.
"""

from __future__ import annotations

import difflib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from ..files import save_safetensors
from .convert import UnknownKeyError, diffusers_module_to_original
from .adapters import join_active
# Re-exported: the adapters' later life (weights, deletion) lives in .adapters; callers import them from here.
from .adapters import delete_lora, set_lora_strength, unload_loras  # noqa: F401
from .lycoris import ROLES, TUCKER_ROLES, LycorisLayer, add_lycoris_adapter, kind_of

# Key suffix -> role. Longest first so ".lora_A.default.weight" never reads as ".weight".
_SUFFIXES = (
    (".lora_A.default.weight", "A"), (".lora_B.default.weight", "B"),
    (".lora_A.weight", "A"), (".lora_B.weight", "B"),
    (".lora_down.weight", "A"), (".lora_up.weight", "B"),
    (".lora_magnitude_vector.default.weight", "magnitude"), (".lora_magnitude_vector.weight", "magnitude"),
    (".lora_magnitude_vector", "magnitude"), (".dora_scale", "magnitude"),
    (".alpha", "alpha"),
    # LoKr / LoHa tensors, bare (files) or under PEFT's adapter name (a training run's state).
    *((f".{role}{tail}", role) for role in (*ROLES["lokr"], *ROLES["loha"], *TUCKER_ROLES) for tail in (".default", "")),
)
# PEFT's name prefixes of the adapters' parameters and sub-modules (LoRA, LoKr, LoHa).
ADAPTER_PREFIXES = ("lora_", "lokr_", "hada_")
_PREFIXES = ("transformer.", "base_model.model.", "model.diffusion_model.", "diffusion_model.")
KOHYA_PREFIX = "lora_unet_"
DIFFUSERS_PREFIX = "transformer."
COMFYUI_PREFIX = "diffusion_model."


class LoraFormatError(ValueError):
    """A LoRA file that cannot be applied; the message names the key at fault."""


@dataclass
class LoraLayer:
    """One adapted linear layer. ``down`` (r, in), ``up`` (out, r); effect ``scale * up @ down``."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float | None = None
    magnitude: torch.Tensor | None = None  # DoRA: (out,) per-output-row magnitude

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None else self.alpha / self.rank

    def folded(self) -> "LoraLayer":
        """The same effect with alpha = rank (scale folded into ``up``)."""
        return LoraLayer(self.down, self.up * self.scale, None, self.magnitude)

    def is_zero(self) -> bool:
        return not bool(self.up.any())


# ------------------------------------------------------------------------------------------
# Reading


def read_lora_file(path: str | Path, weight_name: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and ``__metadata__`` of a ``.safetensors`` LoRA (a folder needs one such file or ``weight_name``)."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        candidates = [path / weight_name] if weight_name else sorted(path.glob("*.safetensors"))
        if len(candidates) != 1:
            raise LoraFormatError(f"{path}: expected exactly one .safetensors LoRA file (or pass weight_name), found {[c.name for c in candidates]}")
        path = candidates[0]
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file {str(path)!r} not found")
    if path.suffix != ".safetensors":
        raise LoraFormatError(f"{path.name}: only .safetensors LoRA files are loaded (pickled .bin/.pt/.ckpt files can run code)")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    return tensors, metadata


def _base_layer(module: nn.Module) -> nn.Module:
    """The original layer under PEFT's wrappers (one per adapter kind loaded: LoKr over LoRA nests)."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def _is_linear(module: nn.Module) -> bool:
    """A plain linear layer, or one PEFT already wrapped (it keeps the original as ``base_layer``)."""
    return isinstance(_base_layer(module), nn.Linear)


def _linear_shape(module: nn.Module) -> tuple[int, int]:
    base = _base_layer(module)
    return base.out_features, base.in_features


def _module_table(transformer: nn.Module) -> dict[str, str]:
    """Every accepted spelling of every linear layer -> its diffusers name."""
    table: dict[str, str] = {}
    for name, module in transformer.named_modules():
        if not _is_linear(module) or ".lora_" in name or ".base_layer" in name:
            continue
        table[name] = name
        try:
            original = diffusers_module_to_original(name)
        except UnknownKeyError:
            continue
        table[original] = name
        table[KOHYA_PREFIX + original.replace(".", "_")] = name
        # Some tools flatten the diffusers names instead of the original ones.
        table[KOHYA_PREFIX + name.replace(".", "_")] = name
        table["lora_transformer_" + name.replace(".", "_")] = name
        table["lycoris_" + name.replace(".", "_")] = name  # SimpleTuner's LyCORIS files
    return table


def _split_key(key: str) -> tuple[str, str]:
    for suffix, role in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    raise LoraFormatError(
        f"unrecognised LoRA key {key!r}: expected lora_A/lora_B, lora_down/lora_up, alpha, dora_scale, "
        "lokr_w1/lokr_w2 (or their _a/_b factors) or hada_w1_a/_b, hada_w2_a/_b (fused-QKV files are not supported)"
    )


def _strip_prefixes(module: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if module.startswith(prefix):
                module, changed = module[len(prefix):], True
    return module


def detect_format(keys) -> str:
    """``"kohya"``, ``"native"`` (ComfyUI / ai-toolkit) or ``"diffusers"``, from the key spelling."""
    keys = list(keys)
    if any(k.startswith(("lora_unet_", "lora_transformer_", "lycoris_")) for k in keys):
        return "kohya"
    if any(k.startswith(("diffusion_model.", "model.diffusion_model.", "base_model.model.")) for k in keys):
        return "native"
    return "diffusers"


def parse_lora_state_dict(
    state_dict: Mapping[str, torch.Tensor], transformer: nn.Module, metadata: Mapping[str, str] | None = None
) -> dict[str, LoraLayer | LycorisLayer]:
    """Any supported format -> ``{diffusers module name: LoraLayer or LycorisLayer}``, with shapes
    checked against ``transformer``. Raises :class:`LoraFormatError` naming the offending key."""
    table = _module_table(transformer)
    modules = dict(transformer.named_modules())
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        module_key, role = _split_key(key)
        bare = _strip_prefixes(module_key)
        target = table.get(bare)
        if target is None:
            close = difflib.get_close_matches(bare, list(table), n=1)
            hint = f"; closest layer: {close[0]!r}" if close else ""
            raise LoraFormatError(f"LoRA key {key!r} names no linear layer of this transformer{hint}")
        if role in parts.setdefault(target, {}):
            raise LoraFormatError(f"LoRA key {key!r}: layer {target!r} already has a {role} tensor (two spellings of one layer?)")
        parts[target][role] = tensor

    default_alpha = _metadata_alpha(metadata)
    layers: dict[str, LoraLayer | LycorisLayer] = {}
    for target, p in parts.items():
        kind = kind_of(p)
        if kind is not None or any(role in TUCKER_ROLES for role in p):
            try:
                layers[target] = LycorisLayer.from_file(p, *_linear_shape(modules[target]))
            except ValueError as err:
                raise LoraFormatError(f"LoRA layer {target!r} ({kind or 'tucker'}): {err}") from None
            continue
        if "A" not in p or "B" not in p:
            missing = "down/lora_A" if "A" not in p else "up/lora_B"
            raise LoraFormatError(f"LoRA layer {target!r} lacks its {missing} tensor")
        down, up = p["A"], p["B"]
        out_features, in_features = _linear_shape(modules[target])
        if down.ndim != 2 or up.ndim != 2 or down.shape[1] != in_features or up.shape[0] != out_features or up.shape[1] != down.shape[0]:
            raise LoraFormatError(
                f"LoRA layer {target!r}: down {tuple(down.shape)} / up {tuple(up.shape)} do not fit a "
                f"{in_features}->{out_features} linear layer"
            )
        for role, tensor in p.items():
            if not torch.isfinite(tensor.float()).all():
                raise LoraFormatError(f"LoRA layer {target!r}: the {role} tensor holds NaN or inf values")
        alpha = float(p["alpha"].reshape(-1)[0]) if "alpha" in p else default_alpha
        magnitude = p["magnitude"].reshape(-1) if "magnitude" in p else None
        layers[target] = LoraLayer(down, up, alpha, magnitude)
    if not layers:
        raise LoraFormatError("the LoRA file holds no LoRA tensors")
    return layers


def _metadata_alpha(metadata: Mapping[str, str] | None) -> float | None:
    """A uniform alpha recorded by diffusers (``lora_adapter_metadata``) or us (``krea2.alpha``)."""
    if not metadata:
        return None
    if "lora_adapter_metadata" in metadata:
        try:
            config = json.loads(metadata["lora_adapter_metadata"])
            alpha = config.get("transformer.lora_alpha", config.get("lora_alpha"))
            if alpha is not None:
                return float(alpha)
        except (ValueError, AttributeError):
            pass
    return None


# ------------------------------------------------------------------------------------------
# Applying


def _unique_adapter_name(transformer: nn.Module, adapter_name: str | None) -> str:
    existing = set(getattr(transformer, "peft_config", {}) or {})
    if adapter_name is not None:
        if adapter_name in existing:
            raise ValueError(f"adapter {adapter_name!r} is already loaded; pick another adapter_name")
        return adapter_name
    index = len(existing)
    while f"lora_{index}" in existing:
        index += 1
    return f"lora_{index}"


def apply_lora_layers(transformer: nn.Module, layers: Mapping[str, LoraLayer | LycorisLayer], adapter_name: str | None = None,
                      strength: float = 1.0) -> str:
    """Inject ``layers`` (LoRA, or all LoKr, or all LoHa) as one PEFT adapter and activate it at
    ``strength`` beside the active ones (:func:`.adapters.join_active`)."""
    if not layers:
        raise LoraFormatError(f"no LoRA layers to apply as adapter {adapter_name!r} (an empty state dict?)")
    kinds = sorted({getattr(layer, "kind", "lora") for layer in layers.values()})
    if len(kinds) > 1:
        raise LoraFormatError(f"the LoRA file mixes {' and '.join(kinds)} layers; one adapter holds one kind")
    name = _unique_adapter_name(transformer, adapter_name)
    if kinds == ["lora"]:
        _add_lora_adapter(transformer, layers, name)
    else:
        try:
            add_lycoris_adapter(transformer, layers, name)
        except ValueError as err:
            raise LoraFormatError(str(err)) from None
    join_active(transformer, name, strength)
    return name


def _add_lora_adapter(transformer: nn.Module, layers: Mapping[str, LoraLayer], name: str) -> None:
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    folded = {m: layer.folded() for m, layer in layers.items()}
    ranks = Counter(layer.rank for layer in folded.values())
    rank = ranks.most_common(1)[0][0]
    pattern = {m: l.rank for m, l in folded.items() if l.rank != rank}
    use_dora = any(l.magnitude is not None for l in folded.values())
    config = LoraConfig(
        r=rank, lora_alpha=rank, rank_pattern=pattern, alpha_pattern=dict(pattern),
        target_modules=sorted(folded), use_dora=use_dora, init_lora_weights=False,
    )
    transformer.add_adapter(config, adapter_name=name)
    # No dtype cast here: PEFT keeps adapters in float32 over a bf16 base and copies into them.
    peft_state = {}
    for module, layer in folded.items():
        peft_state[f"{module}.lora_A.weight"] = layer.down
        peft_state[f"{module}.lora_B.weight"] = layer.up
        if layer.magnitude is not None:
            peft_state[f"{module}.lora_magnitude_vector"] = layer.magnitude
    result = set_peft_model_state_dict(transformer, peft_state, adapter_name=name)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise LoraFormatError(f"PEFT did not accept LoRA tensors, e.g. {unexpected[:3]}")


def load_lora_into_transformer(
    transformer: nn.Module,
    state_dict_or_path: str | Path | Mapping[str, torch.Tensor],
    adapter_name: str | None = None,
    strength: float = 1.0,
    *,
    weight_name: str | None = None,
) -> str:
    """Load a diffusers/PEFT, native/ComfyUI (incl. ai-toolkit ``base_model.model.``) or kohya LoRA.

    Args:
        transformer: a Krea 2 transformer (ours or diffusers'); adapters are added through PEFT.
        state_dict_or_path: a ``.safetensors`` file, a folder holding one, or a state dict.
        adapter_name: defaults to ``lora_<n>``.
        strength: multiplier of the LoRA's effect (1 = as trained); change later with :func:`set_lora_strength`.
    Returns:
        The adapter name.
    """
    if isinstance(state_dict_or_path, Mapping):
        state_dict, metadata = dict(state_dict_or_path), {}
    else:
        state_dict, metadata = read_lora_file(state_dict_or_path, weight_name)
    layers = parse_lora_state_dict(state_dict, transformer, metadata)
    return apply_lora_layers(transformer, layers, adapter_name, strength)


# ------------------------------------------------------------------------------------------
# Exporting


def lora_layers_from_peft(transformer: nn.Module, adapter_name: str = "default") -> dict[str, LoraLayer]:
    """The trained adapter as ``{diffusers module: LoraLayer}`` with alpha folded in (alpha = rank)."""
    layers: dict[str, LoraLayer] = {}
    for name, module in transformer.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict) or adapter_name not in lora_a:
            continue
        down = lora_a[adapter_name].weight.detach().float().cpu()
        up = module.lora_B[adapter_name].weight.detach().float().cpu() * float(module.scaling[adapter_name])
        magnitude = None
        if getattr(module, "lora_magnitude_vector", None) and adapter_name in module.lora_magnitude_vector:
            magnitude = module.lora_magnitude_vector[adapter_name].weight.detach().float().cpu()
        layers[name] = LoraLayer(down.clone(), up.clone(), None, None if magnitude is None else magnitude.clone())
    if not layers:
        raise ValueError(f"the transformer has no LoRA adapter named {adapter_name!r}")
    return layers


def lora_layers_from_diffusers_state_dict(state_dict: Mapping[str, torch.Tensor], alpha: float | None,
                                          rank: int) -> dict[str, LoraLayer | LycorisLayer]:
    """A PEFT adapter's state by parameter name (``transformer_blocks.0.attn.to_q.lora_A.weight`` or
    ``...lokr_w1.default``) -> layers, folded. PEFT scales LoRA, LoKr and LoHa by ``alpha / rank``."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        module, role = _split_key(key)
        parts.setdefault(_strip_prefixes(module), {})[role] = tensor.detach().float().cpu()
    scale = 1.0 if alpha is None else alpha / rank
    return {
        m: LycorisLayer.from_peft(p, scale) if kind_of(p) else LoraLayer(p["A"], p["B"], alpha, p.get("magnitude")).folded()
        for m, p in parts.items()
    }


def to_diffusers_format(layers: Mapping[str, LoraLayer | LycorisLayer]) -> dict[str, torch.Tensor]:
    """``transformer.<diffusers name>.lora_A/lora_B.weight`` (alpha = rank); LoKr/LoHa:
    ``transformer.<diffusers name>.lokr_w1`` ... + ``.alpha`` (no diffusers standard; ComfyUI and ours read it)."""
    out = {}
    for module, layer in layers.items():
        if isinstance(layer, LycorisLayer):
            out.update(layer.state_dict(DIFFUSERS_PREFIX + module))
            continue
        layer = layer.folded()
        out[f"{DIFFUSERS_PREFIX}{module}.lora_A.weight"] = layer.down.contiguous()
        out[f"{DIFFUSERS_PREFIX}{module}.lora_B.weight"] = layer.up.contiguous()
        if layer.magnitude is not None:
            out[f"{DIFFUSERS_PREFIX}{module}.lora_magnitude_vector"] = layer.magnitude.contiguous()
    return out


def to_comfyui_format(layers: Mapping[str, LoraLayer | LycorisLayer]) -> dict[str, torch.Tensor]:
    """``diffusion_model.<original name>.lora_A/lora_B.weight`` (no alpha, so alpha = rank); LoKr/LoHa:
    ``diffusion_model.<original name>.lokr_w1`` ... + ``.alpha`` (= rank, folded)."""
    out = {}
    for module, layer in layers.items():
        base = COMFYUI_PREFIX + diffusers_module_to_original(module)
        if isinstance(layer, LycorisLayer):
            out.update(layer.state_dict(base))
            continue
        layer = layer.folded()
        out[f"{base}.lora_A.weight"] = layer.down.contiguous()
        out[f"{base}.lora_B.weight"] = layer.up.contiguous()
        if layer.magnitude is not None:
            out[f"{base}.dora_scale"] = layer.magnitude.reshape(-1, 1).contiguous()
    return out


def to_kohya_format(layers: Mapping[str, LoraLayer | LycorisLayer]) -> dict[str, torch.Tensor]:
    """``lora_unet_<original_name_with_underscores>.lora_down/lora_up.weight`` plus ``.alpha`` (= rank);
    LoKr/LoHa in LyCORIS's spelling: ``lora_unet_<...>.lokr_w1`` ... + ``.alpha`` (= rank, folded)."""
    out = {}
    for module, layer in layers.items():
        base = KOHYA_PREFIX + diffusers_module_to_original(module).replace(".", "_")
        if isinstance(layer, LycorisLayer):
            out.update(layer.state_dict(base))
            continue
        layer = layer.folded()
        out[f"{base}.lora_down.weight"] = layer.down.contiguous()
        out[f"{base}.lora_up.weight"] = layer.up.contiguous()
        out[f"{base}.alpha"] = torch.tensor(float(layer.rank))
        if layer.magnitude is not None:
            out[f"{base}.dora_scale"] = layer.magnitude.reshape(-1, 1).contiguous()
    return out


FORMATS = {"diffusers": to_diffusers_format, "comfyui": to_comfyui_format, "kohya": to_kohya_format}


def lora_metadata(layers: Mapping[str, LoraLayer], fmt: str, base_model: str, trained_alpha: float | None = None,
                  trigger_words=(), steps: int | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """String metadata for the safetensors header: ours (``krea2.*``) plus the kohya ``ss_*`` names UIs display."""
    ranks = sorted({layer.rank for layer in layers.values() if layer.rank is not None}) or [0]  # 0: LoKr, all whole
    rank = max(ranks)
    meta = {
        "format": "pt",
        "krea2.format": fmt,
        "krea2.base_model": base_model,
        "krea2.rank": str(rank),
        "krea2.alpha": str(rank),  # effective alpha: the scale is folded into the up/B weights
        "krea2.trigger_words": json.dumps(list(trigger_words)),
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(rank),
        "ss_base_model_version": "krea2",
    }
    if trained_alpha is not None:
        meta["krea2.trained_alpha"] = str(trained_alpha)
    if steps is not None:
        meta["krea2.steps"] = str(steps)
        meta["ss_steps"] = str(steps)
    if trigger_words:
        meta["modelspec.trigger_phrase"] = ", ".join(trigger_words)
    meta.update(extra or {})
    return meta


def save_lora_file(path: str | Path, layers: Mapping[str, LoraLayer], fmt: str, metadata: Mapping[str, str]) -> Path:
    """Write ``layers`` in ``fmt`` (``diffusers`` / ``comfyui`` / ``kohya``) with ``metadata``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown LoRA format {fmt!r}; choose from {sorted(FORMATS)}")
    tensors = FORMATS[fmt](layers)
    zero = [m for m, l in layers.items() if l.is_zero()]
    if len(zero) == len(layers):
        raise ValueError("every layer's lora_B / up weight (LoKr/LoHa: a factor) is zero: this LoRA would do nothing (was it trained?)")
    path = Path(path)
    save_safetensors(tensors, path, metadata=dict(metadata))
    return path
