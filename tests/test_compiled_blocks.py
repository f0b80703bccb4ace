"""``compile_repeated_blocks`` on our transformer (``caching.apply.compile_blocks``: regional
torch.compile of the blocks in ``_repeated_blocks``, dynamic shapes): equal to eager within 1e-5 in
float32, and no recompilation across steps, CFG on/off or prompt lengths once each attention layout
(padded batch with a mask, unpadded without) has compiled once."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.caching.apply import compile_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from cache_side_by_side import compiled_frames  # noqa: E402  (dynamo's frame counter, as the bench reports it)


def test_compiled_blocks_equal_eager_without_recompiling(tiny_pipe):
    pipe = Krea2Pipeline(**{**tiny_pipe.components, "transformer": copy.deepcopy(tiny_pipe.transformer)})
    pipe.set_progress_bar_config(disable=True)
    calls = [  # (prompt, guidance): CFG on (2 rows, padding mask), off (1 row, none), other prompt lengths
        ("a red fox", 3.5), ("a red fox", 0.0), ("a much longer prompt about a red fox asleep in the snow", 3.5),
        ("cat", 0.0), ("a dog on a hill at dusk", 3.5),
    ]
    run = lambda prompt, guidance: pipe(prompt=prompt, guidance_scale=guidance, height=32, width=48, num_inference_steps=3,
                                        output_type="latent", generator=torch.Generator().manual_seed(0)).images
    with torch.inference_mode():
        eager = [run(*call) for call in calls]
        torch._dynamo.reset()  # this process's compile caches: the counts below are this test's own
        compile_blocks(pipe.transformer)
        frames = []
        for call, reference in zip(calls, eager):
            before = compiled_frames()
            out = run(*call)
            frames.append(compiled_frames() - before)
            assert (out - reference).abs().max() <= 1e-5, call
    # One frame (all blocks share it) per layout, the first time it is seen: 3 steps x 2 blocks per call, no recompiles.
    assert frames == [1, 1, 0, 0, 0]
    with torch.inference_mode(), torch.compiler.set_stance("fail_on_recompile"):  # and torch's public guarantee of it
        for call in calls:
            run(*call)
