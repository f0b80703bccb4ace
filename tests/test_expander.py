"""Prompt expander mechanics on the tiny pipeline's random Qwen3-VL (its text is gibberish; the
mechanics are what is tested) plus a scripted fake LM for output cleaning."""

from __future__ import annotations

import pytest
import torch

from krea2_diffusers.cli import main as cli_main
from krea2_diffusers.conditioning.expander import (
    CREATIVITY_LEVELS, CREATIVITY_SETTINGS, clean_generated_text, expand_prompts, strip_reasoning,
)

# Random weights: a few tokens are enough to test sampling mechanics, and keep the tests fast.
NEW_TOKENS = 5


pytestmark = pytest.mark.usefixtures("one_thread")


class ScriptedLM(torch.nn.Module):
    """A 'causal LM' whose generate appends a fixed reply and records what it was asked."""

    def __init__(self, tokenizer, reply: str):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the model a device
        self.reply_ids = tokenizer(reply, add_special_tokens=False).input_ids
        self.calls: list[dict] = []

    def generate(self, input_ids, attention_mask=None, **kwargs):
        self.calls.append(dict(input_ids=input_ids, **kwargs))
        reply = torch.tensor([self.reply_ids], dtype=input_ids.dtype)
        return torch.cat([input_ids, reply], dim=1)


class ExplodingLM(torch.nn.Module):
    def generate(self, *args, **kwargs):
        raise AssertionError("raw creativity must not call the model")


def test_raw_is_identity_and_never_calls_the_model():
    prompts = ["a red fox", "", "  two cats on a sofa  "]
    assert expand_prompts(ExplodingLM(), None, prompts, creativity="raw") == prompts


@pytest.mark.parametrize("bad", ["extreme", "RAW", "", None, 2])
def test_unknown_creativity_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="creativity must be one of"):
        expand_prompts(ExplodingLM(), None, ["a fox"], creativity=bad)


def test_levels_widen_sampling_and_medium_matches_comfyui_template():
    temps = [CREATIVITY_SETTINGS[level].temperature for level in CREATIVITY_LEVELS[1:]]
    assert temps == sorted(temps) and len(set(temps)) == 3
    medium = CREATIVITY_SETTINGS["medium"]
    assert (medium.temperature, medium.top_k, medium.top_p, medium.min_p, medium.repetition_penalty) == (0.7, 64, 0.95, 0.05, 1.05)


def test_seed_reproduces_differs_between_seeds_and_keeps_global_rng(tiny_pipe):
    te, tok = tiny_pipe.text_encoder, tiny_pipe.tokenizer
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    batch = expand_prompts(te, tok, ["a red fox", "a blue bird"], creativity="medium", seed=7, max_new_tokens=NEW_TOKENS)
    again = expand_prompts(te, tok, ["a red fox"], creativity="medium", seed=7, max_new_tokens=NEW_TOKENS)
    second = expand_prompts(te, tok, ["a blue bird"], creativity="medium", seed=8, max_new_tokens=NEW_TOKENS)
    other = expand_prompts(te, tok, ["a red fox"], creativity="medium", seed=8, max_new_tokens=NEW_TOKENS)
    assert torch.equal(torch.get_rng_state(), state), "expansion must not disturb the global RNG"
    assert again[0] == batch[0]  # same seed, same text
    assert second[0] == batch[1]  # prompt i of a batch is sampled with seed + i
    assert other[0] != batch[0]  # another seed, another text
    for text in batch + other:
        assert text and "<|" not in text and "\n" not in text


def test_unseeded_expansion_keeps_global_rng(tiny_pipe):
    state = torch.get_rng_state()
    (text,) = expand_prompts(tiny_pipe.text_encoder, tiny_pipe.tokenizer, ["a fox"], creativity="high", max_new_tokens=2)
    assert text and torch.equal(torch.get_rng_state(), state)


def test_thinking_block_never_reaches_the_output(tiny_pipe):
    tok = tiny_pipe.tokenizer
    lm = ScriptedLM(tok, "<think>The user wants a fox.\nAdd snow?</think>\nA bright red fox in fresh snow.<|im_end|>")
    assert expand_prompts(lm, tok, ["a red fox"], creativity="medium", seed=0) == ["A bright red fox in fresh snow."]
    # The chat carried our system instruction and the user's prompt, with the level's sampling settings.
    asked = tok.decode(lm.calls[0]["input_ids"][0].tolist())
    assert CREATIVITY_SETTINGS["medium"].instruction in asked and "a red fox" in asked
    assert lm.calls[0]["temperature"] == CREATIVITY_SETTINGS["medium"].temperature and lm.calls[0]["do_sample"]


def test_unterminated_thinking_falls_back_to_the_prompt(tiny_pipe):
    tok = tiny_pipe.tokenizer
    lm = ScriptedLM(tok, "<think>Let me consider the lighting and")
    assert expand_prompts(lm, tok, ["a red fox"], creativity="high", seed=0) == ["a red fox"]


def test_reasoning_closed_without_opening_tag_is_dropped():
    # Some chat templates open <think> themselves, so only the closing tag is generated.
    assert strip_reasoning("weighing options...</think>A fox.").strip() == "A fox."


def test_cleaning_gives_one_plain_paragraph_and_keeps_quoted_text():
    raw = '## Prompt\n- A **neon** sign that reads "OPEN 24/7"\n- above a rainy street.\n\n<|im_end|><|endoftext|>'
    assert clean_generated_text(raw) == 'Prompt A neon sign that reads "OPEN 24/7" above a rainy street.'


def test_cli_expand_raw_and_seeded(tiny_pipe, capsys):
    assert cli_main(["expand", "a red fox", "--creativity", "raw"]) == 0
    assert capsys.readouterr().out.strip() == "a red fox"
    assert cli_main(["expand", "a red fox", "--seed", "5", "--max-new-tokens", str(NEW_TOKENS)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    # tiny-random is deterministic, so the CLI's text encoder equals the fixture's.
    expected = expand_prompts(tiny_pipe.text_encoder, tiny_pipe.tokenizer, ["a red fox"], seed=5, max_new_tokens=NEW_TOKENS)
    assert printed[-1] == expected[0]
    assert "RANDOM WEIGHTS" in printed[0]
