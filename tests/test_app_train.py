"""The app's Train tab on tiny-random: bad input refused with clear messages (through the API, the same
functions as the buttons), paths outside the data roots refused, ``/train_caption``, and a real browser
(Debian chromium, Playwright) captioning 8 images, editing a caption under the thumbnails, reading the
plan, starting a 20-step run, queueing a second one and stopping it while queued, stopping and
resuming the first, exporting its recommended checkpoint from the report and using its LoRA in the
Generate tab, with a screenshot at each stage (kept in the test's tmp folder). Through the API: two
runs started back to back run one after the other, "Sample now" / "Save now" act at the next step of
a running run, and a kept step exported into the run folder loads with ``load_lora_weights``.

The server is conftest's ``app_server`` (one for test_app.py and this file): ``python app.py --model
tiny-random --runs-dir RUNS --train-gpu-memory 16``; training is ``krea2 train`` in a subprocess. Its
data root is the default, the runs folder's parent: the tests' images live there (:func:`inputs`).
"""

from __future__ import annotations

import json
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import CHROMIUM, CHROMIUM_ARGS
from krea2_diffusers.limits import TEST_SIZE_PRESETS

APP_SIZE = next(iter(TEST_SIZE_PRESETS))  # the app's smallest size (64 px)

STEPS = 20
SAMPLE_EVERY = 5
WAIT_MS = 600_000  # a busy 2-core machine: a krea2 train subprocess takes ~10-60 s to set up
EXPORTS = ["lora_comfyui.safetensors", "lora_diffusers.safetensors", "lora_kohya.safetensors"]


def make_images(folder: Path, count: int = 8) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        pixels = np.clip(rng.normal(40 + 25 * i, 30, (64, 64, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"picture_{i}.png")
    return folder


def full_size_header_only(folder: Path, config: dict | None = None) -> Path:
    """A diffusers transformer folder of the released 12.8B config (or ``config``) whose safetensors
    file holds a header and a sparse hole: enough for the plan (which reads no weight), 4 KiB on disk."""
    from krea2_diffusers import Krea2Transformer2DModel

    with torch.device("meta"):
        model = Krea2Transformer2DModel(**(config or {}))  # the class defaults are the released model
    header, offset = {}, 0
    for name, tensor in model.state_dict().items():
        size = tensor.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": "Krea2Transformer2DModel", **(config or {})}))
    raw = json.dumps(header).encode()
    path = folder / "diffusion_pytorch_model.safetensors"
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)
    return folder


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def inputs(app_server, tmp_path: Path) -> Path:
    """A folder of this test's own inside the app's data root (the runs folder's parent)."""
    folder = app_server.runs.parent / "inputs" / tmp_path.name
    folder.mkdir(parents=True)
    return folder


@pytest.fixture(scope="module")
def client(app_server, tmp_path_factory):
    from gradio_client import Client

    return Client(app_server.url, verbose=False, download_files=str(tmp_path_factory.mktemp("downloads")))


def test_bad_input_is_refused_with_a_clear_message_and_writes_nothing(client, app_server, tmp_path):
    from gradio_client.exceptions import AppError

    tmp_path = inputs(app_server, tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "notes.txt").write_text("not an image")
    (texts / "list.csv").write_text("a,b")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "fake.png").write_bytes(b"not a png at all")
    images = make_images(tmp_path / "images", 2)
    cases = [
        ((str(empty), "48gb+", "tiny-random"), "is empty"),
        ((str(texts), "48gb+", "tiny-random"), "holds no images (2 other file(s)"),
        ((str(broken), "48gb+", "tiny-random"), "fake.png is not a readable image"),
        ((str(tmp_path / "nowhere"), "48gb+", "tiny-random"), "is not a folder"),
        ((str(images), "8gb", "tiny-random"), "'8gb' .* is not in the list of choices"),
        (("/etc", "48gb+", "tiny-random"), "/etc is outside the allowed data roots"),
        ((str(images), "48gb+", "/"), "Base model '/' is outside the allowed data roots"),
    ]
    for args, message in cases:
        for endpoint, extra in (("/train_plan", ()), ("/train_start", ("acme", STEPS))):
            with pytest.raises(AppError, match=message if "*" in message else message.replace("(", r"\(").replace(")", r"\)")):
                client.predict(*args, *extra, api_name=endpoint)
    with pytest.raises(AppError, match="2 image\\(s\\) have no caption"):
        client.predict(str(images), "48gb+", "tiny-random", "acme", STEPS, api_name="/train_start")

    # The full-size model (header only) with the bf16 base of the 48gb+ preset on a 16 GiB card.
    for i, path in enumerate(sorted(images.glob("*.png"))):
        path.with_suffix(".txt").write_text(f"picture {i}")
    big = full_size_header_only(tmp_path / "krea2-full" / "transformer")
    plan = json.loads(client.predict(str(images), "48gb+", str(big), api_name="/train_plan"))
    assert not plan["fits"] and plan["card_gib"] == 16 and plan["total_gib"] > 16
    assert "DOES NOT FIT" in plan["plan"] and "try the 16gb preset" in plan["plan"], plan["plan"]
    assert "model.quantize=nf4 would fit" in plan["plan"], plan["plan"]  # the modes tried beside the preset's own
    assert "LoRA r32 on a bfloat16 base" in plan["plan"] and "memory plan per process on a 16 GiB card" in plan["plan"]
    with pytest.raises(AppError, match="Not started. DOES NOT FIT"):
        client.predict(str(images), "48gb+", str(big), "acme", STEPS, api_name="/train_start")
    fits = json.loads(client.predict(str(images), "16gb", str(big), api_name="/train_plan"))
    assert fits["fits"] and fits["total_gib"] < 16

    # Nothing was written: no run folder, the image folders as they were.
    assert not app_server.runs.exists() or not any(app_server.runs.iterdir())
    assert listing(tmp_path / "images") == sorted([f"picture_{i}.{e}" for i in range(2) for e in ("png", "txt")])
    assert listing(texts) == ["list.csv", "notes.txt"] and listing(empty) == []


