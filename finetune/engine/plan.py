"""``--dry-run``: the memory plan of one training process for *this* config, without weights.

The transformer is built on the meta device exactly as training builds it (quantized base, LoRA
adapters, or the FSDP shard of a full fine-tune), so parameter bytes are counted from the real
module tree, not from a formula. Activations are measured too: one forward pass of the model runs
on meta tensors of the largest bucket's shape, and the tensors autograd saves for backward are
summed (per block, and for the rest of the model). Attention is counted as the fused GPU kernels
keep it (no (S, S) matrix); ``selective`` checkpointing keeps the attention outputs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
from torch import nn

GIB = 1024**3
# The CUDA context, cuBLAS/attention workspaces and allocator fragmentation: measured values on
# H100/H200 lie between 0.6 and 1.2 GiB; the plan keeps the upper end.
RUNTIME_OVERHEAD = int(1.2 * GIB)


@dataclass
class MemoryPlan:
    rows: list[tuple[str, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    host_rows: list[tuple[str, int]] = field(default_factory=list)
    """Training tensors kept in host memory whatever the device (e.g. ``training.ema.on_cpu``)."""

    def add(self, label: str, size: int) -> None:
        self.rows.append((label, int(size)))

    @property
    def total(self) -> int:
        return sum(size for _, size in self.rows)

    def render(self, device_name: str, available: int | None, fitting: list[str] = ()) -> str:
        width = max(len(label) for label, _ in self.rows)
        lines = [f"memory plan per process on {device_name}:"]
        lines += [f"  {label:<{width}}  {size / GIB:8.2f} GiB" for label, size in self.rows]
        lines.append(f"  {'total':<{width}}  {self.total / GIB:8.2f} GiB")
        if available is None:
            lines.append("  no GPU detected: nothing to compare against")
        elif self.total <= available:
            lines.append(f"  fits: {available / GIB:.2f} GiB on the device, {(available - self.total) / GIB:.2f} GiB to spare")
        else:
            hint = f"; {', '.join(fitting)} would fit" if fitting else ""
            lines.append(f"  DOES NOT FIT: {available / GIB:.2f} GiB on the device, {(self.total - available) / GIB:.2f} GiB short{hint}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def quantized_linear_bytes(module: nn.Linear, mode: str) -> int:
    """Bytes of one frozen linear layer as bitsandbytes stores it (int8: 1 byte + an fp32 scale per
    row; nf4: half a byte + an fp32 absmax per 64-value block, bitsandbytes' default)."""
    from krea2_diffusers.loaders.quantized import quantized_linear_bytes as stored

    bias = 0 if module.bias is None else module.out_features * 2
    return stored(module.in_features, module.out_features, mode, bias)


class _FusedAttention(torch.autograd.Function):
    """What a fused (flash / memory-efficient) attention kernel keeps for backward: q, k, v, the
    output and one float32 log-sum-exp per query row, never the (S, S) probabilities. On meta
    tensors torch would pick the unfused math path, which is not what runs on a GPU."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _FusedAttentionMode(torch.overrides.TorchFunctionMode):
    attention_outputs = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            out = _FusedAttention.apply(q, k, v)
            self.attention_outputs += out.numel() * out.element_size()
            return out
        return func(*args, **(kwargs or {}))


def measure_activations(model: nn.Module, inputs: dict, blocks: list[nn.Module]) -> dict[str, object]:
    """Bytes autograd saves in one forward of ``model`` on meta ``inputs``.

    Returns per block (lists): ``block`` (nothing checkpointed), ``block_input`` (its input
    tokens), ``block_attention`` (its attention outputs, what selective checkpointing keeps), and
    ``rest``: everything saved outside the blocks. Parameters are excluded (counted as weights);
    a view is counted once through its base.
    """
    params = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    counter = {"now": 0}

    def pack(t: torch.Tensor):
        # Meta tensors have no storage address: a view is counted through its base tensor (kept
        # alive by the hook's reference, so the id is not reused during the pass).
        base = t._base if t._base is not None else t
        if id(base) not in params and id(base) not in seen:
            seen.add(id(base))
            counter["now"] += base.numel() * base.element_size()
        return t

    attention = _FusedAttentionMode()
    found: dict[str, list[int]] = {"block": [], "block_input": [], "block_attention": []}
    start = {}

    def before(module, args):
        start["saved"], start["attention"] = counter["now"], attention.attention_outputs
        found["block_input"].append(args[0].numel() * args[0].element_size())

    def after(module, args, output):
        found["block"].append(counter["now"] - start["saved"])
        found["block_attention"].append(attention.attention_outputs - start["attention"])

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(before), b.register_forward_hook(after))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), attention:
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return {**found, "rest": counter["now"] - sum(found["block"])}


def activation_bytes(measured: dict, mode: str) -> int:
    """Peak saved activations under checkpointing ``mode``: what every block keeps, plus (when
    checkpointed) the largest block recomputed during backward."""
    blocks = measured["block"]
    if mode == "none":
        return measured["rest"] + sum(blocks)
    kept = sum(measured["block_input"])
    if mode == "selective":
        kept += sum(measured["block_attention"])
    return measured["rest"] + kept + max(blocks)


class HostPeak:
    """Context manager measuring how much this process's resident memory grows at most inside it:
    freed heap pages are handed back to the OS first (so reuse does not hide growth), then a
    thread samples the RSS every ``interval`` seconds. ``growth`` is set on exit (bytes)."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.growth = 0

    def __enter__(self):
        import psutil

        from krea2_diffusers.heap import release_freed_memory

        release_freed_memory()  # not glibc: growth may then be understated by reused pages
        self._process = psutil.Process()
        self._base = self._peak = self._process.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.is_set():
            self._peak = max(self._peak, self._process.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self._peak = max(self._peak, self._process.memory_info().rss)
        self.growth = self._peak - self._base
