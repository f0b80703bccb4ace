"""General reference images (edit / identity / insertion LoRAs) in the pipeline and the CLI: sizes and
RoPE layout of the reference latents, the two switchable entry paths, the two reference methods,
img2img pass-through; bad input refused before any model loads.

(ComfyUI-native parity: ``test_comfyui_references``; cached == masked joint: ``test_reference_attention``.)"""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from krea2_diffusers import Krea2Img2ImgPipeline
from krea2_diffusers.cli import main
from krea2_diffusers.conditioning.reference_images import edit_reference_size

pytestmark = pytest.mark.usefixtures("one_thread")
H = W = 32


def picture(seed, width, height):
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def test_reference_images_enter_as_vision_tokens_and_latents_at_their_own_size(tiny_pipe, monkeypatch):
    # own aspect, never upscaled, sides down to multiples of 16 within the budget (hand-computed)
    assert edit_reference_size(80, 48) == (48, 80)
    assert edit_reference_size(1000, 200, max_pixels=16384) == (48, 272)  # scale sqrt(16384 / 200000) = 0.286
    seen = []
    real = tiny_pipe.transformer.prepare_conditioning
    monkeypatch.setattr(tiny_pipe.transformer, "prepare_conditioning",
                        lambda *a, **k: seen.append((a, k)) or real(*a, **k))
    refs = [picture(1, 80, 48), picture(2, 40, 72)]  # 3 x 5 tokens; 72 -> 64 px: 4 x 2 tokens

    def run(pipe=tiny_pipe, **kwargs):
        base = dict(height=H, width=W, num_inference_steps=2, guidance_scale=1.0, output_type="latent",
                    latents=torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0)))
        return pipe("recolor it red", **{**base, **kwargs}).images

    plain = run()
    (text, positions, _), plain_kwargs = seen[-1]
    both = run(reference_images=refs)
    (ref_text, ref_positions, _), kwargs = seen[-1]
    # latents: reference k at RoPE (k, i, j) after text + image, each at its own grid; modulated at t = 0
    grids = [(3, 5), (4, 2)]
    expected = [(k, i, j) for k, (gh, gw) in enumerate(grids, 1) for i in range(gh) for j in range(gw)]
    assert ref_positions[-len(expected):].tolist() == [list(map(float, p)) for p in expected]
    assert kwargs["reference_hidden_states"].shape == (1, 15 + 8, 64) and kwargs["reference_method"] == "index_timestep_zero"
    # vision tokens: both images' tokens sit in the text (tiny Qwen3-VL: 32 px per merged token, at most 384^2 px)
    assert ref_text.shape[1] > text.shape[1]
    latents_only = run(reference_images=refs, reference_vision_tokens=False)
    assert seen[-1][0][0].shape[1] == text.shape[1] and seen[-1][1]["reference_hidden_states"].shape[1] == 23
    tokens_only = run(reference_images=refs, reference_latents=False)
    assert seen[-1][0][0].shape == ref_text.shape and seen[-1][1]["reference_hidden_states"] is None
    index = run(reference_images=refs, reference_method="index")
    outputs = [plain, both, latents_only, tokens_only, index]
    assert min((a - b).abs().max() for i, a in enumerate(outputs) for b in outputs[i + 1:]) > 1e-4  # each path acts
    assert torch.equal(run(reference_images=refs, reference_strengths=0.0), plain)  # strength 0: exactly no reference
    assert plain_kwargs["reference_hidden_states"] is None
    # img2img takes them through to the same mechanism
    image = picture(3, W, H)
    img2img = Krea2Img2ImgPipeline.from_pipe(tiny_pipe)
    assert (run(img2img, image=image, reference_images=refs[:1]) - run(img2img, image=image)).abs().max() > 1e-4


def test_bad_references_are_refused_before_any_model_loads(tmp_path, monkeypatch, capsys, tiny_pipe):
    import krea2_diffusers.loaders.assembly as assembly

    monkeypatch.setattr(assembly, "load_pipeline", lambda *a, **k: pytest.fail("a model was loaded"))
    notes, image = tmp_path / "notes.png", tmp_path / "ref.png"
    notes.write_text("not an image")
    picture(0, 32, 32).save(image)
    cases = [([str(notes)], f"cannot read reference image '{notes}'"),
             ([str(image)] * 4, f"at most 3 --reference images are supported, got 4: {image}"),
             ([str(tmp_path / "missing.png")], "missing.png: no such file (--reference)")]
    for references, message in cases:
        argv = ["generate", "a", "--output", str(tmp_path / "o.png")] + [a for r in references for a in ("--reference", r)]
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    argv = ["generate", "a", "--reference", str(image), "--reference-method", "index", "--reference-attention", "cached"]
    assert main(argv + ["--output", str(tmp_path / "o.png")]) == 2 and "cannot be cached" in capsys.readouterr().err
    # the pipeline refuses before its text encoder runs
    monkeypatch.setattr(tiny_pipe.text_encoder, "forward", lambda *a, **k: pytest.fail("the text encoder ran"))
    for kwargs, message in [(dict(reference_images=[image] * 4), "at most 3 reference images are supported, got 4"),
                            (dict(reference_images=notes), f"cannot read reference image '{notes}'"),
                            (dict(reference_images=image, reference_vision_tokens=False, reference_latents=False), "both False"),
                            (dict(reference_images=image, reference_strengths=[1, 1]), "got 2 reference strengths for 1 reference images")]:
        with pytest.raises(ValueError) as error:
            tiny_pipe("a", height=H, width=W, num_inference_steps=1, **kwargs)
        assert message in str(error.value)