def test_a_plan_is_reused_until_the_config_or_the_base_models_files_change(tmp_path, monkeypatch):
    """"Start" after "Plan" reuses the plan (a full-size one takes seconds per quantization and preset
    tried); the same config over a rewritten base model file, or another preset, is planned again."""
    import os

    import finetune.dryrun
    from krea2_diffusers.models.tiny import tiny_transformer_config
    from train_tab.plan import fit
    from train_tab.presets import run_config

    planned = []
    real = finetune.dryrun.plan_text
    monkeypatch.setattr(finetune.dryrun, "plan_text", lambda config, **kw: planned.append(1) or real(config, **kw))
    base = full_size_header_only(tmp_path / "small" / "transformer", tiny_transformer_config())

    def config(preset: str) -> dict:
        return run_config(tmp_path / "RUN", tmp_path / "RUN" / "dataset.jsonl", preset, str(base), "", 10, 5, "a photo")

    first = fit(config("48gb+"), "48gb+", 16, suggest=config)
    assert first.fits and len(planned) == 1
    assert fit(config("48gb+"), "48gb+", 16, suggest=config) is first and len(planned) == 1
    weights = base / "diffusion_pytorch_model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    again = fit(config("48gb+"), "48gb+", 16, suggest=config)
    assert again is not first and again.text == first.text and len(planned) == 2
    fit(config("24gb"), "24gb", 16, suggest=config)
    assert len(planned) == 3


