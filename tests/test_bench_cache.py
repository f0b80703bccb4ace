"""bench/bench_cache.py's pinned rows on tiny-random (one short setting), and the GPU script's arguments
(bench/device/bench_cache_full.py runs only on a GPU machine; here it must import and parse)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_cache  # noqa: E402

ROW_KEYS = {"method", "threshold", "steps", "guidance", "lora", "forwards", "seconds", "speedup", "accuracy", "fd", "max_abs_diff"}


def test_bench_cache_rows_on_tiny_random():
    args = bench_cache.parse_args(["--model", "tiny-random", "--quick", "--per-digit", "1", "--repeats", "1"])
    assert args.side_by_side == ["tiny", "proportioned"] and bench_cache.parse_args([]).model == "krea2-digits"
    pipe = bench_cache.load(args.model, "cpu")
    with torch.inference_mode():
        rows = bench_cache.run_setting(pipe, {"steps": 4, "cfg": False, "distilled": True}, args, judge=None, lora=False, trigger=None)
    assert [r["method"] for r in rows] == ["none", "fbcache", "taylorseer", "magcache", "magcache_calibrated", "dbcache"]
    for row in rows:
        assert ROW_KEYS <= set(row) and row["steps"] == 4 and row["guidance"] == 0.0 and row["lora"] is False
        assert row["accuracy"] is None and row["fd"] is None and row["seconds"] > 0  # random weights: no judge
    none = rows[0]
    assert none["forwards"] == 4 and none["max_abs_diff"] == 0 and none["speedup"] == 1
    assert all(r["forwards"] <= 4 for r in rows)
    # with CFG the guidance interval joins the grid
    assert ("guidance_interval", (0.2, 0.7)) in bench_cache.configurations(cfg=True, quick=True)


def test_gpu_cache_bench_parses_its_arguments():
    spec = importlib.util.spec_from_file_location("bench_cache_full", BENCH / "device" / "bench_cache_full.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args([])
    assert (args.size, args.steps, args.guidance, args.tiny) == (1024, 28, 3.5, False)
    assert module.parse_args(["--tiny", "--size", "64", "--no-compile"]).no_compile
