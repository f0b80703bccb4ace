"""The Train tab's Gradio components and their events; the API endpoints ``/train_caption``,
``/train_plan``, ``/train_start`` (queued while a run trains), ``/train_status``, ``/train_stop``,
``/train_resume``, ``/train_sample_now``, ``/train_save_now`` and ``/train_export_step`` are the
same functions the buttons call. The logic is :class:`train_tab.actions.TrainActions`. The run view
shows the run's state (its place in the queue), loss, speed, samples, the checkpoint report's
curves with the recommended checkpoint (:mod:`train_tab.report_view`) and its kept checkpoints, to
export one.

The images show as a grid of thumbnails (a ``gr.Gallery``: Gradio 6 has no editable caption per
gallery item, so a click on a thumbnail puts its caption in the box beside the grid, where it is
edited); the table of paths and captions under it is what the endpoints take and give (rows of
``[image path, caption]``, as ``{"headers": ["image", "caption"], "data": rows}``)."""

from __future__ import annotations

import json
from pathlib import Path

import gradio as gr

from .actions import PRIOR_SHARE, TrainActions
from .checkpoints import kept_steps
from .errors import TrainInputError
from .images import COLUMNS, table_rows
from .presets import TRAIN_PRESETS
from .report_view import curves, recommendation

REFRESH_SECONDS = 1.0


def _refused(err: TrainInputError):
    return gr.Error(str(err), title="Training")