def test_browser_captions_plans_trains_stops_resumes_and_uses_the_lora(app_server, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run .ci/install_browser.sh")
    images = make_images(inputs(app_server, tmp_path) / "dataset")
    before = listing(images)
    shots = tmp_path / "screenshots"
    shots.mkdir()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.goto(app_server.url, wait_until="domcontentloaded")

            def shot(name: str) -> None:
                page.screenshot(path=str(shots / f"{len(list(shots.iterdir())):02d}-{name}.png"), full_page=True)

            def field(elem_id: str):
                return page.locator(f"#{elem_id}").locator("textarea, input").first

            def message(text: str):
                expect(page.get_by_text(text).first).to_be_visible(timeout=WAIT_MS)

            page.get_by_role("tab", name="Train").click()
            field("train_folder").fill(str(images))
            page.locator("#train_load").click()
            expect(page.locator("#train_table_note")).to_contain_text("8 images, 8 without a caption", timeout=WAIT_MS)
            expect(page.locator("#train_grid img")).to_have_count(8, timeout=WAIT_MS)  # the thumbnails
            shot("images")
            page.locator("#train_caption").click()
            expect(page.locator("#train_table_note")).to_contain_text("all captioned", timeout=WAIT_MS)
            # A thumbnail clicked: its caption in the box beside the grid, edited there.
            page.locator("#train_grid img").first.click()
            editor = page.locator("#train_caption_edit textarea")
            expect(editor).to_be_editable(timeout=WAIT_MS)
            expect(editor).not_to_have_value("", timeout=WAIT_MS)
            editor.fill("acme, edited caption")
            page.locator("#train_table_note").click()  # leave the box: the grid shows the new caption
            expect(page.locator("#train_grid").get_by_text("acme, edited caption").first).to_be_attached(timeout=WAIT_MS)
            shot("captions")

            page.get_by_test_id("48gb+-radio-label").click()
            page.locator("#train_plan_button").click()
            expect(page.locator("#train_plan")).to_contain_text("fits: 1.", timeout=WAIT_MS)
            shot("plan")

            field("train_trigger").fill("acme")
            field("train_steps").fill(str(STEPS))
            field("train_sample_every").fill(str(SAMPLE_EVERY))
            page.locator("#train_start").click()
            message("Started ")
            run_id = re.search(r"Started (\S+)\.", page.locator("#train_message").inner_text()).group(1)
            page.locator("#train_start").click()  # a second Start while the first run goes: queued
            message("(position 1): it starts when the run before it ends")
            queued = re.search(r"Queued (\S+) ", page.locator("#train_message").inner_text()).group(1)
            expect(page.locator("#train_progress")).to_contain_text(f"{queued}: queued, position 1 of 1", timeout=WAIT_MS)
            expect(page.locator("#train_queue")).to_contain_text(f"Queue: 1. {queued}", timeout=WAIT_MS)
            shot("queued")
            page.locator("#train_stop").click()  # the queued run selected: it leaves the queue, never started
            message(f"Removed {queued} from the queue")
            expect(page.locator("#train_queue")).to_contain_text("Queue: empty", timeout=WAIT_MS)
            page.locator("#train_runs input").click()
            page.get_by_role("option", name=re.compile(rf"{run_id} \(running\)")).click()
            page.locator("#train_stop").click()  # the first run: stops after its current step, checkpointed
            # stopped during its set-up (before step 1) or after a step, as the signal finds it
            expect(page.locator("#train_progress")).to_contain_text(re.compile(rf"{run_id}\*?\*?: stopped, step \d+ / 20"),
                                                                     timeout=WAIT_MS)
            expect(page.locator("#train_loss").locator("canvas, svg").first).to_be_visible(timeout=WAIT_MS)
            shot("stopped")

            page.locator("#train_resume").click()
            message(f"Resumed {run_id}")
            expect(page.locator("#train_samples img").first).to_be_visible(timeout=WAIT_MS)
            shot("sample")
            expect(page.locator("#train_progress")).to_contain_text("done, step 20 / 20", timeout=WAIT_MS)
            expect(page.locator("#train_use")).to_be_enabled(timeout=WAIT_MS)
            expect(page.locator("#train_samples img")).to_have_count(STEPS // SAMPLE_EVERY, timeout=WAIT_MS)  # the timeline
            expect(page.locator("#train_samples")).to_contain_text(f"step {STEPS}")
            expect(page.locator("#train_speed")).to_contain_text(" s/step")
            shot("done")
            # The checkpoint report: its curves, the recommended checkpoint (kept: one a sample set), exported.
            expect(page.locator("#train_recommended")).to_contain_text("Recommended checkpoint: step", timeout=WAIT_MS)
            expect(page.locator("#train_report").locator("canvas, svg").first).to_be_visible(timeout=WAIT_MS)
            recommended = int(re.search(r"step (\d+)", page.locator("#train_recommended").inner_text()).group(1))
            page.locator("#train_export").click()
            message(f"Exported 3 file(s) into {app_server.runs / run_id / 'exports' / f'step-{recommended}'}")
            expect(page.locator("#train_exported")).to_contain_text("lora_diffusers", timeout=WAIT_MS)
            shot("report")

            page.locator("#train_use").click()
            expect(page.locator("#lora_in_use")).to_contain_text("lora_diffusers.safetensors", timeout=WAIT_MS)
            page.locator("#prompt textarea").fill("acme, a picture")
            page.locator("#generate").click()
            result = page.locator("#result img")
            result.wait_for(state="visible", timeout=WAIT_MS)
            shot("generate-with-lora")
            response = page.request.get(result.get_attribute("src"))
            (tmp_path / "shown.png").write_bytes(response.body())
        finally:
            browser.close()

    from krea2_diffusers.metadata import read_settings

    run = app_server.runs / run_id
    in_use = [{"file": str(run / "lora_diffusers.safetensors"), "strength": 1.0}]
    assert read_settings(tmp_path / "shown.png")["loras"] == in_use
    # The API returns the same settings as the PNG carries (a {"path": ...} entry was taken by gradio for a
    # file: its server copied the LoRA into its cache and the client downloaded it, without the strength).
    from gradio_client import Client

    api = Client(app_server.url, verbose=False, download_files=str(tmp_path / "downloads"))
    _, png, settings, _, _ = api.predict("acme, a picture", size=APP_SIZE, seed=5, randomize_seed=False, steps=2,
                                         api_name="/generate")
    assert settings["loras"] == in_use and read_settings(png) == settings
    # One run, continued: metrics.jsonl holds steps 1..20 once each (the resume continues from the stop).
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert (run / "checkpoints").is_dir() and "--resume" in (run / "train.log").read_text()
    assert sorted(p.name for p in (run / "samples").iterdir()) == [f"step-{s:06d}" for s in range(SAMPLE_EVERY, STEPS + 1, SAMPLE_EVERY)]
    assert sorted(p.name for p in run.glob("lora_*.safetensors")) == ["lora_comfyui.safetensors", "lora_diffusers.safetensors",
                                                                       "lora_kohya.safetensors"]
    # The YAML in the run folder is the run: krea2 train reads it as it is.
    from finetune.config import load_config

    config = load_config(run / "train.yaml")
    assert config.output_dir == str(run) and config.training.max_steps == STEPS and config.export.trigger_words == ["acme"]
    manifest = [json.loads(line) for line in (run / "dataset.jsonl").read_text().splitlines()]
    assert len(manifest) == 8 and all(r["caption"].startswith("acme, ") and len(r["caption"]) > 6 for r in manifest)
    assert manifest[0]["caption"] == "acme, edited caption"  # the caption edited under the grid
    assert listing(images) == before  # captions live in the run's manifest, not next to the images
    assert sorted(p.name for p in (run / "exports" / f"step-{recommended}").iterdir()) == EXPORTS
    assert recommended % SAMPLE_EVERY == 0  # a checkpoint at every sample set: the report's steps can be exported
    queued_run = app_server.runs / queued  # stopped while queued: it never ran
    assert not (queued_run / "metrics.jsonl").exists() and json.loads((queued_run / "exit.json").read_text())["returncode"] == 130
    assert len(list(shots.iterdir())) == 9


def test_runs_started_back_to_back_queue_and_take_sample_now_save_now_and_step_exports(client, app_server, tmp_path,
                                                                                         tiny_pipe):
    """Two runs started at once through the API: the second is queued (position 1) and starts once the
    first is done (queued -> running -> done). The first is asked for samples and a checkpoint as it
    starts ("Sample now", "Save now"): it makes both after step 1, beside its scheduled ones, and trains
    on to done. Its status carries the report; step 1, exported into the run folder, loads with
    ``load_lora_weights``."""
    from gradio_client.exceptions import AppError

    images = make_images(inputs(app_server, tmp_path) / "dataset", 2)
    for i, path in enumerate(sorted(images.glob("*.png"))):
        path.with_suffix(".txt").write_text(f"picture {i}")
    first = client.predict(str(images), "48gb+", "tiny-random", "first", 8, 4, api_name="/train_start")
    assert "sample set" in client.predict(first, api_name="/train_sample_now")
    assert "checkpoint" in client.predict(first, api_name="/train_save_now")
    second = client.predict(str(images), "48gb+", "tiny-random", "second", 2, 2, api_name="/train_start")
    status = client.predict(second, api_name="/train_status")
    assert (status["state"], status["queue_position"], status["report"], status["step"]) == ("queued", 1, None, 0)
    assert client.predict(first, api_name="/train_status")["queue_position"] is None
    with pytest.raises(AppError, match=f"Run {second} is queued: samples and checkpoints on demand are for a running run"):
        client.predict(second, api_name="/train_save_now")

    states = {second: [], first: []}  # polled in this order: the second running after the first is
    deadline = time.monotonic() + WAIT_MS / 1000
    while not states[second] or states[second][-1] not in ("done", "stopped", "failed"):
        assert time.monotonic() < deadline, states
        for run_id in states:
            state = client.predict(run_id, api_name="/train_status")["state"]
            if not states[run_id] or states[run_id][-1] != state:
                states[run_id].append(state)
        assert not (states[second][-1] == "running" and states[first][-1] == "running"), states
        time.sleep(0.5)
    run = app_server.runs / first
    assert states == {first: ["running", "done"], second: ["queued", "running", "done"]}, (run / "train.log").read_text()

    # "Sample now" and "Save now" after step 1, the run trained on: the sample sets and checkpoints of
    # steps 1, 4 and 8 (the sample sets' checkpoints, and the one asked for).
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 9))
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step-000001", "step-000004", "step-000008"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1", "step-4", "step-8"]
    assert "step 1: sample and save asked for" in (run / "train.log").read_text()
    report = client.predict(first, api_name="/train_status")["report"]
    assert report == json.loads((run / "report.json").read_text())
    assert [row["step"] for row in report["checkpoints"]] == [1, 4, 8] and report["recommended"]["step"] in (1, 4, 8)

    files = client.predict(first, 1, api_name="/train_export_step")
    assert [Path(f) for f in files] == [run / "exports" / "step-1" / name for name in EXPORTS]
    assert client.predict(first, "1", api_name="/train_export_step") == files  # exported once
    with pytest.raises(AppError, match=f"Run {first} keeps no checkpoint of step 2 \\(kept: 1, 4, 8\\)"):
        client.predict(first, 2, api_name="/train_export_step")
    with pytest.raises(AppError, match="step must be the whole number of a kept checkpoint .*got '1.5'"):
        client.predict(first, "1.5", api_name="/train_export_step")

    def image(lora: str | None):
        if lora is not None:
            tiny_pipe.load_lora_weights(lora, adapter_name="step-1")
        try:
            return tiny_pipe("first, picture 0", height=64, width=64, num_inference_steps=2, guidance_scale=0.0,
                             generator=torch.Generator().manual_seed(0), output_type="np").images[0]
        finally:
            if lora is not None:
                tiny_pipe.delete_adapters("step-1")

    base, loaded = image(None), [image(f) for f in files]
    for lora in loaded:  # every format carries the same adapter, and it changes the image
        np.testing.assert_allclose(lora, loaded[1], atol=1e-5)
        assert np.abs(lora - base).max() > 1e-4


