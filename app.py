"""Krea 2 demo in the browser (Gradio).

    python app.py --model tiny-random                # offline, random weights (tests the plumbing)
    python app.py --model tiny-random --runs-dir RUNS  # the Train tab writes its runs under RUNS
    python app.py --model krea-2-turbo.safetensors --raw-model krea-2-raw.safetensors
    python app.py --model path/to/diffusers-folder --port 7860 --share --data-root /data/lora-images

The generate function is also an API endpoint, ``/generate`` (prompt first), e.g. with gradio_client:
``Client("http://127.0.0.1:7860").predict("a red fox in snow", api_name="/generate")``.
Request limits and input checks come from ``krea2_diffusers.limits``; loading, generating and
saving (``Demo``) live here, with the UI; the Train tab (``/train_caption``, ``/train_plan``,
``/train_start``, ``/train_status``, ``/train_stop``, ``/train_resume``, ``/train_sample_now``,
``/train_save_now``, ``/train_export_step``) is the ``train_tab`` package.
The Train tab reads images and base models only inside the data roots (``--data-root``, repeatable;
default: the runs folder's parent) and the app's own upload folder (a private temporary folder, not
Gradio's shared ``<temp>/gradio``): check them before ``--share``. Relative paths (``--model``,
``--raw-model``, ``--text-encoder``, ``--vae``, and the folders a request names) are taken from the
folder the app is started in, and the Train tab writes them absolute into each run's ``train.yaml``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import torch

from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.loaders.assembly import load_pipeline
from krea2_diffusers.files import split_path_and_number
from krea2_diffusers.heap import release_freed_memory
from krea2_diffusers.limits import (
    CREATIVITY, GUIDANCE_CONVENTION, MAX_SEED, SIZE_PRESETS, STYLE_MODES, TEST_SIZE_PRESETS, InputError, Limits,
    Request, check,
)
from krea2_diffusers.pipelines.memory import MEMORY_PRESETS, apply_memory_preset
from krea2_diffusers.metadata import lora_entries, save_png
from krea2_diffusers.caching.apply import step_cache
from krea2_diffusers.presets import CACHE_METHODS, looks_distilled, preset_for
from krea2_diffusers.models.tiny import is_tiny
from train_tab.actions import TrainActions
from train_tab.roots import DataRoots
from train_tab.runs import Runs
from train_tab.ui import build_train_tab

GUIDANCE_LABEL = "Guidance (Krea scale: 0 = off; the usual CFG scale is this + 1)"
REFERENCE_SLOTS = 4  # style-reference inputs of the UI and of /generate


@dataclass
class Result:
    image: object  # PIL image
    png_path: Path  # the image with its settings in PNG text chunks
    settings: dict
    expanded_prompt: str | None


def parse_lora(spec: str) -> tuple[str, float]:
    """``"path"`` or ``"path:strength"`` -> (path, strength), as ``--lora`` takes it."""
    return split_path_and_number(spec, 1.0)


def random_seed() -> int:
    return random.randint(0, MAX_SEED)


class Demo:
    """The demo's models (Turbo and/or RAW) and generation.

    Args:
        models: variant label ("Turbo", "RAW") -> model (``tiny-random``, a diffusers folder or hub id,
            or a ``.safetensors``/``.gguf`` transformer file).
        load: ``load(model, is_distilled) -> pipeline``.
        output_dir: where the PNGs with settings are written (the newest ``keep_files`` are kept).
    """

    TRAINED_ADAPTER = "trained"  # the LoRA the Train tab's "use in Generate" loaded

    def __init__(self, models: dict[str, str], load, output_dir, limits: Limits = Limits(), keep_files: int = 200):
        self.models, self._load, self.limits = dict(models), load, limits
        self.trained_lora: str | None = None
        self.output_dir, self.keep_files = Path(output_dir), keep_files
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.tiny = all(is_tiny(m) for m in self.models.values())
        offered = {**(TEST_SIZE_PRESETS if self.tiny else {}), **SIZE_PRESETS}
        self.sizes = {name: size for name, size in offered.items() if max(size) <= limits.max_side}
        # Real checkpoints are large: keep one loaded at a time (tiny-random: both).
        self._max_loaded = len(self.models) if self.tiny else 1
        self._loaded: dict[str, object] = {}
        self._lock = threading.Lock()

    @staticmethod
    def variants_for(model: str, raw_model: str | None = None, is_distilled: bool | None = None) -> dict[str, str]:
        """The UI's model choices: with ``raw_model``, ``model`` is the Turbo; alone, tiny-random is offered
        as both and a real model as what ``is_distilled`` (default: its name) says it is."""
        if raw_model is not None:
            return {"Turbo": model, "RAW": raw_model}
        if is_tiny(model) and is_distilled is None:
            return {"Turbo": model, "RAW": model}
        turbo = looks_distilled(model) if is_distilled is None else is_distilled
        return {("Turbo" if turbo else "RAW"): model}

    def preset(self, variant: str):
        return preset_for(variant == "Turbo")

    def label(self) -> str:
        pipe = next(iter(self._loaded.values()), None)
        return getattr(pipe, "label", None) or ", ".join(f"{v}: {m}" for v, m in self.models.items())

    def pipeline(self, variant: str):
        with self._lock:
            if variant not in self._loaded:
                while len(self._loaded) >= self._max_loaded:
                    self._loaded.pop(next(iter(self._loaded)))
                    release_freed_memory()
                pipe = self._load(self.models[variant], variant == "Turbo")
                if self.trained_lora is not None:
                    pipe.load_lora_weights(self.trained_lora, adapter_name=self.TRAINED_ADAPTER)
                self._loaded[variant] = pipe
            return self._loaded[variant]

    def use_lora(self, path: str) -> None:
        """Apply a trained LoRA (in place of the previous one) to every model, loaded now or later."""
        with self._lock:
            for pipe in self._loaded.values():
                if self.TRAINED_ADAPTER in pipe.get_list_adapters().get("transformer", []):
                    pipe.delete_adapters(self.TRAINED_ADAPTER)
                pipe.load_lora_weights(path, adapter_name=self.TRAINED_ADAPTER)
            self.trained_lora = str(path)

    def generate(self, request: Request, progress=None) -> Result:
        """Run one request. ``progress(step, total, what="Sampling")`` is called after every step."""
        width, height = check(request, self.limits, self.sizes, self.models)
        pipe = self.pipeline(request.variant)
        preset = pipe.preset
        steps = int(request.steps) if request.steps is not None else preset.num_inference_steps
        guidance = float(request.guidance) if request.guidance is not None else preset.guidance_scale
        prompt, expanded, extra = request.prompt, None, {}
        if request.creativity != "raw":  # what pipe(creativity=...) does, with our token limit
            if progress is not None:
                progress(0, steps, "Expanding the prompt")
            prompt = expanded = pipe.expand_prompt(request.prompt, creativity=request.creativity, seed=int(request.seed),
                                                   max_new_tokens=self.limits.max_expansion_tokens)
        if request.style_images:
            extra.update(style_images=list(request.style_images), style_strengths=[float(s) for s in request.style_strengths],
                         style_mode=request.style_mode)

        def on_step(pipeline, step, timestep, tensors):
            if progress is not None:
                progress(step + 1, steps)
            return tensors

        with step_cache(pipe, request.cache, num_inference_steps=steps, threshold=request.cache_threshold):
            output = pipe(prompt, negative_prompt=request.negative_prompt or "", width=width, height=height,
                          num_inference_steps=steps, guidance_scale=guidance, guidance_interval=request.guidance_interval,
                          generator=torch.Generator().manual_seed(int(request.seed)), callback_on_step_end=on_step, **extra)
        image = output.images[0]
        settings = {
            "prompt": request.prompt, "negative_prompt": request.negative_prompt or "", "seed": int(request.seed),
            "steps": steps, "guidance_scale": guidance, "guidance_convention": GUIDANCE_CONVENTION,
            "width": image.width, "height": image.height, "model": getattr(pipe, "label", None) or self.models[request.variant],
            "variant": request.variant,
        }
        if self.trained_lora is not None:
            settings["loras"] = lora_entries([(self.trained_lora, 1.0)])
        if request.creativity != "raw":
            settings.update(creativity=request.creativity, expanded_prompt=expanded)
        if request.style_images:
            settings.update(style_strengths=[float(s) for s in request.style_strengths], style_mode=request.style_mode)
        if request.cache != "none":
            settings.update(cache=request.cache, cache_threshold=request.cache_threshold)
        if request.guidance_interval is not None:
            settings["guidance_interval"] = list(request.guidance_interval)
        return Result(image, self._save(image, settings), settings, expanded)

    def _save(self, image, settings: dict) -> Path:
        path = self.output_dir / f"krea2-{time.strftime('%Y%m%d-%H%M%S')}-{settings['seed']}-{time.monotonic_ns() % 10**6}.png"
        save_png(image, path, settings)
        old = sorted(self.output_dir.glob("krea2-*.png"), key=lambda p: p.stat().st_mtime)[:-self.keep_files]
        for stale in old:
            stale.unlink(missing_ok=True)
        return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-random", help="tiny-random, a diffusers folder or hub id, or a .safetensors/.gguf transformer")
    p.add_argument("--raw-model", default=None, help="a second checkpoint, offered as RAW next to --model's Turbo")
    p.add_argument("--turbo", dest="is_distilled", action="store_const", const=True, default=None, help="--model is Turbo (default: guessed from its name)")
    p.add_argument("--raw", dest="is_distilled", action="store_const", const=False, help="--model is RAW")
    p.add_argument("--text-encoder", default=None, help="Qwen3-VL-4B-Instruct hub id or folder (for single-file models)")
    p.add_argument("--vae", default=None, help="Qwen-Image VAE hub id or folder (for single-file models)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default: bfloat16 on GPU and on CPUs with bf16 units (AVX512-BF16 / AMX), else float32 (KREA2_CPU_BF16=0|1 overrides)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--memory", choices=MEMORY_PRESETS, default="auto", help="memory preset (auto: fit the GPU found)")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                   help="LoRA to apply to every model (repeatable), e.g. the style-reference LoRA for style mode 'reference'")
    p.add_argument("--runs-dir", default="runs", help="the Train tab's runs folder (one folder per run)")
    p.add_argument("--data-root", action="append", default=[], metavar="DIR",
                   help="Train tab: a folder whose images and base models requests may name (repeatable; default: the "
                        "runs folder's parent); uploads (the app's own upload folder) are always allowed")
    p.add_argument("--train-gpu-memory", type=float, default=None, metavar="GIB",
                   help="Train tab: plan for a card of this many GiB (default: the GPU found, else the preset's card)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 to serve your network)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also serve through a public gradio.live link")
    p.add_argument("--max-queue", type=int, default=20, help="requests that may wait; more are turned away")
    p.add_argument("--max-side", type=int, default=Limits.max_side, help="largest image side allowed, in pixels")
    p.add_argument("--max-steps", type=int, default=Limits.max_steps)
    p.add_argument("--max-expansion-tokens", type=int, default=Limits.max_expansion_tokens, help="longest prompt expansion")
    return p.parse_args(argv)


def make_demo(args) -> Demo:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype:
        dtype = getattr(torch, args.dtype)
    else:
        from krea2_diffusers.precision import choose_compute_dtype

        chosen = choose_compute_dtype(device)
        print(chosen.describe())
        dtype = chosen.dtype

    def load(model: str, is_distilled: bool):
        pipe = load_pipeline(Krea2Pipeline, model, text_encoder=args.text_encoder, vae=args.vae, torch_dtype=dtype,
                             is_distilled=is_distilled)
        for path, strength in map(parse_lora, args.lora):
            pipe.load_lora_weights(path, strength=strength)
        print(f"{model}: {apply_memory_preset(pipe, args.memory, device=device)}")
        pipe.set_progress_bar_config(disable=True)
        return pipe

    limits = Limits(max_side=args.max_side, max_steps=args.max_steps, max_references=REFERENCE_SLOTS,
                    max_expansion_tokens=args.max_expansion_tokens)
    demo = Demo(Demo.variants_for(args.model, args.raw_model, args.is_distilled), load,
                output_dir=tempfile.mkdtemp(prefix="krea2-app-"), limits=limits)
    demo.pipeline(next(iter(demo.models)))  # load the first model now: errors show at startup, not on first click
    return demo


def private_upload_folder() -> tuple[Path, bool]:
    """Where Gradio stores this app's uploads, a data root of the Train tab: the operator's
    ``$GRADIO_TEMP_DIR`` as it is, else a fresh temporary folder of this app's own, set as
    ``GRADIO_TEMP_DIR`` before any Blocks or server reads it. Gradio's default, ``<temp>/gradio``, is
    shared by every Gradio app on the machine: as a root it would open other apps' uploads to this
    app's requests, uploads used or not. Returns (folder, made here: removed when the app exits)."""
    given = os.environ.get("GRADIO_TEMP_DIR")
    if given:
        folder = Path(given)
        folder.mkdir(parents=True, exist_ok=True)
        return folder, False
    folder = Path(tempfile.mkdtemp(prefix="krea2-app-uploads-"))
    os.environ["GRADIO_TEMP_DIR"] = str(folder)
    return folder, True


