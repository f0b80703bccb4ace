"""The benches' own measuring instruments: the roofline's FLOP count (bench/roofline.py) and the
full-size bench's peak-memory reader (bench/full_size.py's TreePeak)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from krea2_diffusers import Krea2Transformer2DModel
from krea2_diffusers.models.tiny import tiny_transformer_config

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import roofline  # noqa: E402

# GQA in both the blocks (4 heads, 2 kv) and the text fusion (2 heads, 1 kv).
CONFIG = dict(tiny_transformer_config(), text_num_key_value_heads=1)


def test_flop_count_matches_torchs_flop_counter():
    """The analytic count equals torch's FlopCounterMode (its own per-op formulas: 2*M*N*K for
    mm/addmm/bmm) exactly, integers on both sides, for a forward with prepared conditioning and for
    the conditioning itself. SDPA runs on its math backend, whose bmm's the counter sees (the fused
    CPU kernel is not in its table)."""
    model = Krea2Transformer2DModel(**CONFIG).eval()
    batch, text, image = 2, 5, 12
    g = torch.Generator().manual_seed(0)
    encoder = torch.randn(batch, text, CONFIG["num_text_layers"], CONFIG["text_hidden_dim"], generator=g)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as counter:
            conditioning = model.prepare_conditioning(encoder, torch.zeros(text + image, 3))
        assert counter.get_total_flops() == roofline.conditioning_flops(model.config, text, batch)
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(batch, image, 64, generator=g), timestep=torch.full((batch,), 0.5), conditioning=conditioning)
        assert counter.get_total_flops() == roofline.step_flops(model.config, image, text, batch)


def test_meter_counts_each_denoising_forward_and_roofline_has_the_pinned_keys():
    model = Krea2Transformer2DModel(**CONFIG).eval()
    g = torch.Generator().manual_seed(0)
    encoder = torch.randn(1, 3, CONFIG["num_text_layers"], CONFIG["text_hidden_dim"], generator=g)
    with torch.no_grad(), roofline.TransformerMeter(model) as meter:
        conditioning = model.prepare_conditioning(encoder, torch.zeros(3 + 8, 3))
        for _ in range(3):
            model(torch.randn(1, 8, 64, generator=g), timestep=torch.tensor([0.5]), conditioning=conditioning)
        model(torch.randn(1, 8, 64, generator=g), encoder, torch.tensor([0.5]), torch.zeros(11, 3))  # one-call: not a step
    assert meter.calls == 3 and meter.seconds > 0
    assert meter.flops == 3 * roofline.step_flops(CONFIG, 8, 3)
    peaks = {"peak_gflops_fp32": 100.0, "peak_gflops_bf16": 400.0}
    result = roofline.roofline(2e9, 0.1, torch.bfloat16, peaks)
    assert tuple(result) == roofline.PINNED_KEYS
    assert result["achieved_gflops"] == pytest.approx(20.0) and result["fraction_of_peak"] == pytest.approx(0.05)
    assert roofline.roofline(2e9, 0.1, "float32", peaks)["fraction_of_peak"] == pytest.approx(0.2)


def test_matmul_peak_is_a_positive_rate():
    assert roofline.matmul_peak_gflops(torch.float32, size=128, repeats=2) > 0


# A child that allocates and touches SPIKE bytes, holds them HOLD seconds and exits 1 s later.
SPIKE = 1 << 30
HOLD = 0.05
SPIKE_CHILD = f"""
import time
time.sleep(0.3)
block = b"\\x01" * {SPIKE}   # written, so every page is resident
time.sleep({HOLD})
del block
time.sleep(1.0)
"""

# TreePeak around the child, in a fresh process: RUSAGE_CHILDREN is per process, and pytest's
# earlier children (model loads of several GB) would hide the spike in its maximum.
DRIVER = """
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
from full_size import TreePeak
with TreePeak(interval=float(sys.argv[2])) as peak:
    subprocess.run([sys.executable, "-c", sys.argv[3]], check=True)
print(json.dumps({"sampled": peak.peak, "max_hwm": peak.max_hwm}))
"""


def test_tree_peak_high_water_mark_catches_a_spike_sampling_misses():
    """A 1 GiB spike held 50 ms by a child: the high-water mark sees all of it (the kernel's
    ``ru_maxrss`` of the waited-for child). Sampling every 10 s reads the tree only when the run
    starts (before the child exists; a wait on an Event, so the exit is immediate), so it misses
    the spike wholly: the driver's own interpreter and the child's, well under 1 GiB. Every 0.2 s
    it catches the spike only when a sample lands in the ~50-200 ms the child holds the bytes, so
    that interval is not asserted on."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(DRIVER), str(BENCH), "10", textwrap.dedent(SPIKE_CHILD)],
                          check=True, capture_output=True, text=True, timeout=120)
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["max_hwm"] >= SPIKE
    assert measured["sampled"] < SPIKE / 2