def test_the_caption_endpoint_fills_missing_captions_inside_the_data_roots_only(client, app_server, tmp_path):
    """``/train_caption``: rows in, rows out (a script's way to caption, the button's function); a row
    outside the data roots is refused without naming its file."""
    from gradio_client.exceptions import AppError

    paths = [str(p) for p in sorted(make_images(inputs(app_server, tmp_path), 3).glob("*.png"))]
    rows = [[paths[0], ""], [paths[1], "my own caption"], [paths[2], ""]]
    answer = client.predict({"headers": ["image", "caption"], "data": rows}, api_name="/train_caption")
    assert [row[0] for row in answer["data"]] == paths and answer["data"][1][1] == "my own caption"
    assert all(row[1].strip() for row in answer["data"])
    with pytest.raises(AppError, match="The image of row 2 is outside the allowed data roots") as refused:
        client.predict({"headers": ["image", "caption"], "data": [rows[0], ["/etc/hostname", ""]]}, api_name="/train_caption")
    assert "hostname" not in str(refused.value)
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert [p["parameter_name"] for p in endpoints["/train_caption"]["parameters"]] == ["rows"]
    start = {p["parameter_name"]: p for p in endpoints["/train_start"]["parameters"]}
    assert start["captions"]["parameter_default"] == "required"
    assert start["masks"]["parameter_default"] is False and start["regularization_folder"]["parameter_default"] in ("", None)


