"""A run's kept checkpoints (``RUN/checkpoints/step-N``) and exporting one of them into the run
folder, ``RUN/exports/step-N/``, with ``krea2 export``'s code (:func:`finetune.export.writer.export_checkpoint`),
in the formats and with the trigger words of the run's own final export: files that
``Krea2Pipeline.load_lora_weights`` (and ComfyUI, kohya tools) read."""

from __future__ import annotations

from pathlib import Path

from krea2_diffusers.files import atomic_write_dir

from .errors import TrainInputError

EXPORTS_FOLDER = "exports"


def kept_steps(run_dir: Path) -> list[int]:
    """The steps of the run's complete checkpoints, oldest first (older ones are removed as the run
    goes on: ``checkpointing.keep_last``)."""
    from finetune.engine.checkpoint import list_checkpoints

    return [step for step, _ in list_checkpoints(run_dir / "checkpoints")]


def step_number(value) -> int:
    """``value`` as a step (a whole number >= 1; ``"12"`` and ``12.0`` are 12); refused naming the value."""
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if not (number.is_integer() and number >= 1):
        raise TrainInputError(f"step must be the whole number of a kept checkpoint (e.g. 250), got {value!r}.")
    return int(number)


def export_step(run_dir: Path, config: dict, step) -> list[Path]:
    """The files of checkpoint ``step`` of the run in ``run_dir`` (``config``: its ``train.yaml``),
    written into ``RUN/exports/step-N/`` (whole: written aside, then moved in); a step exported
    before is not written again. Refused, naming the kept steps, when the run keeps no checkpoint of
    that step."""
    from finetune.engine.checkpoint import STATE_FILE, checkpoint_name
    from finetune.export.writer import export_checkpoint

    step = step_number(step)
    checkpoint = run_dir / "checkpoints" / checkpoint_name(step)
    if not ((checkpoint / STATE_FILE).is_file() and (checkpoint / ".metadata").is_file()):
        kept = ", ".join(map(str, kept_steps(run_dir))) or "none yet"
        raise TrainInputError(f"Run {run_dir.name} keeps no checkpoint of step {step} (kept: {kept}).")
    out = run_dir / EXPORTS_FOLDER / checkpoint_name(step)
    if not out.is_dir():
        export = config.get("export") or {}
        try:
            with atomic_write_dir(out) as folder:
                export_checkpoint(checkpoint, folder, export.get("formats"), export.get("trigger_words") or [])
        except FileNotFoundError as err:  # removed by the running trainer (keep_last) while being read
            raise TrainInputError(f"Checkpoint step {step} of run {run_dir.name} was removed while exporting it "
                                  f"(the run keeps its newest ones): {err}") from None
    return sorted(p for p in out.iterdir() if p.is_file())