def local_names(args: argparse.Namespace) -> argparse.Namespace:
    """The model arguments that name local files or folders made absolute, once, from the folder the
    app was started in (:func:`finetune.config_paths.resolve_name`: hub ids and ``tiny-random`` stay as
    given), so the Train tab writes them into a run's ``train.yaml`` as the same files."""
    from finetune.config_paths import resolve_name

    for name in ("model", "raw_model", "text_encoder", "vae"):
        value = getattr(args, name)
        if value is not None:
            setattr(args, name, resolve_name(value, Path.cwd()))
    return args


def use_trained_lora(demo: Demo, path: str) -> str:
    demo.use_lora(path)
    return f"Loaded {Path(path).name} into the Generate tab."


def build_ui(demo: Demo, train=None) -> gr.Blocks:
    """Both tabs; ``train`` (a :class:`train_tab.actions.TrainActions`) adds the Train tab."""
    variants, limits = list(demo.models), demo.limits
    preset = demo.preset(variants[0])

    def generate(prompt, negative_prompt="", model=variants[0], creativity="raw", size=next(iter(demo.sizes)),
                 steps=preset.num_inference_steps, guidance=preset.guidance_scale, seed=0, randomize_seed=False,
                 image_1=None, strength_1=1.0, image_2=None, strength_2=1.0, image_3=None, strength_3=1.0,
                 image_4=None, strength_4=1.0, style_mode=STYLE_MODES[0], cache="none", cache_threshold=None,
                 guidance_low=0.0, guidance_high=1.0, progress=gr.Progress()):
        """Generate one image; returns (image with settings, PNG file, settings, expanded prompt, seed used).
        ``cache_threshold`` None or < 0: the preset's; guidance interval (0, 1): every step."""
        pairs = [(image_1, strength_1), (image_2, strength_2), (image_3, strength_3), (image_4, strength_4)]
        seed = random_seed() if randomize_seed else int(seed if seed is not None else 0)
        request = Request(
            prompt=prompt, negative_prompt=negative_prompt or "", variant=model, size=size,
            steps=None if steps is None else int(steps), guidance=None if guidance is None else float(guidance), seed=seed,
            creativity=creativity or "raw", style_images=[i for i, _ in pairs if i is not None],
            style_strengths=[s for i, s in pairs if i is not None], style_mode=style_mode or STYLE_MODES[0],
            cache=cache or "none", cache_threshold=None if cache_threshold is None or cache_threshold < 0 else float(cache_threshold),
            guidance_interval=None if (guidance_low, guidance_high) == (0.0, 1.0) else (float(guidance_low), float(guidance_high)),
        )
        try:
            result = demo.generate(request, progress=lambda step, total, what="Sampling": progress((step, total), desc=what, unit="steps"))
        except (InputError, ValueError) as err:
            raise gr.Error(str(err), title="Cannot generate") from None
        return str(result.png_path), str(result.png_path), result.settings, result.expanded_prompt or "", seed

    with gr.Blocks(title="Krea 2", analytics_enabled=False) as ui:
        gr.Markdown(f"# Krea 2\nModel: **{demo.label()}**")
        with gr.Tabs() as tabs:
            with gr.Tab("Generate", id="generate"):
                lora_note = gr.Markdown(elem_id="lora_in_use")
                with gr.Row():
                    with gr.Column():
                        prompt = gr.Textbox(label="Prompt", lines=3, max_length=limits.max_prompt_chars, elem_id="prompt",
                                            placeholder="A red fox asleep in fresh snow, morning light")
                        negative = gr.Textbox(value="", label="Negative prompt", max_length=limits.max_prompt_chars,
                                              info="Used when guidance is on (RAW). Empty is fine.")
                        creativity = gr.Radio(list(CREATIVITY), value="raw", label="Creativity",
                                              info="raw renders only what you wrote; low / medium / high expand it more freely.")
                        button = gr.Button("Generate", variant="primary", elem_id="generate")
                        model = gr.Radio(variants, value=variants[0], label="Model",
                                         info="Turbo: 8 steps, guidance off. RAW: 52 steps, guidance 3.5.")
                        size = gr.Dropdown(list(demo.sizes), value=next(iter(demo.sizes)), label="Size")
                        steps = gr.Slider(1, limits.max_steps, value=preset.num_inference_steps, step=1, label="Steps")
                        guidance = gr.Slider(0, limits.max_guidance, value=preset.guidance_scale, step=0.1, label=GUIDANCE_LABEL)
                        with gr.Row():
                            seed = gr.Number(value=0, precision=0, minimum=0, maximum=MAX_SEED, label="Seed")
                            randomize = gr.Checkbox(value=True, label="Randomise seed")
                        references = []
                        with gr.Accordion("Style references", open=False):
                            style_mode = gr.Radio(list(STYLE_MODES), value=STYLE_MODES[0], label="Style mode",
                                                  info="describe: works without a LoRA; reference: the images themselves "
                                                       "(start the app with the style-reference LoRA, --lora).")
                            for i in range(REFERENCE_SLOTS):
                                with gr.Row():
                                    references.append(gr.Image(type="pil", label=f"Reference {i + 1}", height=160))
                                    references.append(gr.Slider(0, 2, value=1, step=0.05, label="Strength",
                                                                info="0 = ignored, 1 = plain reference"))
                        with gr.Accordion("Speed", open=False):
                            cache = gr.Dropdown(list(CACHE_METHODS), value="none", label="Step cache", elem_id="cache",
                                                info="Skips transformer work between steps: faster, slightly different images. "
                                                     "fbcache / taylorseer / magcache: diffusers' hooks; dbcache: cache-dit.")
                            cache_threshold = gr.Number(value=None, minimum=0, maximum=100, label="Cache threshold",
                                                        info="Empty: the preset's (RAW or Turbo). Higher skips more; "
                                                             "taylorseer: steps per full forward.")
                            with gr.Row():
                                guidance_low = gr.Slider(0, 1, value=0.0, step=0.01, label="Guidance from t =",
                                                         info="Guidance only while the noise level t (1 = noise) is in "
                                                              "[from, to]; outside, the unconditional pass is skipped.")
                                guidance_high = gr.Slider(0, 1, value=1.0, step=0.01, label="Guidance to t =")
                    with gr.Column():
                        image = gr.Image(label="Image (its PNG carries the settings)", type="filepath", format="png",
                                         interactive=False, elem_id="result", height=512)
                        expanded = gr.Textbox(label="Expanded prompt (what the model read)", interactive=False)
                        png = gr.File(label="Download PNG with settings")
                        settings = gr.JSON(label="Settings")

                model.change(lambda v: (demo.preset(v).num_inference_steps, demo.preset(v).guidance_scale), model, [steps, guidance],
                             api_visibility="private")
                button.click(generate, [prompt, negative, model, creativity, size, steps, guidance, seed, randomize, *references, style_mode,
                                        cache, cache_threshold, guidance_low, guidance_high],
                             [image, png, settings, expanded, seed], api_name="generate", concurrency_limit=1)
            if train is not None:
                with gr.Tab("Train", id="train"):
                    used = build_train_tab(train, lambda path: use_trained_lora(demo, path))
                used.success(lambda: (gr.Tabs(selected="generate"), f"LoRA in use: `{demo.trained_lora}`"), None,
                             [tabs, lora_note], api_visibility="private")
    return ui


