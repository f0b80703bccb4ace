"""Prompt expander: a causal LM turns a short prompt into a detailed one ("creativity").

By default the pipeline's own Qwen3-VL (the text encoder with its LM head) writes the expansion,
so expanding costs no extra weights. Any ``transformers`` causal LM with its tokenizer works too.

Levels: ``raw`` renders only what was written (identity, the model is not called); ``low``,
``medium`` and ``high`` expand increasingly freely, through both the instruction text and the
sampling temperature. ``medium`` samples like ComfyUI's official Krea 2 template.

The output is cleaned for the text encoder: reasoning blocks (``<think>...</think>``, also an
unterminated one) and chat special tokens are removed and the text is collapsed to one paragraph.
An empty result falls back to the user's prompt, so expansion can never erase a prompt.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CREATIVITY_LEVELS = ("raw", "low", "medium", "high")
DEFAULT_CREATIVITY = "medium"
DEFAULT_MAX_NEW_TOKENS = 512
# Expansions are reproducible by default, like images (seed 0); pass seed=None for a fresh sample.
DEFAULT_EXPANSION_SEED = 0

# Rules every expanding level follows; they protect what the user asked for.
_COMMON_RULES = (
    "You write prompts for a text-to-image model. The user gives you an image idea. Reply with the prompt "
    "only: no preface, no explanation, no title.\n"
    "Rules:\n"
    "- Keep every subject, action, colour, count and spatial relation the user stated, exactly as stated. "
    "Never change a number or swap left and right.\n"
    "- If the user asks for a medium or technique (a photo, an illustration, a 3D render, a watercolour, "
    "pixel art ...), the prompt is in that medium. If none is asked for, choose one that suits the idea.\n"
    "- Text that should appear in the image goes in double quotes, letter for letter as the user gave it.\n"
    "- Do not add new objects, people, animals or text that the idea does not imply.\n"
    "- Write a single paragraph of plain sentences: no lists, no headings, no markdown, no line breaks.\n"
    "- If the user's prompt is already detailed, only polish its wording and keep its content and order."
)

_LEVEL_GUIDANCE = {
    "low": (
        "Stay very close to the user's words. Add only what an image needs to be unambiguous: the medium, the "
        "setting in a few words, the light. Keep it to two or three sentences."
    ),
    "medium": (
        "Turn the idea into a vivid description: describe the subjects' appearance, materials and textures, the "
        "setting and background, the lighting, the colour palette, the camera or viewpoint and the mood. Stay "
        "faithful to the idea; aim for four to six sentences."
    ),
    "high": (
        "Interpret the idea boldly as an art director would: choose a striking composition, an unusual viewpoint, "
        "expressive lighting and a distinctive palette and atmosphere, and describe the scene richly. Every rule "
        "above still holds: embellish how things look, never what is there. Aim for six to eight sentences."
    ),
}


@dataclass(frozen=True)
class CreativitySettings:
    """Instruction and sampling settings of one expanding level."""

    instruction: str
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float


# medium = ComfyUI's official template (temperature 0.7, top_k 64, top_p 0.95, min_p 0.05, repetition
# penalty 1.05); low narrows the distribution, high widens it.
CREATIVITY_SETTINGS = {
    "low": CreativitySettings(f"{_COMMON_RULES}\n{_LEVEL_GUIDANCE['low']}", 0.4, 32, 0.9, 0.1, 1.05),
    "medium": CreativitySettings(f"{_COMMON_RULES}\n{_LEVEL_GUIDANCE['medium']}", 0.7, 64, 0.95, 0.05, 1.05),
    "high": CreativitySettings(f"{_COMMON_RULES}\n{_LEVEL_GUIDANCE['high']}", 1.0, 96, 0.98, 0.02, 1.05),
}

# Reasoning models (Qwen3 "thinking", DeepSeek-R1 ...) wrap their reasoning in these tags.
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_THINK_OPEN = re.compile(r"<think>", re.IGNORECASE)
_THINK_CLOSE = re.compile(r"</think>", re.IGNORECASE)
# Chat control tokens of the Qwen family (<|im_end|>, <|endoftext|> ...), should any survive decoding.
_CHAT_TOKEN = re.compile(r"<\|[a-z_]+\|>")
# Markdown a chat model may add despite the instruction: headings, bullets, emphasis markers.
_MARKDOWN_LINE_START = re.compile(r"^\s*(?:#{1,6}\s+|[-*+]\s+|\d+[.)]\s+)", re.MULTILINE)
_MARKDOWN_EMPHASIS = re.compile(r"\*\*|__")
_WHITESPACE = re.compile(r"\s+")


def check_creativity(creativity: str) -> str:
    """Return ``creativity`` if it is a known level, else raise a ValueError listing the levels."""
    if not isinstance(creativity, str) or creativity not in CREATIVITY_LEVELS:
        raise ValueError(f"creativity must be one of {CREATIVITY_LEVELS}, got {creativity!r}")
    return creativity


def strip_reasoning(text: str) -> str:
    """Remove ``<think>...</think>`` blocks, an unterminated ``<think>`` (everything after it), and
    reasoning that ended with ``</think>`` whose opening tag was part of the chat template."""
    text = _THINK_BLOCK.sub(" ", text)
    close = list(_THINK_CLOSE.finditer(text))
    if close:
        text = text[close[-1].end():]
    opened = _THINK_OPEN.search(text)
    if opened:
        text = text[: opened.start()]
    return text


def clean_generated_text(text: str, special_tokens=()) -> str:
    """Generated text -> one plain paragraph: no reasoning, no chat tokens, no markdown, no line breaks."""
    text = strip_reasoning(text)
    for token in special_tokens:
        text = text.replace(token, " ")
    text = _CHAT_TOKEN.sub(" ", text)
    text = _MARKDOWN_LINE_START.sub("", text)
    text = _MARKDOWN_EMPHASIS.sub("", text)
    return _WHITESPACE.sub(" ", text).strip()


def chat_input_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` followed by the assistant's turn opening.

    Uses the tokenizer's chat template (with ``enable_thinking=False``, which Qwen3 hybrid templates read
    and others ignore); without a template, the ChatML layout the Qwen family uses.
    """
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, enable_thinking=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"
    return tokenizer(text, add_special_tokens=False).input_ids


