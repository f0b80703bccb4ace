"""Block swap: the frozen weights of some transformer blocks live on the CPU and are streamed
onto the accelerator just before each block runs (forward, and backward again), the copy of the
next block overlapping the current block's compute on a side CUDA stream.

Only frozen tensors move (the LoRA adapters, a few MB, stay resident with their gradients and
optimizer state). Autograd would keep every block's on-device weights alive until backward,
so inside an offloaded block the saved weights are replaced by a reference (``saved_tensors_hooks``)
and fetched again when backward needs them. On a CPU device every copy is a no-op and the same
code runs, which is what the CPU tests exercise.
"""

from __future__ import annotations

import torch
from torch import nn


class _Swapped:
    """One block's frozen tensors: a (pinned) CPU home copy and, while in use, a device copy."""

    def __init__(self, block: nn.Module, device: torch.device):
        self.block = block
        self.device = device
        self.tensors = [(m, n, t) for m in block.modules() for n, t in list(m._parameters.items()) + list(m._buffers.items())
                        if t is not None and not t.requires_grad]
        pin = device.type == "cuda"
        self.home = [t.detach().to("cpu").pin_memory() if pin else t.detach().to("cpu") for _, _, t in self.tensors]
        self.ready: torch.cuda.Event | None = None
        self.loaded = device.type == "cpu"
        self._set(self.home)

    def _set(self, values: list[torch.Tensor]) -> None:
        for (module, name, tensor), value in zip(self.tensors, values):
            tensor.data = value
        self.storage_ids = {t.untyped_storage().data_ptr(): i for i, (_, _, t) in enumerate(self.tensors)}

    def load(self, stream: torch.cuda.Stream | None) -> None:
        """Start copying the weights in (on ``stream``); :meth:`wait` before use."""
        if self.loaded:
            return
        if stream is None:
            self._set([h.to(self.device) for h in self.home])
        else:
            with torch.cuda.stream(stream):
                self._set([h.to(self.device, non_blocking=True) for h in self.home])
                self.ready = torch.cuda.Event()
                self.ready.record(stream)
        self.loaded = True

    def wait(self) -> None:
        if self.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.ready)
            for _, _, tensor in self.tensors:
                # Allocated on the side stream, used on this one: the allocator must not hand the
                # memory to the next prefetch before this stream is done with it.
                tensor.data.record_stream(current)
            self.ready = None

    def unload(self) -> None:
        if self.device.type == "cpu" or not self.loaded:
            return
        self._set(self.home)  # the device copies are freed once nothing references them
        self.loaded = False


class BlockOffloader:
    """Keep ``blocks``' frozen weights on the CPU and swap them in around each use.

    Args:
        blocks: the transformer blocks to offload, in execution order.
        device: the training device (``cpu``: the swap is a no-op, the hooks still run).
    """

    def __init__(self, blocks: list[nn.Module], device: torch.device):
        self.device = device
        self.swapped = [_Swapped(block, device) for block in blocks]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._hooks_stack: list = []
        for index, item in enumerate(self.swapped):
            item.block.register_forward_pre_hook(self._before(index))
            item.block.register_forward_hook(self._after(index))
            item.block.register_full_backward_pre_hook(self._before_backward(index))
            item.block.register_full_backward_hook(self._after_backward(index))

    def names(self, model: nn.Module) -> list[str]:
        """Fully qualified names (in ``model``) of the offloaded tensors."""
        owned = {id(t) for item in self.swapped for _, _, t in item.tensors}
        return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if id(t) in owned]

    def place_rest_(self, model: nn.Module) -> None:
        """Move every tensor of ``model`` that is not offloaded to the device (the whole model is
        never on the device at once)."""
        owned = {id(t) for item in self.swapped for _, _, t in item.tensors}
        for tensor in list(model.parameters()) + list(model.buffers()):
            if id(tensor) not in owned:
                tensor.data = tensor.data.to(self.device)

    def resident_bytes(self) -> int:
        """Bytes of the offloaded blocks' frozen weights that stay on the CPU."""
        return sum(h.numel() * h.element_size() for item in self.swapped for h in item.home)

    def _prefetch(self, index: int) -> None:
        if 0 <= index < len(self.swapped):
            self.swapped[index].load(self.stream)

    def _before(self, index: int):
        def hook(module, args):
            item = self.swapped[index]
            item.load(self.stream)
            item.wait()
            self._prefetch(index + 1)  # overlaps this block's compute
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack(item), self._unpack)
            hooks.__enter__()
            self._hooks_stack.append(hooks)
        return hook

    def _after(self, index: int):
        def hook(module, args, output):
            self._hooks_stack.pop().__exit__(None, None, None)
            self.swapped[index].unload()
        return hook

    def _before_backward(self, index: int):
        def hook(module, grad_output):
            item = self.swapped[index]
            item.load(self.stream)
            item.wait()
            self._prefetch(index - 1)  # backward runs the blocks in reverse
        return hook

    def _after_backward(self, index: int):
        def hook(module, grad_input, grad_output):
            self.swapped[index].unload()
        return hook

    def _pack(self, item: _Swapped):
        def pack(tensor: torch.Tensor):
            slot = item.storage_ids.get(tensor.untyped_storage().data_ptr()) if tensor.device == item.device else None
            if slot is None:
                return tensor
            # The weight or a view of it (``linear`` saves ``weight.t()``): keep how to rebuild the
            # view from the weight's device copy once it is back.
            return (item, slot, tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
        return pack

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        item, slot, shape, stride, offset = packed
        item.load(None)
        item.wait()
        return item.tensors[slot][2].detach().as_strided(shape, stride, offset)
