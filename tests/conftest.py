"""Shared tiny components and diffusers oracles (all offline, random weights)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

# Two test workers share the machine's two cores: each runs one intra-op thread, and so do the processes
# they start (they inherit it). With torch's default (one thread per core in each worker) the tiny models'
# tests spin against each other: twelve of their files took 113 s of CPU that way and 69 s single-threaded
# (-n 2, 2-core machine). Set before torch is imported. The thread policy's tests set their own
# (test_cpu_threads) and the README commands run without it (test_examples), as a user runs them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from krea2_diffusers import Krea2Pipeline, Krea2Transformer2DModel
from krea2_diffusers.models.tiny import randomize_

# The compute-dtype policy (krea2_diffusers.precision) picks bf16 for `auto` on CPUs with bf16 units:
# the suite runs the float32 answer on every machine (subprocesses inherit it), so its figures do
# not depend on the CPU; the policy's and bf16 training's own tests set KREA2_CPU_BF16 themselves.
os.environ.setdefault("KREA2_CPU_BF16", "0")


# The files whose tests take longest (CI's --durations), first: .ci/run passes --no-loadscope-reorder so
# pytest-xdist's --dist loadfile hands files out in this order (its default re-sorts them by test
# count, which left the longest file for last on one worker). Any order passes: the three tests that
# once depended on it (test_memory's exact comparisons, now on one thread; the session tiny_pipe,
# now restored after each test by restore_tiny_pipe; the ComfyUI server's loader defaults, which
# test_comfyui_references no longer shadows) were fixed. Order only: nothing is skipped.
SLOW_FIRST = (
    "test_proving_ground.py", "test_app_train.py", "test_finetune_scale.py", "test_finetune_distributed.py",
    "test_posttrain_distill.py", "test_posttrain_scale.py", "test_examples.py", "test_posttrain_dpo.py",
    "test_finetune_pairs.py", "test_posttrain_distributed.py", "test_pretrain_distributed.py", "test_chunked_linear.py",
    "test_compiled_blocks.py",
)
# Files whose tests use the session's servers: for pytest-xdist one unit of work per server, so each
# server starts once, in one worker (13-17 s of CPU a start), instead of once in each. The demo app's
# unit (``app_server``) is scheduled where its first file comes (test_app_train.py, above); the real
# ComfyUI's (``comfyui``), :data:`HARNESS_LAST`, comes last but for :data:`AFTER_HARNESS`.
APP_FILES = frozenset({"test_app.py", "test_app_train.py"})
# Late in the collection, so their unit is among the last handed to a worker: on a fresh machine .ci/run
# builds the harness in the background (~5 min beside the tests); in one unit with the app's files the
# first ComfyUI test still came ~4 min in and waited 129-165 s for it with its worker idle.
# test_speed_knobs.py also starts the app once for its one app test.
HARNESS_LAST = ("test_finetune_lora_bases.py", "test_finetune_lycoris.py", "test_speed_knobs.py",
                "test_comfyui_server.py", "test_comfyui_references.py")
# ...all but these files, which come after the harness's unit: with that unit (~90 s) last of all, the
# other worker ran out of work and idled while it ran (pytest 908 s for 1,709 s of tests on 2 workers).
# These (~100 s in all, none over 35 s) fill that worker instead; the harness unit still starts
# ~13 min in, long after a fresh build (2-5 min) is done.
AFTER_HARNESS = ("test_train_stop.py", "test_style_pipeline.py", "test_report_rule.py", "test_report.py",
                 "test_run_lock.py", "test_step_caches.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    rank.update({name: len(SLOW_FIRST) + 1 + i for i, name in enumerate(HARNESS_LAST + AFTER_HARNESS)})
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: file order kept otherwise


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a plain pytest run without xdist ignores it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the :data:`APP_FILES` as one unit and the :data:`HARNESS_LAST` as
    another (xdist's scheduler hook; its LoadScopeScheduling documents ``_split_scope`` as the method a
    subclass overrides)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ServersTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            name = Path(path).name
            return "app" if name in APP_FILES else "comfyui" if name in HARNESS_LAST else path

    return ServersTogether(config, log)


def small_config(**overrides) -> dict:
    """A transformer config small enough for float64 parity tests, with GQA (4 query / 2 kv heads)."""
    config = dict(
        in_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, timestep_embed_dim=32, text_hidden_dim=32, num_text_layers=3,
        text_num_attention_heads=2, text_num_key_value_heads=1, text_intermediate_size=48,
        num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(4, 6, 6),
    )
    config.update(overrides)
    return config


def random_state_dict(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> dict:
    """Random values for every tensor, zero-initialised tables and norm scales included."""
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=generator, dtype=torch.float64).to(v.dtype) * std for k, v in model.state_dict().items()}


@pytest.fixture
def one_thread():
    """Tiny matrices: extra threads only add synchronisation (token-by-token decoding is ~20x slower
    with 2 threads on a busy 2-core machine). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def session_threads():
    """Entry points run in-process (``main([...])``) choose threads for their model
    (krea2_diffusers.cpu_threads: tiny models single-threaded): each test starts from the session's count."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any model load fails the test (for checks that must refuse a config before loading)."""
    import finetune.model

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(finetune.model, "load_pipeline", no_loading)


