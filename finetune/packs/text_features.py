"""Caption features precomputed into a pack (``krea2 pack --text-encoder``), so a pretraining run
needs no text encoder on its GPUs.

Columns ``text_embeds_long`` / ``_medium`` / ``_short`` (binary, null where the caption is): the
bytes of a safetensors file holding ``prompt_embeds`` (L, num_text_layers, text_dim) bfloat16 for
the caption's real tokens only (padding is masked everywhere, so it is not stored).
"""

from __future__ import annotations

from dataclasses import dataclass

from .schema import CAPTION_COLUMNS

FEATURE_COLUMNS = {caption: caption.replace("caption_", "text_embeds_") for caption in CAPTION_COLUMNS}
EMPTY_PROMPT_KEY = "krea2.pack.empty_prompt_embeds"
# Captions encoded per text-encoder call.
ENCODE_BATCH = 16


def features_to_bytes(embeds) -> bytes:
    from safetensors.torch import save

    return save({"prompt_embeds": embeds.contiguous()})


def features_from_bytes(data: bytes):
    from safetensors.torch import load

    return load(data)["prompt_embeds"]


@dataclass
class TextFeatureColumns:
    """``extra_columns`` callable for :func:`finetune.packs.write_pack`."""

    encoder: object
    max_sequence_length: int

    @classmethod
    def load(cls, spec: str, max_sequence_length: int) -> "TextFeatureColumns":
        import torch

        from ..components import load_text_encoder

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(load_text_encoder(spec, torch.bfloat16 if device == "cuda" else torch.float32, device), max_sequence_length)

    def key_value_metadata(self) -> dict[bytes, bytes]:
        """The empty prompt's features (caption dropout trains on it), once per shard."""
        import torch

        embeds, mask = self.encoder.encode([""], self.max_sequence_length)
        return {EMPTY_PROMPT_KEY.encode(): features_to_bytes(embeds[0][mask[0]].to(torch.bfloat16).cpu())}

    def __call__(self, records, rows) -> dict:
        import pyarrow as pa
        import torch

        out = {}
        for caption, column in FEATURE_COLUMNS.items():
            texts = [(i, r[caption]) for i, r in enumerate(rows) if r[caption] is not None]
            values: list[bytes | None] = [None] * len(rows)
            for start in range(0, len(texts), ENCODE_BATCH):
                chunk = texts[start:start + ENCODE_BATCH]
                embeds, mask = self.encoder.encode([t for _, t in chunk], self.max_sequence_length)
                for (index, _), e, m in zip(chunk, embeds, mask):
                    values[index] = features_to_bytes(e[m].to(torch.bfloat16).cpu())
            out[column] = pa.array(values, type=pa.binary())
        return out