def _fork_rng_devices(model) -> tuple[list, str]:
    """Devices whose RNG ``torch.random.fork_rng`` must save for sampling on ``model``'s device."""
    device = next(model.parameters()).device
    if device.type == "cpu":
        return [], "cuda"
    return [device], device.type


def generation_kwargs(model, tokenizer, settings: CreativitySettings, max_new_tokens: int) -> dict:
    """Sampling arguments for ``model.generate``; the model's own EOS list wins over the tokenizer's."""
    kwargs = dict(
        do_sample=True, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
        min_p=settings.min_p, repetition_penalty=settings.repetition_penalty, max_new_tokens=max_new_tokens,
    )
    config = getattr(model, "generation_config", None)
    if getattr(config, "eos_token_id", None) is None and tokenizer.eos_token_id is not None:
        kwargs["eos_token_id"] = tokenizer.eos_token_id
    if getattr(config, "pad_token_id", None) is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is not None:
            kwargs["pad_token_id"] = pad
    return kwargs


def sample_text(model, tokenizer, input_ids: list[int], kwargs: dict, seed: int | None, **model_inputs) -> str:
    """Sample a continuation of ``input_ids`` and decode only the new tokens (special tokens kept, so
    the caller can see and strip them).

    The global RNG is untouched: sampling runs inside ``torch.random.fork_rng`` seeded with ``seed``
    (a fresh random seed when None).
    """
    import torch

    if not hasattr(model, "generate"):
        raise ValueError(f"{type(model).__name__} cannot generate text (no LM head); pass a causal LM such as "
                         "Qwen3VLForConditionalGeneration")
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)
    devices, device_type = _fork_rng_devices(model)
    with torch.random.fork_rng(devices=devices, device_type=device_type), torch.no_grad():
        if seed is None:
            torch.seed()
        else:
            torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **model_inputs, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=False)


def _check_seed(seed) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")


def expand_prompts(
    model, tokenizer, prompts: list[str], creativity: str = DEFAULT_CREATIVITY, seed: int | None = DEFAULT_EXPANSION_SEED,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, streamer=None,
) -> list[str]:
    """Expand prompts with a causal LM.

    Args:
        model: a causal LM with ``generate`` (e.g. the pipeline's ``Qwen3VLForConditionalGeneration``).
        tokenizer: its tokenizer (a chat template is used when present).
        prompts: the user's prompts.
        creativity: one of :data:`CREATIVITY_LEVELS`; ``"raw"`` returns the prompts unchanged without
            touching the model.
        seed: prompt i is sampled with ``seed + i`` (as images are seeded), so an expansion does not
            depend on the rest of the batch; default 0 (reproducible), None samples freshly. The
            global RNG is never disturbed.
        max_new_tokens: cap on the expansion's length in tokens.
        streamer: a transformers streamer (``put(token_ids)``, ``end()``) shown every prompt's
            tokens as they are sampled (the prompt's ids first), e.g. for progress.

    Returns:
        One expanded prompt per input (the original prompt where the model produced nothing usable).
    """
    check_creativity(creativity)
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a list of strings, got {prompts!r}")
    _check_seed(seed)
    if creativity == "raw":
        return list(prompts)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    settings = CREATIVITY_SETTINGS[creativity]
    kwargs = generation_kwargs(model, tokenizer, settings, max_new_tokens)
    if streamer is not None:
        kwargs["streamer"] = streamer
    specials = tuple(getattr(tokenizer, "all_special_tokens", ()))
    expanded = []
    for index, prompt in enumerate(prompts):
        if not prompt.strip():
            expanded.append(prompt)  # nothing to expand: an empty prompt stays empty (unconditional)
            continue
        messages = [{"role": "system", "content": settings.instruction}, {"role": "user", "content": prompt.strip()}]
        raw = sample_text(model, tokenizer, chat_input_ids(tokenizer, messages), kwargs, None if seed is None else seed + index)
        text = clean_generated_text(raw, specials)
        if not text:
            logger.warning("prompt expander returned nothing for %r; using the prompt as written", prompt)
        expanded.append(text or prompt)
    return expanded


