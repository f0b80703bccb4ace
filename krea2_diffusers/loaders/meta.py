"""Building a model with its parameters on the meta device (no memory, no random init) while its
buffers (rotary frequencies ...) are computed for real, then assigning a state dict to it."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..files import CheckpointError

# Names listed per problem in an error message before "...".
SHOWN_NAMES = 8


@contextlib.contextmanager
def parameters_on_meta():
    """Inside, every ``nn.Parameter`` a module registers lives on the meta device; buffers do not
    (non-persistent buffers are never in a checkpoint, so they must be computed at construction)."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(module._parameters[name].to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _listed(names) -> str:
    names = sorted(names)
    return f"{names[:SHOWN_NAMES]}{' ...' if len(names) > SHOWN_NAMES else ''}"


def check_state_dict_shapes(expected: dict[str, tuple[int, ...]], given: dict[str, tuple[int, ...]], source: str,
                            what: str, optional: tuple[str, ...] = ()) -> None:
    """Raise :class:`CheckpointError` naming ``source``, ``what`` it should be, and the missing /
    unexpected / mis-shaped tensors when the names and shapes ``given`` are not the ``expected`` ones."""
    missing = set(expected) - set(given) - set(optional)
    unexpected = set(given) - set(expected)
    wrong = [f"{k}: file {tuple(given[k])} vs model {expected[k]}"
             for k in sorted(expected) if k in given and tuple(given[k]) != expected[k]]
    if missing or unexpected or wrong:
        parts = [f"{label} {_listed(names)}" for label, names in
                 (("missing tensors", missing), ("unexpected tensors", unexpected)) if names]
        if wrong:
            parts.append(f"mis-shaped tensors {wrong[:SHOWN_NAMES]}")
        raise CheckpointError(f"{source}: does not match {what}: " + "; ".join(parts))


def assign_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str, what: str,
                      optional: tuple[str, ...] = ()) -> nn.Module:
    """Assign ``state_dict`` to ``model`` (built under :func:`parameters_on_meta`), checking names and shapes.

    Args:
        optional: names the file may leave out (they must be filled by the caller, e.g. a tied head).
    Raises:
        CheckpointError: naming ``source``, ``what`` it should be, and the missing / unexpected / mis-shaped tensors.
    """
    check_state_dict_shapes({k: tuple(v.shape) for k, v in model.state_dict().items()},
                            {k: tuple(v.shape) for k, v in state_dict.items()}, source, what, optional)
    model.load_state_dict(state_dict, assign=True, strict=False)
    return model.eval()
