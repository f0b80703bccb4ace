"""The Train tab's Gradio components and their events; the API endpoints ``/train_plan``,
``/train_start``, ``/train_status``, ``/train_stop`` (and ``/train_resume``) are the same
functions the buttons call. The logic is :class:`train_tab.actions.TrainActions`."""

from __future__ import annotations

import json

import gradio as gr

from .actions import TrainActions
from .images import COLUMNS, TrainInputError, table_rows
from .presets import TRAIN_PRESETS

REFRESH_SECONDS = 1.0


def _refused(err: TrainInputError):
    return gr.Error(str(err), title="Training")


def build_train_tab(actions: TrainActions, use_lora):
    """Inside a ``gr.Blocks``/``gr.Tab``: the tab's components and events. ``use_lora(path) -> str``
    loads an exported LoRA into the Generate tab and says so. Returns the "use in Generate" button's
    click event, for the caller to switch tabs after it."""
    presets = list(TRAIN_PRESETS)

    def plan(images_folder, preset, base_model, table=None):
        """The memory plan (``krea2 train --dry-run``'s) as JSON: fits, total_gib, card_gib, plan text."""
        try:
            return actions.plan(images_folder, preset, base_model, table_rows(table) or None).to_json()
        except TrainInputError as err:
            raise _refused(err) from None

    def start(images_folder, preset, base_model, trigger_word="", steps=None, sample_every=None, table=None, uploads=None):
        """Start ``krea2 train`` on these images; returns the run id."""
        try:
            return actions.start(images_folder, preset, base_model, trigger_word, steps, sample_every,
                                 table_rows(table) or None, copy_images=bool(uploads) and not (images_folder or "").strip())
        except TrainInputError as err:
            raise _refused(err) from None

    def status(run_id):
        """``{"state", "step", "total", "loss", "samples", "exports"}`` of a run."""
        try:
            return actions.runs.status(run_id)
        except TrainInputError as err:
            raise _refused(err) from None

    def stop(run_id):
        """SIGTERM to the run: it saves a checkpoint, then exits."""
        try:
            return actions.stop(run_id)
        except TrainInputError as err:
            raise _refused(err) from None

    def resume(run_id):
        """Continue a stopped run from its last checkpoint; returns the run id."""
        try:
            actions.resume(run_id)
        except TrainInputError as err:
            raise _refused(err) from None
        return run_id

    def load_images(images_folder, uploads):
        try:
            if uploads:
                rows = actions.images("", [[str(path), ""] for path in uploads])
            else:
                rows = actions.images(images_folder)
        except TrainInputError as err:
            raise _refused(err) from None
        missing = sum(1 for _, caption in rows if not caption)
        return rows, f"{len(rows)} images, {missing} without a caption."

    def caption(table, base_model, progress=gr.Progress()):
        try:
            rows = actions.caption_missing(table_rows(table), base_model,
                                           lambda done, total: progress((done, total), desc="Captioning", unit="images"))
        except TrainInputError as err:
            raise _refused(err) from None
        return rows, f"{len(rows)} images, all captioned."

    def runs_choices(selected=None):
        choices = [(f"{run_id} ({state})", run_id) for run_id, state in actions.runs.list()]
        return gr.update(choices=choices, value=selected if selected else (choices[0][1] if choices else None))

    def refresh(run_id):
        if not run_id:
            return "No run selected.", None, [], [], gr.update()
        try:
            state = actions.runs.status(run_id)
        except TrainInputError:
            return f"No run {run_id}.", None, [], [], gr.update()
        import pandas as pd

        rows = actions.runs.metrics(run_id)
        curve = pd.DataFrame({"step": [r["step"] for r in rows], "loss": [r["loss"] for r in rows]})
        return actions.progress(run_id), curve, state["samples"], state["exports"], gr.update(interactive=bool(state["exports"]))

    def use(run_id):
        exports = actions.runs.status(run_id)["exports"] if run_id else []
        if not exports:
            raise gr.Error("This run has exported no LoRA yet.", title="Training")
        preferred = [p for p in exports if p.endswith("lora_diffusers.safetensors")] or exports
        return use_lora(preferred[0])

    gr.Markdown("Train a LoRA on your images: `krea2 train` runs in the background on a YAML written "
                "into the run folder (`krea2 train RUN/train.yaml --resume` continues it from a terminal).")
    with gr.Row():
        with gr.Column():
            folder = gr.Textbox(label="Images folder", elem_id="train_folder", placeholder="/path/to/images")
            uploads = gr.File(label="... or upload images", file_count="multiple", file_types=["image"], type="filepath")
            load = gr.Button("Load images", elem_id="train_load")
            table = gr.Dataframe(headers=COLUMNS, datatype=["str", "str"], column_count=(2, "fixed"), interactive=True,
                                 label="Images and captions (editable)", elem_id="train_images", wrap=True)
            caption_button = gr.Button("Caption missing ones", elem_id="train_caption")
            table_note = gr.Markdown(elem_id="train_table_note")
        with gr.Column():
            trigger = gr.Textbox(label="Trigger word", elem_id="train_trigger", placeholder="acme_style")
            preset = gr.Radio(presets, value=presets[-1], label="Preset (your card)", elem_id="train_preset",
                              info="16gb: NF4 base, rank 16, block swap. 24gb: fp8 base, rank 32. 48gb+: bf16 base, rank 32.")
            base = gr.Textbox(value=actions.base_model, label="Base model (RAW)", elem_id="train_base")
            with gr.Row():
                steps = gr.Number(value=0, precision=0, minimum=0, label="Steps (0: the preset's)", elem_id="train_steps")
                sample_every = gr.Number(value=0, precision=0, minimum=0, label="Sample every N steps (0: steps / 4)",
                                         elem_id="train_sample_every")
            plan_button = gr.Button("Check memory plan", elem_id="train_plan_button")
            plan_box = gr.Code(label="Memory plan (JSON, as /train_plan answers)", language="json", elem_id="train_plan",
                               interactive=False, max_lines=3)
            plan_view = gr.Textbox(label="Memory plan", lines=12, interactive=False, elem_id="train_plan_text")
            with gr.Row():
                start_button = gr.Button("Start", variant="primary", elem_id="train_start")
                stop_button = gr.Button("Stop", elem_id="train_stop")
                resume_button = gr.Button("Resume", elem_id="train_resume")
            message = gr.Markdown(elem_id="train_message")
    with gr.Row():
        run = gr.Dropdown(label="Runs (from the runs folder)", choices=[], elem_id="train_runs", allow_custom_value=True)
        refresh_runs = gr.Button("Refresh runs", elem_id="train_refresh")
    progress_text = gr.Markdown(elem_id="train_progress")
    with gr.Row():
        plot = gr.LinePlot(x="step", y="loss", label="Loss (metrics.jsonl)", elem_id="train_loss")
        gallery = gr.Gallery(label="Latest samples", elem_id="train_samples", height=240)
    exports = gr.File(label="LoRA files", file_count="multiple", elem_id="train_exports")
    use_button = gr.Button("Use in Generate", elem_id="train_use", interactive=False)
    run_id = gr.Textbox(visible=False)
    status_json = gr.JSON(visible=False)
    run_text = gr.Textbox(visible=False)

    load.click(load_images, [folder, uploads], [table, table_note], api_visibility="private")
    caption_button.click(caption, [table, base], [table, table_note], api_visibility="private")
    plan_button.click(plan, [folder, preset, base, table], plan_box, api_name="train_plan").success(
        lambda answer: json.loads(answer)["plan"], plan_box, plan_view, api_visibility="private")
    start_button.click(start, [folder, preset, base, trigger, steps, sample_every, table, uploads], run_id,
                       api_name="train_start").success(
        lambda r: (runs_choices(r), f"Started {r}."), run_id, [run, message], api_visibility="private")
    stop_button.click(stop, run, message, api_name="train_stop")
    resume_button.click(resume, run, run_text, api_name="train_resume").success(
        lambda r: (runs_choices(r), f"Resumed {r}."), run_text, [run, message], api_visibility="private")
    gr.Button(visible=False).click(status, run_id, status_json, api_name="train_status")
    refresh_runs.click(lambda r: runs_choices(r), run, run, api_visibility="private")
    outputs = [progress_text, plot, gallery, exports, use_button]
    run.change(refresh, run, outputs, api_visibility="private")
    gr.Timer(REFRESH_SECONDS).tick(refresh, run, outputs, api_visibility="private", show_progress="hidden")
    return use_button.click(use, run, message, api_visibility="private")

