"""A pipeline whose text encoder is a bare ``Qwen3VLModel`` (as a diffusers folder may hold) still
expands prompts and describes styles, with the LM head wrapped around the SAME weights; and
expansions are reproducible by default."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.conditioning import expander

pytestmark = pytest.mark.usefixtures("one_thread")
TOKENS = 4


@pytest.fixture
def short_expansions(monkeypatch):
    real = expander.expand_prompts
    monkeypatch.setattr(expander, "expand_prompts", lambda *a, **kw: real(*a, **{**kw, "max_new_tokens": TOKENS}))


@pytest.fixture(scope="module")
def bare_pipe(tiny_pipe):
    pipe = Krea2Pipeline(**{**tiny_pipe.components, "text_encoder": tiny_pipe.text_encoder.model})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_bare_encoder_expands_like_the_full_model(tiny_pipe, bare_pipe, short_expansions):
    assert not hasattr(bare_pipe.text_encoder, "lm_head")
    ours = bare_pipe.expand_prompt("a cat", creativity="low", seed=3)
    assert ours == tiny_pipe.expand_prompt("a cat", creativity="low", seed=3)
    lm = bare_pipe.language_model()
    assert lm.model is bare_pipe.text_encoder and lm is bare_pipe.language_model()  # built once
    assert lm.lm_head.weight is bare_pipe.text_encoder.language_model.embed_tokens.weight  # no second copy
    encoder = {p.data_ptr() for p in bare_pipe.text_encoder.parameters()}
    assert {p.data_ptr() for p in lm.parameters()} <= encoder
    assert bare_pipe.components["text_encoder"] is tiny_pipe.text_encoder.model  # the pipeline's module is unchanged


def test_bare_encoder_runs_creativity_and_describe(bare_pipe, short_expansions, monkeypatch):
    from krea2_diffusers.conditioning import descriptions

    real = descriptions.describe_style
    monkeypatch.setattr(descriptions, "describe_style", lambda *a, **kw: real(*a, **{**kw, "max_new_tokens": TOKENS}))
    picture = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 40, 3), dtype=np.uint8))
    out = bare_pipe("a cat", height=32, width=32, num_inference_steps=1, output_type="latent", creativity="low",
                    style_images=[picture], style_mode="describe")
    assert isinstance(out.expanded_prompts[0], str) and torch.isfinite(out.images).all()


def test_untied_bare_encoder_without_head_weights_names_the_problem(tiny_pipe):
    import copy

    encoder = copy.deepcopy(tiny_pipe.text_encoder.model)
    encoder.config.tie_word_embeddings = False
    encoder.config.text_config.tie_word_embeddings = False
    with pytest.raises(ValueError, match="lm_head.weight"):
        expander.with_lm_head(encoder)


def test_expansion_is_deterministic_by_default(tiny_pipe, short_expansions):
    kwargs = dict(height=32, width=32, num_inference_steps=1, output_type="latent", creativity="low")
    first = tiny_pipe("a lighthouse", **kwargs).expanded_prompts
    again = tiny_pipe("a lighthouse", **kwargs).expanded_prompts
    assert first == again == [tiny_pipe.expand_prompt("a lighthouse", creativity="low", seed=0)]
    assert expander.expand_prompts(tiny_pipe.text_encoder, tiny_pipe.tokenizer, ["a lighthouse"], "low") == first
