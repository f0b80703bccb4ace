"""Issue 39's table over seeds (bench/proving/across_seeds.py): means and ranges per stage, and which
seeds met each gate, matched by name although each run's claim carries its own figures."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from proving.across_seeds import table  # noqa: E402


def run(seed, accuracy, fd, met):
    return {"seed": seed, "total_seconds": 60.0 * (40 + seed),
            "stages": {"base": {"accuracy": accuracy, "fd": fd, "diversity": 10.0},
                       "lora": {"accuracy": accuracy, "fd": fd, "diversity": 9.0, "concept": 0.5 + seed / 10}},
            "edit": {"concept": 1.0, "accuracy": 0.9, "iou_source": 0.8, "iou_other": 0.4, "iou_ratio": 2.0},
            "checks": [{"claim": f"base accuracy {accuracy} >= 0.90 and > base_nocfg {accuracy - 0.1}", "met": met},
                       {"claim": f"lora: concept share {0.5 + seed / 10} >= 0.90", "met": False},
                       {"claim": f"judge and reward share no training scan ({seed} shared)", "met": seed == 0}]}


def test_means_ranges_and_gates_by_name():
    text = table([run(0, 0.9, 100.0, True), run(1, 1.0, 120.0, False), run(2, 0.95, 110.0, True)])
    assert "| base | 0.950 [0.900, 1.000] | 110.0 [100.0, 120.0] | 10.0 [10.0, 10.0] |  |" in text
    assert "| lora | 0.950 [0.900, 1.000] | 110.0 [100.0, 120.0] | 9.0 [9.0, 9.0] | 0.600 [0.500, 0.700] |" in text
    assert "| base accuracy | 0, 2 (of 3) |" in text and "| lora | none (of 3) |" in text
    assert "| judge and reward share no training scan | 0 (of 3) |" in text
    assert "seed 0: 40.0, seed 1: 41.0, seed 2: 42.0" in text


def test_published_tables_are_the_committed_runs():
    """The three-seed tables are what across_seeds.py prints for the committed runs' JSON: the current
    code's runs (results/zen4/) in the README's summary (its stage rows), the earlier machines' (results/) in
    the proving ground's history (bench/proving/HISTORY.md). Their figures can be checked, and rebuilt by anyone who
    reruns the seeds."""
    root = Path(__file__).resolve().parents[1]
    results = root / "bench" / "proving" / "results"
    for folder, doc in ((results / "zen4", root / "README.md"), (results, root / "bench" / "proving" / "HISTORY.md")):
        text = doc.read_text()
        runs = sorted(folder.glob("seed*.json"))
        assert [p.name for p in runs] == ["seed0.json", "seed1.json", "seed2.json"], folder
        printed = table([json.loads(p.read_text()) for p in runs])
        rows = [line for line in printed.splitlines() if line.startswith("| ")]
        if doc.name == "README.md":  # its gate rows are verdicts.py's, with seed 3 and the block means (below)
            rows = rows[:rows.index("| gate | met at seeds |")]
        missing = [line for line in rows if line not in text]
        assert not missing, (folder, doc.name, missing)


def test_each_training_command_continues_a_run_a_killed_bench_left(tmp_path):
    """``--resume`` of the proving ground passes ``--resume`` to the stage's command only when its
    folder holds a run (a fresh folder must not be resumed), and every training command runner uses it."""
    import inspect

    from proving import lora, posttraining, pretraining

    config = {"output_dir": str(tmp_path / "run")}
    assert pretraining.resume_flag(config) == []
    (tmp_path / "run").mkdir()
    assert pretraining.resume_flag(config) == []  # a folder without a run
    (tmp_path / "run" / "run.json").write_text("{}")
    assert pretraining.resume_flag(config) == ["--resume"]
    for runner in (pretraining.run_pretraining, lora.train_and_copy, posttraining.run_posttrain):
        assert "*resume_flag(config)" in inspect.getsource(runner), runner.__name__


def test_checkpoint_choices_are_the_scheduled_ones_whatever_a_stop_signal_saved(tmp_path):
    """A bench killed with SIGTERM leaves a checkpoint off the schedule (the trainer saves before it exits:
    seed 0's GRPO had step-53 beside 50, 100, 150). The curves, the base choice and the report proof choose
    among the scheduled checkpoints only, so a resumed bench chooses as an uninterrupted one does."""
    import inspect

    from proving import curves, pretraining, report_proof

    for step in (150, 50, 53, 100):
        (tmp_path / "checkpoints" / f"step-{step}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-75.partial").write_text("")  # not a checkpoint folder
    assert pretraining.checkpoint_steps(tmp_path) == [50, 53, 100, 150]
    assert pretraining.checkpoint_steps(tmp_path, 50) == [50, 100, 150]
    for chooser in (curves.evaluate_run, report_proof.judge_checkpoints):
        assert inspect.signature(chooser).parameters["every"].default is inspect.Parameter.empty, chooser.__name__
    assert "checkpoint_steps(run_dir, spec.checkpoint_every)" in inspect.getsource(pretraining.run_pretraining)


def test_five_block_verdicts_read_the_bench_gate_on_the_block_means(tmp_path):
    """verdicts.py: a post-trained stage's five-block verdict is the bench's own gate on its block means (accuracy,
    FD, base_nocfg's accuracy, the block-averaged frontier) with the evaluation block's diversity; a LoRA's is
    lora_check's; a seed without block JSON has none."""
    from proving.verdicts import five_block_verdicts, table

    def spread(frontier_fd):
        return {"rows": {"base, guidance 0.0": [{"block": 1, "accuracy": 0.80, "fd": 20.0}, {"block": 5, "accuracy": 0.80, "fd": 22.0}],
                         "dpo": [{"block": 1, "accuracy": 0.90, "fd": 30.0}, {"block": 5, "accuracy": 0.94, "fd": 24.0}]},
                "frontier": {"dpo": {"frontier_fd": frontier_fd}}}

    def run(seed, diversity=18.0):
        return {"seed": seed, "vae": {},
                "stages": {"base_nocfg": {"accuracy": 0.70, "fd": 20.0, "diversity": 20.0},
                           "dpo": {"accuracy": 0.90, "fd": 30.0, "diversity": diversity, "frontier_fd": 25.0}},
                "checks": [{"claim": "dpo: error 0.100 <= 0.6 x base_nocfg error 0.180; ...", "met": False},
                           {"claim": "lora: concept share 1.0 >= 0.90 ...", "met": seed == 3}]}

    # means: dpo error 0.08 <= 0.6 x 0.20; FD 27.0 <= 1.1 x 26.0 = 28.6; diversity 18 >= 0.5 x 20
    assert five_block_verdicts(run(0), spread(26.0), None) == {"dpo": True}
    assert five_block_verdicts(run(0), spread(24.0), None) == {"dpo": False}  # 27.0 > 26.4
    assert five_block_verdicts(run(0, diversity=9.0), spread(26.0), None) == {"dpo": False}  # the evaluation block's diversity
    assert five_block_verdicts(run(0), None, {"results": {"lora": {"gate": ["lora: ...", False]}}}) == {"lora": False}
    (tmp_path / "spread_seed0.json").write_text(json.dumps(spread(26.0)))
    (tmp_path / "lora_blocks_seed0.json").write_text(json.dumps({"results": {"lora": {"gate": ["lora: ...", True]}}}))
    text = table([run(0), run(3)], tmp_path)
    assert "| dpo | none (of 2) | 0 (of 1) |" in text and "| lora | 3 (of 2) | 0 (of 1) |" in text


def test_readme_verdicts_are_the_committed_runs():
    """The README's gate table (evaluation block and five blocks, seeds 0-4) is what verdicts.py prints for the
    committed Zen 4 runs and their five-block JSON."""
    from proving.verdicts import table

    root = Path(__file__).resolve().parents[1]
    folder = root / "bench" / "proving" / "results" / "zen4"
    runs = [json.loads((folder / name).read_text()) for name in ("seed0.json", "seed1.json", "seed2.json", "heldout_seed3.json", "heldout_seed4.json")]
    readme = (root / "README.md").read_text()
    missing = [line for line in table(runs, folder).splitlines() if line not in readme]
    assert not missing, missing