def main(argv=None) -> None:
    args = local_names(parse_args(argv))
    runs = Runs(args.runs_dir)
    runs.root.mkdir(parents=True, exist_ok=True)
    uploads, made = private_upload_folder()
    try:  # before the model loads: a mistyped --data-root is told at once
        roots = DataRoots([*(args.data_root or [runs.root.parent]), uploads])
    except ValueError as err:
        raise SystemExit(f"app.py: --data-root: {err}") from None
    from krea2_diffusers.cpu_threads import choose_cpu_threads
    from krea2_diffusers.heap import hold_freed_chunks

    hold_freed_chunks()
    choose_cpu_threads(*filter(None, (args.model, args.raw_model)))  # before loading: tiny models run single-threaded
    demo = make_demo(args)
    if not demo.tiny:  # tiny-random's loader has already said RANDOM WEIGHTS, once
        print(f"Krea 2 demo: {demo.label()}")
    print(f"Train tab data roots: {roots}")
    train = TrainActions(runs, demo.models.get("RAW", next(iter(demo.models.values()))), captioner_model=args.text_encoder,
                         gpu_memory_gib=args.train_gpu_memory, roots=roots, models=tuple(demo.models.values()),
                         text_encoder=args.text_encoder, vae=args.vae)
    ui = build_ui(demo, train)
    ui.queue(max_size=args.max_queue, default_concurrency_limit=1)
    try:
        ui.launch(server_name=args.host, server_port=args.port, share=args.share, show_error=True, ssr_mode=False,
                  max_file_size="20mb", allowed_paths=[str(runs.root)])
    finally:
        runs.close()  # queued runs leave the queue; a run still going saves its checkpoint (Resume continues it)
        if made:  # a started run trains on its own copies of the uploads (Runs.create)
            shutil.rmtree(uploads, ignore_errors=True)


if __name__ == "__main__":
    main()