SESSION_PIPES: list[Krea2Pipeline] = []  # the session's tiny_pipe once a test asked for it


@pytest.fixture(scope="session")
def tiny_pipe() -> Krea2Pipeline:
    """One tiny-random pipeline for the session. Tests may load LoRAs into it or enable a step cache:
    ``restore_tiny_pipe`` takes them off after each test, so no test sees another's (any file order passes)."""
    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    pipe.set_progress_bar_config(disable=True)
    SESSION_PIPES.append(pipe)
    return pipe


@pytest.fixture(autouse=True)
def restore_tiny_pipe():
    yield
    for pipe in SESSION_PIPES:
        if pipe.get_list_adapters():
            pipe.unload_lora_weights()
        if getattr(pipe.transformer, "is_cache_enabled", False):
            pipe.transformer.disable_cache()


@pytest.fixture(scope="session")
def oracle_pipe(tiny_pipe):
    """diffusers' own Krea2Pipeline over the same tiny components (the transformer copied into diffusers' class)."""
    import diffusers

    transformer = diffusers.Krea2Transformer2DModel(**tiny_pipe.transformer.config)
    transformer.load_state_dict(tiny_pipe.transformer.state_dict())
    pipe = diffusers.Krea2Pipeline(
        scheduler=tiny_pipe.scheduler, vae=tiny_pipe.vae, text_encoder=tiny_pipe.text_encoder.model,
        tokenizer=tiny_pipe.tokenizer, transformer=transformer.eval(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pair_of_transformers(dtype: torch.dtype, **overrides):
    """Ours and diffusers' transformer with identical random weights."""
    import diffusers

    config = small_config(**overrides)
    ours = Krea2Transformer2DModel(**config)
    theirs = diffusers.Krea2Transformer2DModel(**config)
    state = random_state_dict(theirs)
    theirs.load_state_dict(state)
    ours.load_state_dict(state)
    return ours.to(dtype).eval(), theirs.to(dtype).eval()


__all__ = ["small_config", "random_state_dict", "pair_of_transformers", "randomize_"]


@pytest.fixture(scope="session")
def comfyui(tmp_path_factory):
    """One real ComfyUI server for the whole session (``comfyui_harness``); skipped without the harness."""
    from comfyui_harness import HARNESS, NO_HARNESS, start_server

    if not HARNESS:
        pytest.skip(NO_HARNESS)
    server = start_server(tmp_path_factory.mktemp("comfyui-base"))
    yield server
    server.stop()


# ----------------------------------------------------------------------------- the demo app, served once
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
OFFLINE = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost"}
APP_CARD_GIB = 16  # the Train tab plans for a 16 GiB card (--train-gpu-memory), whatever this machine has


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_app(args: list[str], cwd: Path, log: Path, env: dict):
    """``python app.py ARGS`` started in ``cwd`` as a user starts it, output to ``log``; yields once Gradio
    says it serves, terminates it afterwards."""
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, str(ROOT / "app.py"), *args], cwd=cwd, stdout=out,
                                  stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while "Running on local URL" not in log.read_text():
            assert server.poll() is None, f"app.py exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"app.py did not start:\n{log.read_text()}"
            time.sleep(0.3)
        yield
    finally:
        server.terminate()
        server.wait(timeout=120)


@pytest.fixture(scope="session")
def app_server(tmp_path_factory):
    """``python app.py --model tiny-random --runs-dir RUNS --train-gpu-memory 16``, as a user starts it:
    ``url``, ``runs`` (the runs folder) and ``log``."""
    port = free_port()
    folder = tmp_path_factory.mktemp("app")
    log, runs = folder / "app.log", folder / "runs"
    with running_app(["--model", "tiny-random", "--port", str(port), "--runs-dir", str(runs), "--train-gpu-memory",
                      str(APP_CARD_GIB)], ROOT, log, {**os.environ, **OFFLINE}):
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", runs=runs, log=log)
