"""The ``caption`` job: a long caption from a VLM given the image and its source text, then medium
and short rewrites of it by the same model; all three stored per image.

The default VLM is our pipeline's own Qwen3-VL text encoder with its LM head (a Krea 2 folder, its
``text_encoder`` folder, or any Qwen-VL id transformers loads), driven through the library's
image-description path (``krea2_diffusers.conditioning.descriptions.describe_image``) and text sampler
(``krea2_diffusers.conditioning.expander``); ``tiny-random`` is the tiny random pipeline's for tests.
"""

from __future__ import annotations

from pathlib import Path

from .config import CaptionConfig
from .warehouse import Outcome, Warehouse

LONG_INSTRUCTION = (
    "You caption images for training a text-to-image model. Describe the image completely and literally: the "
    "subjects and their appearance, actions and positions, any text in it (quoted exactly), the setting and "
    "background, the medium or style, the lighting, colours and composition. Use the source text for names and "
    "facts only where the image agrees with it. One paragraph of plain sentences, no lists, no markdown."
)
REWRITES = {
    "caption_medium": "Rewrite this image caption in two or three sentences, keeping the main subjects, setting and style.",
    "caption_short": "Rewrite this image caption as one short sentence naming the main subject.",
}
CAPTION_SAMPLING = dict(temperature=0.3, top_k=20, top_p=0.9, repetition_penalty=1.05)
"""Captions should be faithful rather than inventive: sample cool."""


def load_captioner(name: str):
    """(model, tokenizer) of a Qwen-VL captioner: ``tiny-random``, a Krea 2 pipeline folder (its
    ``text_encoder`` + ``tokenizer``), or a model folder / hub id."""
    from krea2_diffusers.conditioning.expander import load_expander

    folder = Path(name)
    if (folder / "text_encoder").is_dir() and (folder / "tokenizer").is_dir():
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        model = AutoModelForImageTextToText.from_pretrained(folder / "text_encoder", dtype="auto")
        return model.eval(), AutoTokenizer.from_pretrained(folder / "tokenizer")
    return load_expander(name)


class CaptionJob:
    def __init__(self, config: CaptionConfig):
        self.config = config
        self.model = self.tokenizer = None

    def ready(self, warehouse: Warehouse) -> bool:
        """Loads the model before the first claim: a model that cannot load stops the worker
        without charging any row an attempt."""
        if self.model is None:
            from .models import load_model

            self.model, self.tokenizer = load_model("caption", self.config.model, load_captioner)
        return True

    def _request(self, source_text: str | None) -> str:
        if source_text:
            return f"Caption this image. Its source text: \"{source_text.strip()}\""
        return "Caption this image."

    def _rewrite(self, instruction: str, caption: str, seed: int) -> str:
        from krea2_diffusers.conditioning.expander import chat_input_ids, clean_generated_text, sample_text

        ids = chat_input_ids(self.tokenizer, [{"role": "system", "content": instruction}, {"role": "user", "content": caption}])
        kwargs = dict(do_sample=True, max_new_tokens=self.config.rewrite_max_new_tokens, **CAPTION_SAMPLING)
        if self.tokenizer.pad_token_id is not None:
            kwargs["pad_token_id"] = self.tokenizer.pad_token_id
        raw = sample_text(self.model, self.tokenizer, ids, kwargs, seed)
        return clean_generated_text(raw, tuple(getattr(self.tokenizer, "all_special_tokens", ())))

    def caption(self, image, source_text: str | None, seed: int) -> dict[str, str]:
        from krea2_diffusers.conditioning.descriptions import describe_image

        long = describe_image(self.model, self.tokenizer, image, LONG_INSTRUCTION, self._request(source_text), seed=seed,
                              max_new_tokens=self.config.max_new_tokens, max_pixels=self.config.max_pixels,
                              sampling=CAPTION_SAMPLING)
        # A model that wrote nothing usable must not erase the one text we have.
        long = long or (source_text or "")
        out = {"caption_long": long}
        for column, instruction in REWRITES.items():
            out[column] = (self._rewrite(instruction, long, seed) or long) if long else ""
        return out

    def run(self, warehouse: Warehouse, rows: list[dict]) -> None:
        from PIL import Image

        from .screening import local_path

        outcomes = []
        for row in rows:
            try:
                with Image.open(local_path(row["uri"])) as image:
                    picture = image.convert("RGB")
            except OSError as err:
                outcomes.append(Outcome(row["id"], error=f"{type(err).__name__}: {err}"))
                continue
            # Seeded per image, so a caption does not depend on which batch or worker made it.
            outcomes.append(Outcome(row["id"], self.caption(picture, row["source_text"], self.config.seed + row["id"])))
        warehouse.write("caption", outcomes)
