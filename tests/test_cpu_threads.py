"""CPU threads chosen for the model's size (krea2_diffusers.cpu_threads), the entry points that choose
them, and `krea2 expand`'s progress and tiny-model length cap."""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from krea2_diffusers import cpu_threads
from krea2_diffusers.cpu_threads import SINGLE_THREAD_WIDTH, choose_cpu_threads, transformer_width
from krea2_diffusers.files import save_safetensors

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def default_threads(monkeypatch):
    """A process whose thread count is still torch's start-up count (2 here, on any machine), no
    thread variables set; torch's count restored afterwards."""
    before = torch.get_num_threads()
    for name in cpu_threads.USER_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads, "STARTING_THREADS", 2)
    yield
    torch.set_num_threads(before)


def test_a_tiny_model_runs_single_threaded_and_says_so(default_threads):
    said = []
    assert choose_cpu_threads("tiny-random", announce=said.append) == 1
    assert torch.get_num_threads() == 1
    assert said == ["threads: 1 instead of torch's 2 (a 64-wide transformer runs faster single-threaded; "
                    "set OMP_NUM_THREADS to choose)"]
    assert choose_cpu_threads("tiny-random", announce=said.append) is None and len(said) == 1  # once


def test_the_users_choice_wins(default_threads, monkeypatch):
    torch.set_num_threads(3)  # torch.set_num_threads by the user: not torch's start-up count
    assert choose_cpu_threads("tiny-random", announce=print) is None and torch.get_num_threads() == 3
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_cpu_threads("tiny-random", announce=print) is None and torch.get_num_threads() == 2


def test_wide_or_unknown_models_keep_torchs_count(default_threads, tmp_path):
    folder = tmp_path / "krea2-diffusers" / "transformer"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"num_attention_heads": 48, "attention_head_dim": 128}')
    assert transformer_width(folder.parent) == 6144
    for models in ((folder.parent,), ("krea/Krea-2-Raw",), ("tiny-random", folder.parent), ("tiny-random", "krea/Krea-2-Raw")):
        assert choose_cpu_threads(*models, announce=print) is None and torch.get_num_threads() == 2, models
    assert choose_cpu_threads(width=SINGLE_THREAD_WIDTH, announce=print) is None
    assert choose_cpu_threads(announce=print) is None  # nothing known: nothing changes


def test_width_of_a_single_file_comes_from_its_header(default_threads, tmp_path):
    path = tmp_path / "small.safetensors"
    save_safetensors({"model.diffusion_model.first.weight": torch.zeros(128, 64)}, path)
    assert transformer_width(path) == 128
    said = []
    assert choose_cpu_threads(path, announce=said.append) == 1 and "128-wide" in said[0]


def test_train_posttrain_and_pretrain_choose_threads_before_training(monkeypatch, tmp_path):
    import finetune.cli
    import finetune.pretrain.cli
    import finetune.pretrain.trainer
    from finetune.config import load_config

    calls = []
    monkeypatch.setattr(cpu_threads, "choose_cpu_threads", lambda *models, **kw: calls.append((models, kw)))
    finished = SimpleNamespace(interrupted=False, exported=[], final_step=0)

    def fake_train(config, resume):
        assert calls, "threads are chosen before training starts"
        return finished

    args = argparse.Namespace(config=str(EXAMPLES / "train_lora_tiny.yaml"), overrides=[], output_dir=str(tmp_path / "t"),
                              resume=False, dry_run=False)
    assert finetune.cli.run_config_command(args, "train", load_config, fake_train, ()) == 0
    assert calls == [(("tiny-random", "tiny-random"), {})]  # RAW and the "Turbo" it samples
    calls.clear()
    monkeypatch.setattr(finetune.pretrain.trainer, "pretrain", fake_train)
    args = argparse.Namespace(config=str(EXAMPLES / "pretrain_tiny.yaml"), overrides=[], output_dir=str(tmp_path / "p"),
                              resume=False, dry_run=False, replay=None)
    assert finetune.pretrain.cli.run(args) == 0
    assert calls == [((), {"width": 64})]  # the tiny architecture: 4 heads x 16


def test_expand_caps_tiny_random_and_shows_progress():
    from krea2_diffusers.cli import build_parser
    from krea2_diffusers.cli.expand import TINY_MAX_NEW_TOKENS, TokenProgress, max_new_tokens_for
    from krea2_diffusers.conditioning.expander import DEFAULT_MAX_NEW_TOKENS

    parse = build_parser().parse_args
    assert max_new_tokens_for(parse(["expand", "a fox", "--creativity", "low"])) == TINY_MAX_NEW_TOKENS
    assert max_new_tokens_for(parse(["expand", "a fox", "--model", "k.safetensors"])) == DEFAULT_MAX_NEW_TOKENS
    assert max_new_tokens_for(parse(["expand", "a fox", "--expander", "tiny-random", "--model", "k.safetensors"])) == TINY_MAX_NEW_TOKENS
    assert max_new_tokens_for(parse(["expand", "a fox", "--max-new-tokens", "900"])) == 900
    out = io.StringIO()
    progress = TokenProgress(200, every=64, stream=out)
    for generation in range(2):  # two prompts: each generate() shows the prompt's ids first, then one token at a time
        progress.put(torch.tensor([[1, 2, 3]]))
        for _ in range(130):
            progress.put(torch.tensor([7]))
        progress.end()
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["expand: 64/200 tokens", "expand: 128/200 tokens"] * 2


def test_entry_points_hold_freed_chunks_unless_the_user_set_malloc_variables():
    """krea2_diffusers.heap.hold_freed_chunks (called next to choose_cpu_threads by every entry point)
    sets glibc's thresholds so that the quantized layers' expansion chunks are reused, not faulted in
    again (issue 42: a full-size fp8 LoRA step 191.7 -> 135.6 s); a user's ``MALLOC_*`` variable wins.
    In child processes: the setting is process-wide."""
    import os
    import subprocess
    import sys

    code = "from krea2_diffusers.heap import hold_freed_chunks; print(hold_freed_chunks())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "True"
    env["MALLOC_TRIM_THRESHOLD_"] = str(128 << 10)
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
    for entry in ("krea2_diffusers/cli/generate.py", "krea2_diffusers/cli/expand.py", "finetune/cli.py",
                  "finetune/pretrain/cli.py", "app.py"):
        assert "hold_freed_chunks()" in (EXAMPLES.parent / entry).read_text(), entry
