"""The host-memory plan of a generation run on the CPU, before anything is loaded (``krea2 generate
--dry-run``): the transformer as the streamed loader will store it, counted from the module tree
on the meta device, the text encoder and VAE as their files hold them, and the transients of loading
(one block in the file's precision) and of compute (the largest matrix dequantized). When it does not
fit the machine's RAM it says by how much, and which storage would fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

GIB = 1024**3
# Python, torch, transformers and diffusers imported, the tokenizer built: measured 0.6-0.8 GiB of
# anonymous memory on Linux; the plan keeps the upper end.
PROCESS_BASELINE = int(0.8 * GIB)
# A dequantized weight in float32 plus the float32 copy its conversion makes, per quantized layer call.
DEQUANT_COPIES = 2
STORAGES = ("nf4", "int8", "fp8", None)  # smallest first


@dataclass
class HostPlan:
    rows: list[tuple[str, int]] = field(default_factory=list)

    def add(self, label: str, size: int) -> None:
        self.rows.append((label, int(size)))

    @property
    def total(self) -> int:
        return sum(size for _, size in self.rows)

    def render(self, available: int, fitting: list[str]) -> str:
        width = max(len(label) for label, _ in self.rows)
        lines = ["host memory plan:"] + [f"  {label:<{width}}  {size / GIB:8.2f} GiB" for label, size in self.rows]
        lines.append(f"  {'host peak':<{width}}  {self.total / GIB:8.2f} GiB")
        if self.total <= available:
            lines.append(f"  fits: {available / GIB:.2f} GiB of RAM, {(available - self.total) / GIB:.2f} GiB to spare")
        else:
            hint = f"; {', '.join(fitting)} would fit" if fitting else "; no transformer storage would fit"
            lines.append(f"  DOES NOT FIT: {available / GIB:.2f} GiB of RAM, {(self.total - available) / GIB:.2f} GiB short{hint}")
        return "\n".join(lines)


def file_bytes(source) -> int:
    """Bytes of a text encoder / VAE source on disk (a file, or a folder's safetensors); 0 for tiny-random."""
    path = Path(str(source)) if source is not None else None
    if path is None or not path.exists():
        return 0
    files = [path] if path.is_file() else list(path.rglob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def plan_host_memory(model, quantization: str | None, torch_dtype: torch.dtype, *, text_encoder=None, vae=None,
                     tokens: int = 0, release_text_encoder: bool = False) -> HostPlan:
    """The host peak of generating on the CPU from the transformer file ``model`` loaded with
    ``quantization`` (None: ``torch_dtype`` throughout; a GGUF file counts at its packed size).

    Args:
        text_encoder, vae: their sources (files or folders; stored bf16 is loaded as ``torch_dtype``).
        tokens: image plus text tokens of one forward (the activations' size).
        release_text_encoder: the prompt is encoded and the text encoder dropped before the
            transformer loads (``pipelines.memory.release_text_encoder``): the two never coexist.
    """
    from ..loaders.quantized import planned_transformer_bytes
    from ..loaders.single_file import infer_config_from_shapes, locate_transformer_tensors
    from ..models.transformer import Krea2Transformer2DModel

    plan = HostPlan()
    plan.add("process (python, torch, libraries)", PROCESS_BASELINE)
    widen = max(1, torch_dtype.itemsize // 2)  # bf16 files loaded as float32 double
    encoder = file_bytes(text_encoder) * widen
    if not release_text_encoder:
        plan.add("text encoder", encoder)
    plan.add("VAE", file_bytes(vae) * widen)
    path = Path(str(model))
    if path.suffix == ".gguf":
        from ..quantization.gguf.loader import planned_gguf_bytes
        from ..quantization.gguf.reader import read_gguf

        tensors, layout, _ = read_gguf(path)
        # the compute transient needs the config: mapped from original names (as the loader does)
        config = infer_config_from_shapes({name: t.shape for name, t in tensors.items()}) if layout == "original" else None
        # packed weights as stored, the other tensors decoded to torch_dtype; its load peaks ~1.07x
        resident, loading = planned_gguf_bytes(Krea2Transformer2DModel, path, torch_dtype), 0
        plan.add("transformer (GGUF, packed as stored; other tensors in the compute dtype)", resident)
    else:
        config, _ = locate_transformer_tensors(path)
        resident, loading = planned_transformer_bytes(Krea2Transformer2DModel, config, quantization, torch_dtype)
        plan.add(f"transformer ({quantization or str(torch_dtype).removeprefix('torch.')})", resident)
    compute = 0
    if config is not None:
        with torch.device("meta"):
            model = Krea2Transformer2DModel(**config)
        width = max(config.get("intermediate_size", 16384), 6 * model.img_in.out_features)
        compute = dequantized_weight_bytes(config) + tokens * width * 4 * 4
    plan.add("largest transient (loading: one block + quantizer temporaries; or compute)", max(loading, compute))
    if release_text_encoder:  # only what the encoding phase needs beyond the transformer phase
        plan.add("text encoder (released before the transformer loads), beyond the above",
                 max(0, encoder - resident - max(loading, compute)))
    return plan


def dequantized_weight_bytes(config: dict) -> int:
    """Host bytes one quantized layer call adds on the CPU: the largest quantized (out, in) matrix
    of the transformer ``config`` dequantized to float32 plus the float32 copy its conversion makes
    (:data:`DEQUANT_COPIES`), as bitsandbytes' CPU kernels do. (fp8 layers work in row chunks of a
    few MiB on the CPU; the plans keep the whole-matrix figure as their margin.)"""
    from ..loaders.quantized import largest_quantized_weight
    from ..models.transformer import Krea2Transformer2DModel

    return largest_quantized_weight(Krea2Transformer2DModel, config) * 4 * DEQUANT_COPIES


def host_ram() -> int:
    """The machine's RAM (MemTotal) in bytes."""
    import psutil

    return psutil.virtual_memory().total


def storages_that_fit(model, torch_dtype: torch.dtype, available: int, **kwargs) -> list[str]:
    """The transformer storages (smallest first) whose plan fits ``available`` bytes."""
    return [s or str(torch_dtype).removeprefix("torch.") for s in STORAGES
            if plan_host_memory(model, s, torch_dtype, **kwargs).total <= available]
