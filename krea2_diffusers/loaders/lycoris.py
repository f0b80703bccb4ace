"""LoKr and LoHa adapters (the LyCORIS family) on linear layers: the tensors a file holds, the
weight delta they add, and the PEFT adapter that carries them at inference.

Per module (the key suffixes ComfyUI's ``comfy/weight_adapter/lokr.py`` / ``loha.py`` and LyCORIS
read, after the module name):

- LoKr: ``lokr_w1`` (a, c), or ``lokr_w1_a`` (a, r) @ ``lokr_w1_b`` (r, c); ``lokr_w2`` (b, d), or
  ``lokr_w2_a`` (b, r) @ ``lokr_w2_b`` (r, d); delta ``kron(w1, w2)``, (a*b, c*d) = (out, in).
- LoHa: ``(hada_w1_a @ hada_w1_b) * (hada_w2_a @ hada_w2_b)`` (element-wise), ``*_a`` (out, r),
  ``*_b`` (r, in).

The scale, as ComfyUI and LyCORIS apply it: ``alpha / dim`` where ``dim`` is the rank of a
decomposed factor (LoKr: ``lokr_w2_b``'s rows when w2 is decomposed, else ``lokr_w1_b``'s; LoHa:
``hada_w1_b``'s rows), and 1 when the file has no ``.alpha`` or, for LoKr, neither factor is
decomposed. PEFT instead always scales by its ``alpha / r``; :meth:`LycorisLayer.from_peft` folds
that into the first factor, and every export is written folded (alpha = dim), so its effect is the
same under both rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

ROLES = {
    "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b"),
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
}
# Tucker cores: convolution kernels only; Krea 2 adapts linear layers.
TUCKER_ROLES = ("lokr_t2", "hada_t1", "hada_t2")


def kind_of(roles) -> str | None:
    """``"lokr"``, ``"loha"``, ``"mixed"`` (both) or None (neither) from a module's tensor roles."""
    kinds = {kind for kind, names in ROLES.items() if any(role in names for role in roles)}
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else None)


