"""The Train tab's input checks on plain values (``train_tab.actions.TrainActions``, no server): paths
confined to the data roots (the app may be exposed with --share), the base model checked before any
folder is walked, whole numbers in range, the ``captions`` choice of a start, and the run view's
sample timeline and speed. Fast: no model is loaded, no plan built, no training process started
(the end-to-end checks through the served app are in tests/test_app_train.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from train_tab.actions import TrainActions, duration
from train_tab.errors import TrainInputError
from train_tab.plan import Fit
from train_tab.roots import DataRoots
from train_tab.runs import MANIFEST_NAME, Runs

FOREIGN = Path("/etc")  # on every Linux machine, full of files whose names must not leak


def make_images(folder: Path, count: int = 2, prefix: str = "picture") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        paths.append(folder / f"{prefix}_{i}.png")
        Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(paths[-1])
    return paths


def names_in(message: str) -> set[str]:
    """The words of a message, paths split into their parts: what could name a file."""
    return set(re.split(r"[\s,;:()'\"/]+", message)) - {""}


@pytest.fixture
def actions(tmp_path):
    """A Train tab whose runs folder is ``tmp_path/work/runs`` (the default data root: ``tmp_path/work``)
    and whose training command is ``true`` (a run "trains" in no time)."""
    (tmp_path / "work").mkdir()
    return TrainActions(Runs(tmp_path / "work" / "runs", train_command=(shutil.which("true"),)), "tiny-random")


@pytest.fixture
def no_plan(monkeypatch):
    """Start does everything but the plan (25 s on tiny-random on a busy 2-core machine): it fits."""
    import train_tab.actions

    monkeypatch.setattr(train_tab.actions, "fit", lambda *args, **kwargs: Fit(True, "fits: planned away", 1.0, 16.0))


# ----------------------------------------------------------------------------- paths
def test_a_foreign_folder_is_refused_without_naming_its_files(actions, tmp_path):
    root = str(tmp_path / "work")
    foreign_files = set(os.listdir(FOREIGN))
    assert foreign_files  # the check below means something
    for call in (lambda: actions.images(str(FOREIGN)), lambda: actions.plan(str(FOREIGN), "48gb+", None),
                 lambda: actions.start(str(FOREIGN), "48gb+", None, "acme", 10)):
        with pytest.raises(TrainInputError) as refused:
            call()
        message = str(refused.value)
        assert "outside the allowed data roots" in message and root in message, message
        assert not names_in(message) & foreign_files, message
    # The same through a symlink inside the root, and through ".." out of it.
    (tmp_path / "work" / "link").symlink_to(FOREIGN)
    for folder in (tmp_path / "work" / "link", tmp_path / "work" / ".." / ".." / ".." / ".." / ".." / ".." / "etc"):
        with pytest.raises(TrainInputError, match="outside the allowed data roots") as refused:
            actions.images(str(folder))
        assert not names_in(str(refused.value)) & foreign_files


def test_a_missing_folder_outside_the_roots_is_refused_like_an_existing_one(actions, tmp_path):
    """No answer tells whether a path outside the roots exists."""
    answers = []
    for folder in (tmp_path / "outside", tmp_path / "nowhere"):
        (tmp_path / "outside").mkdir(exist_ok=True)
        with pytest.raises(TrainInputError) as refused:
            actions.images(str(folder))
        answers.append(str(refused.value).replace(str(folder), "FOLDER"))
    assert answers[0] == answers[1] and "outside the allowed data roots" in answers[0]


def test_table_rows_are_confined_to_the_roots(actions, tmp_path):
    inside = make_images(tmp_path / "work" / "data")
    outside = make_images(tmp_path / "elsewhere", prefix="secret")
    assert actions.images("", [[str(p), "c"] for p in inside]) == [[str(p), "c"] for p in inside]
    (tmp_path / "work" / "data" / "alias.png").symlink_to(outside[0])
    for path in (outside[0], tmp_path / "work" / "data" / "alias.png", tmp_path / "work" / ".." / "elsewhere" / outside[1].name,
                 FOREIGN / "hostname"):
        for call in (lambda: actions.images("", [[str(inside[0]), "c"], [str(path), "c"]]),
                     lambda: actions.caption_missing([[str(path), ""]]),
                     lambda: actions.thumbnails([[str(path), "c"]])):
            with pytest.raises(TrainInputError) as refused:
                call()
            message = str(refused.value)
            assert "outside the allowed data roots" in message and "secret" not in message, message
            assert "hostname" not in message
    with pytest.raises(TrainInputError, match="The image of row 2 is outside"):
        actions.images("", [[str(inside[0]), "c"], [str(outside[0]), "c"]])


def test_images_and_caption_files_that_point_out_of_the_root_are_not_read(actions, tmp_path):
    data = tmp_path / "work" / "data"
    make_images(data, 1)
    secret = make_images(tmp_path / "elsewhere", 1, prefix="secret")[0]
    secret.with_suffix(".txt").write_text("the secret caption")
    (data / "picture_0.txt").symlink_to(secret.with_suffix(".txt"))
    assert actions.images(str(data)) == [[str(data / "picture_0.png"), ""]]  # the caption outside is not read
    (data / "zz.png").symlink_to(secret)
    with pytest.raises(TrainInputError, match=r"zz.png \(in .*\) is outside the allowed data roots") as refused:
        actions.images(str(data))
    assert "secret" not in str(refused.value)


def test_uploads_and_extra_roots_are_allowed(tmp_path):
    uploads, extra = tmp_path / "gradio", tmp_path / "datasets"
    images = make_images(uploads, 1) + make_images(extra / "set", 1)
    (tmp_path / "work").mkdir()
    actions = TrainActions(Runs(tmp_path / "work" / "runs"), "tiny-random", roots=DataRoots([extra, uploads]))
    assert actions.images("", [[str(p), "c"] for p in images]) == [[str(p), "c"] for p in images]
    assert actions.images(str(extra / "set")) == [[str(images[1]), ""]]
    with pytest.raises(TrainInputError, match="outside the allowed data roots"):
        actions.images(str(tmp_path / "work"))  # the runs folder's parent is a root only by default
    with pytest.raises(ValueError, match="is not a folder"):
        DataRoots([tmp_path / "missing"])


# ----------------------------------------------------------------------------- the base model
def test_the_base_model_is_checked_before_any_folder_is_walked(actions, tmp_path, monkeypatch):
    images = make_images(tmp_path / "work" / "data")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner" / "name").mkdir(parents=True)  # hub-id-shaped, but a local folder outside the roots

    def no_walk(self, pattern):
        raise AssertionError(f"walked {self} before checking it")

    monkeypatch.setattr(Path, "rglob", no_walk)
    rows = [[str(p), "c"] for p in images]
    for name in ("/", str(FOREIGN), "../../..", str(tmp_path / "owner"), "owner/name"):
        for call in (lambda: actions.plan("", "48gb+", name, rows), lambda: actions.base(name)):
            with pytest.raises(TrainInputError, match=f"Base model {re.escape(repr(name))} is outside the allowed data roots"):
                call()


def test_valid_base_model_names(tmp_path):
    (tmp_path / "work" / "models" / "mine").mkdir(parents=True)
    actions = TrainActions(Runs(tmp_path / "work" / "runs"), "/srv/models/krea2-raw.safetensors",
                           models=("/srv/models/krea2-turbo.safetensors",))
    for name in ("tiny-random", "krea/Krea-2-Raw", "/srv/models/krea2-raw.safetensors", "/srv/models/krea2-turbo.safetensors",
                 str(tmp_path / "work" / "models" / "mine"), str(tmp_path / "work" / "models" / "not-yet.safetensors")):
        assert actions.base(name) == name
    assert actions.base("  ") == "/srv/models/krea2-raw.safetensors"  # empty: the app's own
    with pytest.raises(TrainInputError, match="outside"):
        actions.base("/srv/models/other.safetensors")  # beside a configured model is not a configured model


# ----------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("steps, sample_every, message", [
    (-5, None, "Steps must be a whole number between 1 and 100000 .* got -5"),
    (2.5, None, "Steps must be a whole number .* got 2.5"),
    ("ten", None, "Steps must be a whole number .* got 'ten'"),
    (10**6, None, "Steps must be a whole number between 1 and 100000 .* got 1000000"),
    (True, None, "Steps must be a whole number .* got True"),
    (20, -3, "Sample every must be a whole number between 1 and 20 .* got -3"),
    (20, 21, "Sample every must be a whole number between 1 and 20 .* got 21"),
    (20, 0.5, "Sample every must be a whole number .* got 0.5"),
    (None, float("nan"), "Sample every must be a whole number between 1 and 1500 .* got nan"),
])
def test_invalid_numbers_are_refused_naming_the_field_and_value(actions, steps, sample_every, message):
    with pytest.raises(TrainInputError, match=message):
        actions.config_for(Path("RUN"), Path("RUN/m.jsonl"), "24gb", "tiny-random", "acme", steps, sample_every)
    with pytest.raises(TrainInputError, match=message):  # refused before the images are looked at
        actions.start("", "24gb", "tiny-random", "acme", steps, sample_every)


def test_numbers_in_range_and_the_defaults(actions):
    def every(steps, sample_every):
        config = actions.config_for(Path("RUN"), Path("RUN/m.jsonl"), "24gb", "tiny-random", "", steps, sample_every)
        return config["training"]["max_steps"], config["validation"]["every_n_steps"]

    assert every(None, None) == every(0, 0) == every("", "") == (1500, 375)  # the preset's steps, a sample every steps / 4
    assert every(20.0, "5") == (20, 5) and every(1, 1) == (1, 1) and every(20, 20) == (20, 20)


# ----------------------------------------------------------------------------- captions at start
def test_start_without_captions_names_the_endpoint_and_the_option(actions, tmp_path, no_plan):
    data = tmp_path / "work" / "data"
    make_images(data)
    with pytest.raises(TrainInputError, match=r"2 image\(s\) have no caption") as refused:
        actions.start(str(data), "24gb", "tiny-random", "acme", 4)
    assert "/train_caption" in str(refused.value) and "captions='trigger'" in str(refused.value)
    with pytest.raises(TrainInputError, match="give a trigger word"):
        actions.start(str(data), "24gb", "tiny-random", "", 4, captions="trigger")
    with pytest.raises(TrainInputError, match="captions must be one of 'required', 'trigger', got 'none'"):
        actions.start(str(data), "24gb", "tiny-random", "acme", 4, captions="none")
    assert not actions.runs.root.exists() or actions.runs.ids() == []


def test_start_with_trigger_captions_trains_on_the_trigger_word(actions, tmp_path, no_plan):
    data = tmp_path / "work" / "data"
    make_images(data, 3)
    (data / "picture_1.txt").write_text("a red square")
    run_id = actions.start(str(data), "24gb", "tiny-random", " acme ", 4, captions="trigger")
    manifest = [json.loads(line) for line in (actions.runs.root / run_id / MANIFEST_NAME).read_text().splitlines()]
    assert [(Path(r["path"]).name, r["caption"]) for r in manifest] == [
        ("picture_0.png", "acme"), ("picture_1.png", "acme, a red square"), ("picture_2.png", "acme")]
    assert actions.runs.ids() == [run_id]


def test_start_with_masks_and_a_regularisation_folder(actions, tmp_path, no_plan):
    """Masks beside the images (never taken for images themselves) and a captioned regularisation
    folder make a config ``krea2 train`` accepts and whose datasets find them; what cannot train is
    refused before anything is written."""
    from finetune.config import build_config
    from finetune.data.samples import prepare_samples
    from train_tab.runs import REGULARIZATION_NAME

    data, prior = tmp_path / "work" / "data", tmp_path / "work" / "prior"
    images = make_images(data, 2)
    for image in images:
        image.with_suffix(".txt").write_text("a red square")
    with pytest.raises(TrainInputError, match=r"none of the 2 images has one beside it \(e.g. picture_0.mask.png"):
        actions.start(str(data), "24gb", "tiny-random", "acme", 4, masks=True)
    Image.fromarray(np.full((8, 8), 255, np.uint8)).save(data / "picture_0.mask.png")
    with pytest.raises(TrainInputError, match="picture_0.mask.png is 8x8 but its image .* is 16x16"):
        actions.start(str(data), "24gb", "tiny-random", "acme", 4, masks=True)
    Image.fromarray(np.full((16, 16), 255, np.uint8)).save(data / "picture_0.mask.png")
    assert [Path(p).name for p, _ in actions.images(str(data))] == ["picture_0.png", "picture_1.png"]
    with pytest.raises(TrainInputError, match="uploaded images have none"):
        actions.start("", "24gb", "tiny-random", "acme", 4, rows=[[str(p), "c"] for p in images], copy_images=True, masks=True)
    make_images(prior, 2, prefix="dog")
    with pytest.raises(TrainInputError, match=r"2 regularisation image\(s\) have no caption"):
        actions.start(str(data), "24gb", "tiny-random", "acme", 4, regularization_folder=str(prior))
    with pytest.raises(TrainInputError, match="outside the allowed data roots"):
        actions.start(str(data), "24gb", "tiny-random", "acme", 4, regularization_folder=str(FOREIGN))
    assert not actions.runs.root.exists() or actions.runs.ids() == []

    for path in prior.glob("*.png"):
        path.with_suffix(".txt").write_text("a photo of a dog")
    run_id = actions.start(str(data), "24gb", "tiny-random", "acme", 4, masks=True, regularization_folder=str(prior))
    run = actions.runs.root / run_id
    regularization = [json.loads(line) for line in (run / REGULARIZATION_NAME).read_text().splitlines()]
    assert [(Path(r["path"]).name, r["caption"]) for r in regularization] == [("dog_0.png", "a photo of a dog"),
                                                                           ("dog_1.png", "a photo of a dog")]
    config = build_config(yaml.safe_load((run / "train.yaml").read_text()), ["data.resolution=16"])  # 16 px test images
    assert config.data.masks is True and [d.is_regularization for d in config.data.datasets] == [False, True]
    samples, _, _ = prepare_samples(config, run, type("Main", (), {"is_main": True, "barrier": lambda self: None})())
    assert [(s.image_path.name, s.mask.name if s.mask else None, s.dataset) for s in samples] == [
        ("picture_0.png", "picture_0.mask.png", 0), ("picture_1.png", None, 0), ("dog_0.png", None, 1), ("dog_1.png", None, 1)]


def test_start_in_pairs_mode_takes_each_images_references_from_the_references_folder(actions, tmp_path, no_plan):
    """Pairs mode (edit / reference LoRA): the images are the targets, their references NAME.png or
    NAME_k.png in the references folder; what cannot train is refused naming the file before anything
    is written, and the run's config is one ``krea2 train`` accepts, its manifest giving each target
    its references."""
    from finetune.config import build_config
    from finetune.data.samples import prepare_samples

    data, references = tmp_path / "work" / "targets", tmp_path / "work" / "references"
    for image in make_images(data, 2):
        image.with_suffix(".txt").write_text("make it red")
    make_images(references, 1)  # picture_0.png only
    start = lambda folder=str(references): actions.start(str(data), "24gb", "tiny-random", "", 4, references_folder=folder)
    with pytest.raises(TrainInputError, match=r"target \S*picture_1.png has no reference image"):
        start()
    make_images(references, 2, prefix="picture_1")  # picture_1_0.png, picture_1_1.png
    (references / "picture_1_2.png").write_text("not an image")
    with pytest.raises(TrainInputError, match=r"picture_1_2.png of target picture_1.png is not an image"):
        start()
    make_images(references, 4, prefix="picture_1")
    with pytest.raises(TrainInputError, match=r"picture_1.png has 4 references .* more than data.references.max_references=3"):
        start()
    with pytest.raises(TrainInputError, match="outside the allowed data roots"):
        start(str(FOREIGN))
    assert not actions.runs.root.exists() or actions.runs.ids() == []

    (references / "picture_1_3.png").unlink()
    run = actions.runs.root / start()
    rows = [json.loads(line) for line in (run / MANIFEST_NAME).read_text().splitlines()]
    assert [[Path(r).name for r in row["references"]] for row in rows] == [
        ["picture_0.png"], ["picture_1_0.png", "picture_1_1.png", "picture_1_2.png"]]
    config = build_config(yaml.safe_load((run / "train.yaml").read_text()), ["data.resolution=16"])  # 16 px test images
    assert [Path(p).name for p in config.validation.reference_images[0]] == ["picture_0.png"]
    samples, _, _ = prepare_samples(config, run, type("Main", (), {"is_main": True, "barrier": lambda self: None})())
    assert [(s.image_path.name, [r.name for r in s.references]) for s in samples] == [
        ("picture_0.png", ["picture_0.png"]), ("picture_1.png", ["picture_1_0.png", "picture_1_1.png", "picture_1_2.png"])]


# ----------------------------------------------------------------------------- watching a run
def test_the_timeline_lists_every_sample_by_step_and_the_speed_is_shown(actions, tmp_path):
    data = make_images(tmp_path / "work" / "data", 1)
    run_id = actions.runs.create(lambda run, manifest: actions.config_for(run, manifest, "24gb", "tiny-random", "acme", 20, 5),
                                 [[str(data[0]), "c"]], "acme")
    run = actions.runs.root / run_id
    assert actions.timeline(run_id) == [] and actions.speed(run_id) == "s/step: after the second step"
    for step, names in ((10, ["0.png"]), (5, ["1.png", "0.png"]), (20, ["0.png"])):
        (run / "samples" / f"step-{step:06d}").mkdir(parents=True)
        for name in names:
            Image.new("RGB", (4, 4)).save(run / "samples" / f"step-{step:06d}" / name)
    (run / "samples" / "step-notes").mkdir()
    assert [(Path(p).relative_to(run).as_posix(), label) for p, label in actions.timeline(run_id)] == [
        ("samples/step-000005/0.png", "step 5"), ("samples/step-000005/1.png", "step 5"),
        ("samples/step-000010/0.png", "step 10"), ("samples/step-000020/0.png", "step 20")]
    # The first step's time includes the set-up and is left out: (0.5 + 1.5) / 2 = 1.00 s/step.
    rows = [{"step": 1, "loss": 0.5, "step_time": 30.0}, {"step": 2, "loss": 0.4, "step_time": 0.5},
            {"step": 3, "loss": 0.3, "step_time": 1.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert actions.speed(run_id) == "**1.00 s/step**"  # not running: no ETA
    assert "step 3 / 20 · loss 0.3000" in actions.progress(run_id)


def test_durations():
    assert [duration(s) for s in (0, 42.4, 59.6, 200, 3599, 7500)] == [
        "0 s", "42 s", "1 min 00 s", "3 min 20 s", "59 min 59 s", "2 h 05 min"]


def test_start_with_prodigy_writes_a_prodigy_run(actions, tmp_path, no_plan):
    """The optimizer choice: ``prodigy`` writes a config ``krea2 train`` accepts with Prodigy at its
    rate 1.0 (the multiplier of its own estimate); an unknown one is refused before anything is written."""
    from finetune.config import build_config

    data = tmp_path / "work" / "data"
    for image in make_images(data, 2):
        image.with_suffix(".txt").write_text("a red square")
    with pytest.raises(TrainInputError, match="optimizer must be one of 'adamw', 'prodigy', got 'lion'"):
        actions.start(str(data), "24gb", "tiny-random", "acme", 4, optimizer="lion")
    assert not actions.runs.root.exists() or actions.runs.ids() == []
    run_id = actions.start(str(data), "24gb", "tiny-random", "acme", 4, optimizer="prodigy")
    config = build_config(yaml.safe_load((actions.runs.root / run_id / "train.yaml").read_text()))
    assert (config.optimizer.name, config.optimizer.learning_rate) == ("prodigy", 1.0)
