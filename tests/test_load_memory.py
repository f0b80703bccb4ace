"""Loading an ~0.8 GB original-layout file must not need twice its size in RAM."""

import subprocess
import sys
import textwrap

# Full head size, fewer/narrower blocks: ~402M parameters, ~0.8 GB in bf16.
CONFIG = dict(
    in_channels=64, num_layers=3, attention_head_dim=128, num_attention_heads=24, num_key_value_heads=6,
    intermediate_size=6144, timestep_embed_dim=256, text_hidden_dim=1024, num_text_layers=12,
    text_num_attention_heads=8, text_num_key_value_heads=8, text_intermediate_size=2816,
    num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(32, 48, 48),
)
PEAK_RATIO = 1.25

WRITE = """
import torch, sys
from krea2_diffusers import Krea2Transformer2DModel, convert_diffusers_to_original
from krea2_diffusers.files import save_safetensors
with torch.device("meta"):
    model = Krea2Transformer2DModel(**{config})
state = {{}}
for name, meta in convert_diffusers_to_original(model.state_dict()).items():
    dtype = torch.float32 if meta.ndim == 1 or name.endswith("modulation.lin") else torch.bfloat16
    state[name] = torch.empty(meta.shape, dtype=dtype).normal_(0, 0.02)
save_safetensors(state, sys.argv[1])
"""

MEASURE = """
import os, sys, torch
from krea2_diffusers import Krea2Transformer2DModel

def peak_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1])

def current_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1])

baseline = current_kb()
model = Krea2Transformer2DModel.from_single_file(sys.argv[1])
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(baseline, peak_kb(), params, os.path.getsize(sys.argv[1]))
"""


def test_peak_rss_of_single_file_load(tmp_path):
    path = tmp_path / "krea2-mid.safetensors"
    subprocess.run([sys.executable, "-c", textwrap.dedent(WRITE.format(config=CONFIG)), str(path)], check=True)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(MEASURE), str(path)], check=True, capture_output=True, text=True)
    baseline_kb, peak_kb, param_bytes, file_bytes = map(int, out.stdout.split())
    assert 0.7e9 < file_bytes < 0.9e9
    assert param_bytes > 0.99 * file_bytes  # everything was really loaded
    growth = (peak_kb - baseline_kb) * 1024
    print(f"file {file_bytes / 1e9:.3f} GB, peak RSS growth {growth / 1e9:.3f} GB = {growth / file_bytes:.3f}x")
    assert growth <= PEAK_RATIO * file_bytes