@dataclass
class LycorisLayer:
    """One linear layer's LoKr or LoHa adapter: ``tensors`` by role (``lokr_w1``, ``hada_w1_a``, ...)."""

    kind: str
    tensors: dict[str, torch.Tensor]
    alpha: float | None = None

    @property
    def rank(self) -> int | None:
        """The decomposed factor's rank that ``alpha`` divides (None: LoKr with both factors whole)."""
        for role in ("lokr_w2_b", "lokr_w1_b", "hada_w1_b"):
            if role in self.tensors:
                return self.tensors[role].shape[0]
        return None

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None or self.rank is None else self.alpha / self.rank

    def _first(self) -> str:
        """The role that carries a folded scale (a factor of every term of the delta)."""
        return next(role for role in ("lokr_w1", "lokr_w1_a", "hada_w1_a") if role in self.tensors)

    def folded(self) -> "LycorisLayer":
        """The same delta with the scale in the first factor and alpha = rank (scale 1 under every rule)."""
        first = self._first()
        tensors = {**self.tensors, first: self.tensors[first] * self.scale}
        return LycorisLayer(self.kind, tensors, None if self.rank is None else float(self.rank))

    @classmethod
    def from_peft(cls, tensors: Mapping[str, torch.Tensor], scale: float) -> "LycorisLayer":
        """A trained PEFT LoKr/LoHa layer (``tensors`` by role) whose delta PEFT scales by ``scale`` = alpha / r."""
        layer = cls(kind_of(tensors), dict(tensors))
        first = layer._first()
        layer.tensors[first] = layer.tensors[first] * scale
        layer.alpha = None if layer.rank is None else float(layer.rank)  # scale 1 under every rule
        return layer

    def factors(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """LoKr: w1 (a, c), w2 (b, d); LoHa: the two (out, in) low-rank products; in ``dtype``."""
        t = {role: (v if dtype is None else v.to(dtype)) for role, v in self.tensors.items()}
        if self.kind == "loha":
            return t["hada_w1_a"] @ t["hada_w1_b"], t["hada_w2_a"] @ t["hada_w2_b"]
        w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
        w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
        return w1, w2

    def delta(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight delta (out, in) the adapter adds at strength 1."""
        first, second = self.factors(dtype)
        return (torch.kron(first, second) if self.kind == "lokr" else first * second) * self.scale

    def is_zero(self) -> bool:
        """True when a factor is all zero, so the delta is (an untrained adapter)."""
        return any(not bool(t.any()) for t in self.tensors.values())

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """``{prefix}.{role}`` tensors, folded, plus ``{prefix}.alpha`` (= rank) where a factor is decomposed."""
        layer = self.folded()
        out = {f"{prefix}.{role}": tensor.contiguous() for role, tensor in layer.tensors.items()}
        if layer.alpha is not None:
            out[f"{prefix}.alpha"] = torch.tensor(layer.alpha)
        return out

    @classmethod
    def from_file(cls, parts: Mapping[str, torch.Tensor], out_features: int, in_features: int) -> "LycorisLayer":
        """One module's tensors from a file (by role, ``alpha`` included; no alpha: scale 1, as in
        ComfyUI), checked against an ``in_features -> out_features`` linear layer. A ValueError
        says what does not fit."""
        tucker = [role for role in parts if role in TUCKER_ROLES]
        if tucker:
            raise ValueError(f"{tucker[0]} is a Tucker factor of a convolution; Krea 2's adapted layers are linear")
        kind = kind_of(parts)
        other = sorted(set(parts) - set(ROLES.get(kind, ())) - {"alpha"})
        if kind == "mixed" or other:
            raise ValueError(f"mixes LoKr/LoHa tensors with {other or 'each other'}; one adapter kind per layer")
        alpha = float(parts["alpha"].reshape(-1)[0]) if "alpha" in parts else None
        layer = cls(kind, {role: t for role, t in parts.items() if role != "alpha"}, alpha)
        problem = layer._problem(out_features, in_features)
        if problem:
            raise ValueError(problem)
        return layer

    def _problem(self, out_features: int, in_features: int) -> str | None:
        """What is wrong with this layer for an ``in_features -> out_features`` linear layer (None: it fits)."""
        t = self.tensors
        if self.kind == "loha":
            groups = [("hada_w1_a", "hada_w1_b"), ("hada_w2_a", "hada_w2_b")]
        else:  # each factor whole or as a low-rank pair
            groups = [("lokr_w1",) if "lokr_w1" in t else ("lokr_w1_a", "lokr_w1_b"),
                      ("lokr_w2",) if "lokr_w2" in t else ("lokr_w2_a", "lokr_w2_b")]
        missing = [role for group in groups for role in group if role not in t]
        if missing:
            return f"lacks its {missing[0]} tensor"
        extra = [role for role in t if not any(role in group for group in groups)]
        if extra:
            return f"holds {extra[0]} beside {', '.join(r for g in groups for r in g)} (two spellings of one factor?)"
        shapes = ", ".join(f"{role} {tuple(v.shape)}" for role, v in t.items())
        if any(v.ndim != 2 for v in t.values()):
            return f"holds a tensor that is not 2-D ({shapes})"
        if any(len(g) == 2 and t[g[0]].shape[1] != t[g[1]].shape[0] for g in groups):
            return f"has a low-rank pair whose inner sizes differ ({shapes})"
        (rows1, cols1), (rows2, cols2) = [(t[g[0]].shape[0], t[g[-1]].shape[1]) for g in groups]
        if self.kind == "loha":
            shape = (rows1, cols1) if (rows1, cols1) == (rows2, cols2) else None
        else:
            shape = (rows1 * rows2, cols1 * cols2)
        if shape != (out_features, in_features):
            return f"{shapes} do not make a {in_features}->{out_features} weight"
        for role, tensor in t.items():
            if not torch.isfinite(tensor.float()).all():
                return f"the {role} tensor holds NaN or inf values"
        return None


def add_lycoris_adapter(transformer: nn.Module, layers: Mapping[str, LycorisLayer], adapter_name: str) -> None:
    """Inject ``layers`` (all one kind) as PEFT LoKr/LoHa adapter ``adapter_name`` holding their own
    tensors (float32, folded): PEFT's per-layer ``alpha`` and ``r`` are set to 1, so its scaling
    is the adapter strength alone and each file's factor shapes are kept as they are."""
    from peft import LoHaConfig, LoKrConfig

    (kind,) = {layer.kind for layer in layers.values()}
    for name in layers:
        base = transformer.get_submodule(name)
        base = base.get_base_layer() if hasattr(base, "get_base_layer") else base
        if tuple(base.weight.shape) != (base.out_features, base.in_features):
            # PEFT's LoKr/LoHa reshape their delta to the stored weight's shape.
            raise ValueError(f"{kind} adapters need an unpacked base weight: {name!r} stores {tuple(base.weight.shape)} "
                             f"({type(base).__name__}); load the model in bf16/fp8/int8 instead")
    config_class = LoKrConfig if kind == "lokr" else LoHaConfig
    transformer.add_adapter(config_class(r=1, alpha=1, target_modules=sorted(layers), init_weights=False),
                            adapter_name=adapter_name)
    for name, layer in layers.items():
        module = transformer.get_submodule(name)
        device = module.get_base_layer().weight.device
        for role in ROLES[kind]:  # the placeholders PEFT made at r = 1
            if adapter_name in getattr(module, role):
                del getattr(module, role)[adapter_name]
        for role, tensor in layer.folded().tensors.items():
            getattr(module, role)[adapter_name] = nn.Parameter(tensor.detach().float().to(device), requires_grad=False)
        module.r[adapter_name], module.alpha[adapter_name], module.scaling[adapter_name] = 1, 1.0, 1.0
