"""Built-in GRPO rewards. Each is a class built once from the reward's ``options``; its model loads
on the first call (never at import), from a hub id or a local folder.

* ``krea2.clip``: CLIP or SigLIP (any ``transformers`` model with ``get_image_features`` /
  ``get_text_features``). ``mode: alignment`` = cosine(image, prompt); ``mode: aesthetic`` =
  cosine(image, ``positive``) - cosine(image, ``negative``).
* ``krea2.vlm_rubric``: prompt following checked item by item by a VLM. The rubric is
  ``metadata["rubric"]`` (a list of requirements) or the prompt split at commas / semicolons /
  " and "; each item is asked as a yes/no question and scored ``P(yes) / (P(yes) + P(no))`` from
  the next-token logits; the reward is the mean over items. Krea 2's own text encoder is
  Qwen3-VL-4B-Instruct with its LM head, so ``model: Qwen/Qwen3-VL-4B-Instruct`` (or the local
  folder it was loaded from) scores with the weights the pipeline already uses; any
  ``AutoModelForImageTextToText`` works.
* ``krea2.ocr``: text rendering, only where an OCR model is configured (``options.model``, e.g.
  ``microsoft/trocr-base-printed``). The text to render is ``metadata["text"]`` or the prompt's
  quoted spans; the reward is ``1 - edit distance / length`` (1.0 when the prompt asks for no text).
"""

from __future__ import annotations

import re

import torch

from ..config import ConfigError


def _device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _embedding(output) -> torch.Tensor:
    """(n, dim) projected features: transformers >= 5 wraps them in an output's ``pooler_output``."""
    return (output if isinstance(output, torch.Tensor) else output.pooler_output).float()


class CLIPReward:
    def __init__(self, model: str | None = None, mode: str = "alignment",
                 positive: str = "a beautiful, detailed, high quality image",
                 negative: str = "an ugly, blurry, low quality image", device: str | None = None):
        if not model:
            raise ConfigError("krea2.clip needs options.model (a CLIP or SigLIP model id or folder)")
        if mode not in ("alignment", "aesthetic"):
            raise ConfigError(f"krea2.clip: options.mode must be 'alignment' or 'aesthetic', got {mode!r}")
        self.name, self.mode, self.positive, self.negative = model, mode, positive, negative
        self.device = _device(device)
        self.loaded = None  # (model, processor)

    def _load(self):
        if self.loaded is None:
            from transformers import AutoModel, AutoProcessor

            self.loaded = AutoModel.from_pretrained(self.name).to(self.device).eval(), AutoProcessor.from_pretrained(self.name)
        return self.loaded

    @torch.no_grad()
    def __call__(self, images, prompts, metadata) -> list[float]:
        model, processor = self._load()
        pixels = processor(images=images, return_tensors="pt").to(self.device)
        image = torch.nn.functional.normalize(_embedding(model.get_image_features(**pixels)), dim=-1)
        texts = list(prompts) if self.mode == "alignment" else [self.positive, self.negative]
        # SigLIP was trained on max_length padding; CLIP accepts either.
        tokens = processor(text=texts, padding="max_length", truncation=True, return_tensors="pt").to(self.device)
        text = torch.nn.functional.normalize(_embedding(model.get_text_features(**tokens)), dim=-1)
        if self.mode == "alignment":
            return (image * text).sum(-1).tolist()
        similarity = image @ text.T  # (n, 2)
        return (similarity[:, 0] - similarity[:, 1]).tolist()


def rubric_items(prompt: str, meta: dict, max_items: int) -> list[str]:
    """The requirements of a prompt: ``meta["rubric"]`` or the prompt's comma / semicolon / "and" parts."""
    items = meta.get("rubric") or [p.strip() for p in re.split(r",|;|\band\b", prompt) if p.strip()]
    return list(items)[:max_items] or [prompt]


class VLMRubricReward:
    def __init__(self, model: str | None = None, question: str = "Does the image show {item}? Answer yes or no.",
                 max_items: int = 8, device: str | None = None):
        if not model:
            raise ConfigError("krea2.vlm_rubric needs options.model (e.g. Qwen/Qwen3-VL-4B-Instruct, Krea 2's text encoder)")
        self.name, self.question, self.max_items = model, question, max_items
        self.device = _device(device)
        self.loaded = None  # (model, processor)

    def _load(self):
        if self.loaded is None:
            from transformers import AutoModelForImageTextToText, AutoProcessor

            model = AutoModelForImageTextToText.from_pretrained(self.name, dtype="auto").to(self.device).eval()
            self.loaded = model, AutoProcessor.from_pretrained(self.name)
        return self.loaded

    def _answer_ids(self, tokenizer) -> tuple[list[int], list[int]]:
        ids = lambda words: sorted({tokenizer.encode(w, add_special_tokens=False)[0] for w in words})
        return ids(["yes", "Yes", " yes", " Yes"]), ids(["no", "No", " no", " No"])

    @torch.no_grad()
    def probability_yes(self, image, question: str) -> float:
        model, processor = self._load()
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=[text], images=[image], return_tensors="pt").to(self.device)
        logits = model(**inputs).logits[0, -1].float()
        yes, no = self._answer_ids(processor.tokenizer)
        p_yes, p_no = torch.logsumexp(logits[yes], 0), torch.logsumexp(logits[no], 0)
        return float(torch.sigmoid(p_yes - p_no))

    def __call__(self, images, prompts, metadata) -> list[float]:
        scores = []
        for image, prompt, meta in zip(images, prompts, metadata):
            items = rubric_items(prompt, meta, self.max_items)
            scores.append(sum(self.probability_yes(image, self.question.format(item=i)) for i in items) / len(items))
        return scores


def edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def text_to_render(prompt: str, meta: dict) -> str:
    """``meta["text"]``, or the prompt's quoted spans joined by spaces ("" when none)."""
    if meta.get("text"):
        return str(meta["text"])
    return " ".join(a or b for a, b in re.findall(r'"([^"]+)"|\u201c([^\u201d]+)\u201d', prompt))


class OCRReward:
    def __init__(self, model: str | None = None, device: str | None = None):
        if not model:
            raise ConfigError("krea2.ocr needs options.model (an OCR model, e.g. microsoft/trocr-base-printed)")
        self.name, self.device = model, _device(device)
        self.reader = None

    def read(self, images) -> list[str]:
        if self.reader is None:
            from transformers import pipeline

            self.reader = pipeline("image-to-text", model=self.name, device=self.device)
        return [out[0]["generated_text"] for out in self.reader(list(images))]

    def __call__(self, images, prompts, metadata) -> list[float]:
        targets = [text_to_render(p, m).lower().strip() for p, m in zip(prompts, metadata)]
        read = self.read(images) if any(targets) else [""] * len(images)
        return [1.0 if not t else max(0.0, 1.0 - edit_distance(t, r.lower().strip()) / len(t)) for t, r in zip(targets, read)]