def build_train_tab(actions: TrainActions, use_lora):
    """Inside a ``gr.Blocks``/``gr.Tab``: the tab's components and events. ``use_lora(path) -> str``
    loads an exported LoRA into the Generate tab and says so. Returns the "use in Generate" button's
    click event, for the caller to switch tabs after it."""
    presets = list(TRAIN_PRESETS)

    def plan(images_folder, preset, base_model, table=None, optimizer="adamw", regularization_folder="",
             prior_share=PRIOR_SHARE):
        """The memory plan (``krea2 train --dry-run``'s) as JSON: fits, total_gib, card_gib, plan text (ending
        with each dataset's share of the samples drawn: ``prior_share`` for the regularisation folder's images)."""
        try:
            return actions.plan(images_folder, preset, base_model, table_rows(table) or None, optimizer or "adamw",
                                regularization_folder or "", prior_share).to_json()
        except TrainInputError as err:
            raise _refused(err) from None

    def start(images_folder, preset, base_model, trigger_word="", steps=None, sample_every=None, table=None, uploads=None,
              captions="required", masks=False, regularization_folder="", references_folder="", optimizer="adamw",
              prior_share=PRIOR_SHARE):
        """Start ``krea2 train`` on these images; returns the run id. ``captions``: "required" (every image
        needs one: see /train_caption) or "trigger" (an image without one is trained with the trigger word).
        ``masks``: train each image where its NAME.mask.png beside it is white. ``regularization_folder``:
        captioned images of the subject's class, trained beside it to keep the class prior.
        ``references_folder``: pairs mode (edit / reference LoRA): the images are the targets, their
        captions the instructions, their references NAME.png or NAME_1.png, NAME_2.png ... in this folder.
        ``optimizer``: "adamw" or "prodigy" (sets its own step size). ``prior_share``: the regularisation images'
        share of the samples drawn, between 0 and 1 (0.5: as many as the subject's, whatever the folders' sizes)."""
        uploaded = bool(uploads) and not (images_folder or "").strip()
        rows = table_rows(table) or ([[str(path), ""] for path in uploads] if uploaded else None)
        try:
            return actions.start(images_folder, preset, base_model, trigger_word, steps, sample_every, rows,
                                 copy_images=uploaded, captions=captions, masks=bool(masks),
                                 regularization_folder=regularization_folder or "", references_folder=references_folder or "",
                                 optimizer=optimizer or "adamw", prior_share=prior_share)
        except TrainInputError as err:
            raise _refused(err) from None

    def caption(rows, progress=gr.Progress()):
        """Rows ``[image path, caption]`` in; the same rows out, each empty caption written by the app's captioner."""
        try:
            return actions.caption_missing(table_rows(rows), None,
                                           lambda done, total: progress((done, total), desc="Captioning", unit="images"))
        except TrainInputError as err:
            raise _refused(err) from None

    def status(run_id):
        """``{"state": "queued|running|stopped|done|failed", "step", "total", "loss", "samples", "exports",
        "queue_position", "report"}`` of a run: ``queue_position`` 1 for the next run to start (None when
        not queued), ``report`` its report.json (None before its first sample set)."""
        try:
            return actions.runs.status(run_id)
        except TrainInputError as err:
            raise _refused(err) from None

    def stop(run_id):
        """SIGTERM to the run: it saves a checkpoint, then exits. A queued run leaves the queue."""
        try:
            return actions.stop(run_id)
        except TrainInputError as err:
            raise _refused(err) from None

    def sample_now(run_id):
        """The running run samples its validation prompts after its current step, and goes on."""
        try:
            return actions.sample_now(run_id)
        except TrainInputError as err:
            raise _refused(err) from None

    def save_now(run_id):
        """The running run saves a checkpoint after its current step, and goes on."""
        try:
            return actions.save_now(run_id)
        except TrainInputError as err:
            raise _refused(err) from None

    def export_step(run_id, step):
        """Export the run's kept checkpoint of ``step`` into RUN/exports/step-N/ (the files krea2 export
        writes, for load_lora_weights, ComfyUI, kohya); returns the files' paths."""
        try:
            return actions.export_step(run_id, step)
        except TrainInputError as err:
            raise _refused(err) from None

    def resume(run_id):
        """Continue a stopped run from its last checkpoint; returns the run id."""
        try:
            actions.resume(run_id)
        except TrainInputError as err:
            raise _refused(err) from None
        return run_id

    def note(rows) -> str:
        missing = sum(1 for _, caption in rows if not caption.strip())
        return f"{len(rows)} images, all captioned." if not missing else f"{len(rows)} images, {missing} without a caption."

    def grid_of(table):
        """The thumbnails with their captions, and the note under them."""
        rows = table_rows(table)
        try:
            return actions.thumbnails(rows), note(rows)
        except TrainInputError as err:
            raise _refused(err) from None

    def load_images(images_folder, uploads):
        try:
            if uploads:
                rows = actions.images("", [[str(path), ""] for path in uploads])
            else:
                rows = actions.images(images_folder)
        except TrainInputError as err:
            raise _refused(err) from None
        return rows, *grid_of(rows), None, gr.update(value="", interactive=False)  # nothing selected in the new grid

    def pick(table, evt: gr.SelectData):
        rows = table_rows(table)
        index = evt.index if isinstance(evt.index, int) and 0 <= evt.index < len(rows) else None
        return index, gr.update(value=rows[index][1] if index is not None else "", interactive=index is not None)

    def edit(index, text, table):
        rows = table_rows(table)
        if index is not None and 0 <= index < len(rows):
            rows[index][1] = text
        return rows

    def commit(index, text, table):
        """The edit applied again (the box may be left before its last ``input`` event came back), and the grid."""
        rows = edit(index, text, table)
        return rows, *grid_of(rows)

    def runs_choices(selected=None):
        choices = [(f"{run_id} ({state})", run_id) for run_id, state in actions.runs.list()]
        return gr.update(choices=choices, value=selected if selected else (choices[0][1] if choices else None))

    def queue_line() -> str:
        queue = actions.runs.waiting()
        return "Queue: " + (", ".join(f"{i}. {r}" for i, r in enumerate(queue, 1)) if queue else "empty")

    def refresh(run_id, chosen=None):
        nothing = (None, "", gr.update(choices=[], value=None))
        if not run_id:
            return "No run selected.", None, "", [], [], gr.update(), *nothing, queue_line()
        try:
            state = actions.runs.status(run_id)
        except TrainInputError:
            return f"No run {run_id}.", None, "", [], [], gr.update(), *nothing, queue_line()
        import pandas as pd

        rows = actions.runs.metrics(run_id)
        curve = pd.DataFrame({"step": [r["step"] for r in rows], "loss": [r["loss"] for r in rows]})
        kept = kept_steps(actions.runs.folder(run_id))
        suggested = ((state["report"] or {}).get("recommended") or {}).get("step")
        # the step picked, else the recommended one, else the newest: among the kept ones
        default = next((step for step in (chosen, suggested) if step in kept), kept[-1] if kept else None)
        return (actions.progress(run_id), curve, actions.speed(run_id), actions.timeline(run_id), state["exports"],
                gr.update(interactive=bool(state["exports"])),
                pd.DataFrame(curves(state["report"])) if state["report"] else None,
                recommendation(state["report"], kept),
                gr.update(choices=[(f"step {step}", step) for step in kept], value=default), queue_line())

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
        with gr.Column():
            trigger = gr.Textbox(label="Trigger word", elem_id="train_trigger", placeholder="acme_style")
            captions = gr.Radio([("Required: every image has a caption", "required"),
                                 ("None needed: an image without one is trained on the trigger word", "trigger")],
                                value="required", label="Captions", elem_id="train_captions")
            preset = gr.Radio(presets, value=presets[-1], label="Preset (your card)", elem_id="train_preset",
                              info="16gb: NF4 base, rank 16, block swap. 24gb: fp8 base, rank 32. 48gb+: bf16 base, rank 32.")
            optimizer = gr.Radio([("AdamW (the preset's learning rate)", "adamw"),
                                  ("Prodigy (sets its own step size)", "prodigy")],
                                 value="adamw", label="Optimizer", elem_id="train_optimizer")
            base = gr.Textbox(value=actions.base_model, label="Base model (RAW)", elem_id="train_base")
            with gr.Row():
                masks = gr.Checkbox(value=False, label="Masks: NAME.mask.png beside each image (white trains)",
                                    elem_id="train_masks")
                regularization = gr.Textbox(value="", label="Regularisation images folder (optional, captioned)",
                                            elem_id="train_regularization", placeholder="/path/to/class-images")
                prior_share = gr.Slider(0.05, 0.95, value=PRIOR_SHARE, step=0.05, label="Regularisation share of the samples",
                                        elem_id="train_prior_share",
                                        info="0.5: one class image per subject image, whatever the folders' sizes")
                references = gr.Textbox(value="", label="Pairs: references folder (edit / reference LoRA; NAME.png or NAME_1.png ...)",
                                        elem_id="train_references", placeholder="/path/to/references")
            with gr.Row():
                steps = gr.Number(value=0, precision=0, minimum=0, label="Steps (0: the preset's)", elem_id="train_steps")
                sample_every = gr.Number(value=0, precision=0, minimum=0, label="Sample every N steps (0: steps / 4)",
                                         elem_id="train_sample_every")
    with gr.Row():
        grid = gr.Gallery(label="Images (click one to edit its caption)", elem_id="train_grid", columns=6, height=360,
                          allow_preview=False, scale=3)
        with gr.Column(scale=1):
            caption_edit = gr.Textbox(label="Caption of the selected image", lines=6, interactive=False,
                                      elem_id="train_caption_edit", placeholder="Click an image")
            caption_button = gr.Button("Caption missing ones", elem_id="train_caption")
            table_note = gr.Markdown(elem_id="train_table_note")
    with gr.Accordion("Paths and captions (the table /train_caption and /train_start take)", open=False):
        table = gr.Dataframe(headers=COLUMNS, datatype=["str", "str"], column_count=(2, "fixed"), interactive=True,
                             label="Images and captions (editable)", elem_id="train_images", wrap=True)
    selected = gr.State(None)
    with gr.Row():
        with gr.Column():
            plan_button = gr.Button("Check memory plan", elem_id="train_plan_button")
            plan_box = gr.Code(label="Memory plan (JSON, as /train_plan answers)", language="json", elem_id="train_plan",
                               interactive=False, max_lines=3)
        with gr.Column():
            plan_view = gr.Textbox(label="Memory plan", lines=12, interactive=False, elem_id="train_plan_text")
    with gr.Row():
        start_button = gr.Button("Start (queued while a run trains)", variant="primary", elem_id="train_start")
        stop_button = gr.Button("Stop", elem_id="train_stop")
        resume_button = gr.Button("Resume", elem_id="train_resume")
        sample_button = gr.Button("Sample now", elem_id="train_sample_now")
        save_button = gr.Button("Save now", elem_id="train_save_now")
    message = gr.Markdown(elem_id="train_message")
    with gr.Row():
        run = gr.Dropdown(label="Runs (from the runs folder)", choices=[], elem_id="train_runs", allow_custom_value=True)
        refresh_runs = gr.Button("Refresh runs", elem_id="train_refresh")
    queue_text = gr.Markdown(elem_id="train_queue")
    progress_text = gr.Markdown(elem_id="train_progress")
    with gr.Row():
        plot = gr.LinePlot(x="step", y="loss", label="Loss (metrics.jsonl)", elem_id="train_loss", scale=4)
        speed = gr.Markdown(elem_id="train_speed")
    timeline = gr.Gallery(label="Samples by step (the validation prompt)", elem_id="train_samples", columns=8, height=240)
    with gr.Row():
        report_plot = gr.LinePlot(x="step", y="value", color="measure", elem_id="train_report", scale=3,
                                  label="Checkpoint report: concept, leak, copying, diversity per checkpoint (report.json)")
        with gr.Column(scale=2):
            recommended = gr.Markdown(elem_id="train_recommended")
            export_choice = gr.Dropdown(label="Kept checkpoints", choices=[], elem_id="train_export_choice",
                                        allow_custom_value=True)
            export_button = gr.Button("Export this checkpoint", elem_id="train_export")
            exported = gr.File(label="Exported checkpoint (RUN/exports/step-N)", file_count="multiple",
                               elem_id="train_exported")
    exports = gr.File(label="LoRA files", file_count="multiple", elem_id="train_exports")
    use_button = gr.Button("Use in Generate", elem_id="train_use", interactive=False)
    run_id = gr.Textbox(visible=False)
    status_json = gr.JSON(visible=False)
    run_text = gr.Textbox(visible=False)
    exported_json = gr.JSON(visible=False)

    load.click(load_images, [folder, uploads], [table, grid, table_note, selected, caption_edit], api_visibility="private")
    caption_button.click(caption, table, table, api_name="train_caption").success(
        grid_of, table, [grid, table_note], api_visibility="private")
    table.input(grid_of, table, [grid, table_note], api_visibility="private")
    grid.select(pick, table, [selected, caption_edit], api_visibility="private")
    caption_edit.input(edit, [selected, caption_edit, table], table, api_visibility="private", show_progress="hidden")
    caption_edit.blur(commit, [selected, caption_edit, table], [table, grid, table_note], api_visibility="private")
    plan_button.click(plan, [folder, preset, base, table, optimizer, regularization, prior_share], plan_box,
                      api_name="train_plan").success(
        lambda answer: json.loads(answer)["plan"], plan_box, plan_view, api_visibility="private")
    start_button.click(start, [folder, preset, base, trigger, steps, sample_every, table, uploads, captions, masks,
                               regularization, references, optimizer, prior_share], run_id,
                       api_name="train_start").success(
        lambda r: (runs_choices(r), actions.started(r)), run_id, [run, message], api_visibility="private")
    stop_button.click(stop, run, message, api_name="train_stop")
    sample_button.click(sample_now, run, message, api_name="train_sample_now")
    save_button.click(save_now, run, message, api_name="train_save_now")
    export_button.click(export_step, [run, export_choice], exported_json, api_name="train_export_step").success(
        lambda files: (files, f"Exported {len(files)} file(s) into {Path(files[0]).parent}."), exported_json,
        [exported, message], api_visibility="private")
    resume_button.click(resume, run, run_text, api_name="train_resume").success(
        lambda r: (runs_choices(r), f"Resumed {r}."), run_text, [run, message], api_visibility="private")
    gr.Button(visible=False).click(status, run_id, status_json, api_name="train_status")
    refresh_runs.click(lambda r: runs_choices(r), run, run, api_visibility="private")
    outputs = [progress_text, plot, speed, timeline, exports, use_button, report_plot, recommended, export_choice, queue_text]
    run.change(refresh, [run, export_choice], outputs, api_visibility="private")
    gr.Timer(REFRESH_SECONDS).tick(refresh, [run, export_choice], outputs, api_visibility="private", show_progress="hidden")
    return use_button.click(use, run, message, api_visibility="private")