def test_uploaded_images_are_copied_into_the_run_folder(tmp_path):
    """Uploads live in Gradio's temporary folder: the run keeps its own copies, and its YAML loads as it is."""
    from finetune.config import load_config
    from train_tab.actions import TrainActions
    from train_tab.runs import CONFIG_NAME, MANIFEST_NAME, Runs

    uploads = make_images(tmp_path / "gradio-tmp", 2)
    actions = TrainActions(Runs(tmp_path / "runs"), "tiny-random")
    rows = actions.images("", [[str(p), f"caption {i}"] for i, p in enumerate(sorted(uploads.glob("*.png")))])
    run_id = actions.runs.create(lambda run, manifest: actions.config_for(run, manifest, "24gb", "tiny-random", "acme", 6),
                                 rows, "acme", copy=True)
    run = tmp_path / "runs" / run_id
    manifest = [json.loads(line) for line in (run / MANIFEST_NAME).read_text().splitlines()]
    assert [Path(r["path"]).parent for r in manifest] == [run / "images"] * 2
    assert [r["caption"] for r in manifest] == ["acme, caption 0", "acme, caption 1"]
    assert all(Path(r["path"]).read_bytes() == p.read_bytes() for r, p in zip(manifest, sorted(uploads.glob("*.png"))))
    config = load_config(run / CONFIG_NAME)
    assert (config.model.quantize, config.lora.rank, config.data.resolution, config.training.max_steps) == ("fp8", 32, 64, 6)
    assert config.validation.every_n_steps == 1 and config.checkpointing.every_n_steps == 1
    assert actions.runs.list() == [(run_id, "failed")]  # never started: no checkpoint, no export