def load_expander(name_or_model, torch_dtype=None, device=None):
    """Resolve an expander to ``(model, tokenizer)``.

    Args:
        name_or_model: ``"tiny-random"`` (the tiny pipeline's random Qwen3-VL, for tests); a hub id or
            local folder of any causal LM (loaded with ``AutoModelForCausalLM``, falling back to
            ``AutoModelForImageTextToText`` for vision-language models such as Qwen3-VL); a
            ``(model, tokenizer)`` pair; or an object with ``text_encoder`` and ``tokenizer`` (a pipeline).
    """
    if isinstance(name_or_model, tuple) and len(name_or_model) == 2:
        return name_or_model
    if hasattr(name_or_model, "text_encoder") and hasattr(name_or_model, "tokenizer"):
        return name_or_model.text_encoder, name_or_model.tokenizer
    if not isinstance(name_or_model, (str, Path)):
        raise ValueError("expander must be 'tiny-random', a hub id or folder, or a (model, tokenizer) pair; "
                         f"got {type(name_or_model).__name__}")
    from ..models.tiny import is_tiny

    if is_tiny(name_or_model):
        from ..models.tiny import tiny_components

        parts = tiny_components()
        model, tokenizer = parts["text_encoder"], parts["tokenizer"]
    else:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        source = str(name_or_model)
        tokenizer = AutoTokenizer.from_pretrained(source)
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype or "auto")
        except ValueError:  # a vision-language config that AutoModelForCausalLM does not map
            model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch_dtype or "auto")
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer


def with_lm_head(text_encoder, folder: str | Path | None = None):
    """``text_encoder`` able to generate text, without a second copy of its weights.

    A ``Qwen3VLForConditionalGeneration`` is returned as is. A bare ``Qwen3VLModel`` (what a
    diffusers folder may hold) is wrapped in the conditional-generation class whose ``model`` IS
    that encoder; the LM head is the input embedding when the config ties them (Qwen3-VL-4B does),
    else ``lm_head.weight`` read from ``folder``'s ``text_encoder/*.safetensors``.
    """
    if hasattr(text_encoder, "lm_head") or text_encoder is None:
        return text_encoder
    if not hasattr(text_encoder, "language_model"):
        raise ValueError(f"{type(text_encoder).__name__} is not a Qwen3-VL text encoder; prompt expansion needs one")
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    config = text_encoder.config
    with torch.device("meta"):
        wrapper = Qwen3VLForConditionalGeneration(config)
    wrapper.model = text_encoder  # the encoder's own modules: no copy
    embed = text_encoder.language_model.embed_tokens.weight
    tied = getattr(config, "tie_word_embeddings", False) or getattr(getattr(config, "text_config", None), "tie_word_embeddings", False)
    if tied:
        wrapper.lm_head.weight = embed
    else:
        weight = _read_lm_head(folder)
        if weight is None:
            raise ValueError("the text encoder is a Qwen3VLModel without an LM head and its config does not tie the head to "
                             f"the embeddings; no lm_head.weight found in {folder or 'the pipeline folder'}/text_encoder. "
                             "Load the text encoder as Qwen3VLForConditionalGeneration for creativity= and style_mode='describe'")
        wrapper.lm_head.weight = torch.nn.Parameter(weight.to(device=embed.device, dtype=embed.dtype), requires_grad=False)
    return wrapper.eval()


def _read_lm_head(folder):
    """``lm_head.weight`` from a diffusers folder's ``text_encoder/*.safetensors``, or None."""
    if folder is None or not (Path(folder) / "text_encoder").is_dir():
        return None
    from safetensors import safe_open

    for file in sorted((Path(folder) / "text_encoder").glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            if "lm_head.weight" in handle.keys():
                return handle.get_tensor("lm_head.weight")
    return None
