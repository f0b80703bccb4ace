"""Prompt encoding against diffusers' encode_prompt on the real Qwen tokenizer and a tiny Qwen3-VL."""

import json

import pytest
import torch

from krea2_diffusers.conditioning.text import ASSISTANT_SUFFIX, SYSTEM_PREFIX, TAPPED_LAYERS, template_counts, tokenize_prompts
from krea2_diffusers.conditioning.tokenizer import qwen_tokenizer

PROMPTS = ["a red fox sitting in fresh snow, golden hour", "two cats", "x " * 600]


def test_real_tokenizer_template_counts():
    tok = qwen_tokenizer()
    counts = template_counts(tok)
    assert (counts.prefix, counts.suffix) == (34, 5)
    assert tok(ASSISTANT_SUFFIX).input_ids == [151645, 198, 151644, 77091, 198]
    assert tok.convert_tokens_to_ids("<|image_pad|>") == 151655
    assert tok(SYSTEM_PREFIX).input_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_the_tokenizer_is_parsed_once_per_process_and_each_caller_keeps_its_own_settings():
    first, second = qwen_tokenizer(), qwen_tokenizer()
    assert first is not second and first.backend_tokenizer is second.backend_tokenizer  # one parse
    first.padding_side = "left"
    assert second.padding_side == "right"
    left, right = (tok(["hi", "hello there world"], padding=True).input_ids[0] for tok in (first, second))
    assert left[0] == right[-1] == first.pad_token_id and left[-1] == right[0] != first.pad_token_id


def test_a_folder_tokenizer_is_parsed_once_per_content_and_loads_as_transformers_does(tmp_path):
    from transformers import AutoTokenizer

    from krea2_diffusers.conditioning.tokenizer import folder_tokenizer

    for name in ("a", "b"):
        qwen_tokenizer().save_pretrained(tmp_path / name)
    first, second = folder_tokenizer(tmp_path / "a"), folder_tokenizer(tmp_path / "b")
    assert first is not second and first.backend_tokenizer is second.backend_tokenizer  # same content: one parse
    reference = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert type(first) is type(reference) and first.chat_template == reference.chat_template
    prompts = ["a handwritten digit seven", "zq krxred ink, 12 pixels"]
    assert first(prompts, padding=True).input_ids == reference(prompts, padding=True).input_ids
    # Another content (here a changed config) is parsed on its own, and gets what its files say.
    config = tmp_path / "b" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "padding_side": "left"}))
    changed = folder_tokenizer(tmp_path / "b")
    assert changed.backend_tokenizer is not first.backend_tokenizer and changed.padding_side == "left" != first.padding_side


def test_layout_pads_between_prompt_and_suffix():
    tok = qwen_tokenizer()
    ids, mask, prefix = tokenize_prompts(tok, ["a much longer prompt than the other one", "hi"])
    suffix = tok(ASSISTANT_SUFFIX).input_ids
    assert ids[1, -5:].tolist() == suffix and ids[0, -5:].tolist() == suffix
    assert mask[0].all() and not mask[1].all()
    assert mask[1, -5:].all()
    # padding is contiguous and sits right before the suffix
    pad = (~mask[1]).nonzero().squeeze(-1)
    assert pad.max().item() == ids.shape[1] - 6 and (pad.diff() == 1).all()


def test_truncation_keeps_507_prompt_tokens():
    tok = qwen_tokenizer()
    ids, mask, prefix = tokenize_prompts(tok, [PROMPTS[2]], max_sequence_length=512)
    assert prefix == 34 and mask.sum().item() - prefix == 512


def test_encoding_matches_diffusers(tiny_pipe, oracle_pipe):
    ours, ours_mask = tiny_pipe.encode_prompt(PROMPTS)
    theirs, theirs_mask = oracle_pipe.encode_prompt(PROMPTS)
    assert theirs.shape[1] == 512 and ours.shape[1] <= 512
    assert ours.shape[2:] == (len(TAPPED_LAYERS), 32)
    for row in range(len(PROMPTS)):
        a, b = ours[row][ours_mask[row]], theirs[row][theirs_mask[row]]
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_encoding_accepts_model_without_lm_head(tiny_pipe):
    from krea2_diffusers.conditioning.text import encode_prompts

    full = encode_prompts(tiny_pipe.text_encoder, tiny_pipe.tokenizer, ["a cat"])
    base = encode_prompts(tiny_pipe.text_encoder.model, tiny_pipe.tokenizer, ["a cat"])
    assert torch.equal(full[0], base[0]) and torch.equal(full[1], base[1])


def test_repeated_prompts_are_encoded_once_and_equal_their_rows_without_copies(tiny_pipe):
    """CFG's empty negatives and a seed sweep's copies: each distinct prompt runs through the encoder once
    (one batch of 2 here, not 5), and every copy is the row the 2-prompt batch gives (the padded length is the
    longest prompt's either way)."""
    from krea2_diffusers.conditioning.text import base_text_model, encode_prompts

    prompts = ["a long prompt about a fox in the snow", "", "a long prompt about a fox in the snow", "", ""]
    batches = []
    hook = base_text_model(tiny_pipe.text_encoder).register_forward_pre_hook(
        lambda module, args, kwargs: batches.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        embeds, mask = encode_prompts(tiny_pipe.text_encoder, tiny_pipe.tokenizer, prompts)
        distinct, distinct_mask = encode_prompts(tiny_pipe.text_encoder, tiny_pipe.tokenizer, prompts[:2])
    finally:
        hook.remove()
    assert batches == [2, 2]
    rows = [0, 1, 0, 1, 1]
    assert torch.equal(embeds, distinct[rows]) and torch.equal(mask, distinct_mask[rows])


def test_position_ids_are_explicit(tiny_pipe):
    """Relying on the encoder's default positions would shift the suffix (the transformers 5.x bug)."""
    from krea2_diffusers.conditioning.text import base_text_model, text_position_ids

    ids, mask, prefix = tokenize_prompts(tiny_pipe.tokenizer, ["a long prompt about a fox in the snow", "hi"])
    model = base_text_model(tiny_pipe.text_encoder)
    with torch.no_grad():
        explicit = model(input_ids=ids, attention_mask=mask, position_ids=text_position_ids(mask), output_hidden_states=True).hidden_states[5]
        default = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[5]
        alone_ids, alone_mask, _ = tokenize_prompts(tiny_pipe.tokenizer, ["hi"])
        alone = model(input_ids=alone_ids, attention_mask=alone_mask, position_ids=text_position_ids(alone_mask), output_hidden_states=True).hidden_states[5]
    # with explicit positions the padded row equals the unpadded encoding of the same prompt
    torch.testing.assert_close(explicit[1][mask[1]], alone[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(default[1][mask[1]], alone[0], atol=1e-4)


@pytest.mark.parametrize("bad", [[], [1, 2], None])
def test_bad_prompts(tiny_pipe, bad):
    from krea2_diffusers.conditioning.text import encode_prompts

    with pytest.raises(ValueError):
        encode_prompts(tiny_pipe.text_encoder, tiny_pipe.tokenizer, bad)
