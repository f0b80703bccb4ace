"""The ``krea2`` command answers help and argument errors without loading torch, diffusers or
bitsandbytes, and bitsandbytes' harmless kernel notice is not shown."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "diffusers", "transformers", "bitsandbytes")
# `krea2 --help` takes ~0.3 s on an idle core; the suite shares 2 busy cores, hence the margin.
HELP_SECONDS = 2.0


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_cli_and_package_import_no_heavy_modules():
    code = (
        "import json, sys\n"
        "import krea2_diffusers, krea2_diffusers.cli as cli\n"
        "parser = cli.build_parser()\n"
        "krea2_diffusers.__all__\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_help_and_argument_errors_are_fast_and_quiet():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "krea2_diffusers.cli", "--help"], capture_output=True, text=True, env=env, timeout=60)
        best = min(best, time.perf_counter() - start)
        assert out.returncode == 0 and "generate" in out.stdout and out.stderr == ""
    assert best < HELP_SECONDS, f"krea2 --help took {best:.2f} s"
    bad = subprocess.run([sys.executable, "-m", "krea2_diffusers.cli", "generate"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "prompt" in bad.stderr and "bitsandbytes" not in bad.stderr


def test_generate_refuses_an_existing_output_before_importing_torch(tmp_path):
    existing = tmp_path / "keep.png"
    existing.write_bytes(b"user data")
    code = (
        "import json, sys\n"
        "from krea2_diffusers.cli import main\n"
        f"code = main(['generate', 'a fox', '--output', {str(existing)!r}])\n"
        f"print(json.dumps([code, [m for m in {HEAVY!r} if m in sys.modules]]))\n"
    )
    out = run_python(code)
    assert json.loads(out.stdout) == [2, []], out.stderr
    assert "refusing to overwrite" in out.stderr and existing.read_bytes() == b"user data"


def test_lazy_exports_resolve():
    import krea2_diffusers

    assert krea2_diffusers.Krea2Img2ImgPipeline.__name__ == "Krea2Img2ImgPipeline"
    assert set(krea2_diffusers.__all__) <= set(dir(krea2_diffusers))


def test_bitsandbytes_kernel_notice_is_filtered():
    import krea2_diffusers

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    notice = logger.makeRecord(logger.name, logging.WARNING, __file__, 1,
                               "Failed to load CPU gemm_4bit_forward from kernels-community: %s.", ("no kernels",), None)
    other = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "something else", (), None)
    assert krea2_diffusers.BITSANDBYTES_NOISE
    assert not logger.filter(notice) and logger.filter(other)


def test_torch_floor_has_the_public_fully_shard():
    """finetune/ uses FSDP2's public ``torch.distributed.fsdp.fully_shard`` (torch >= 2.6)."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    assert not torch_req.specifier.contains(Version("2.5.1")) and torch_req.specifier.contains(Version("2.6.0"))
