"""The ``embed`` job: image embeddings from a transformers vision encoder, written to NumPy shards.

Each batch becomes one ``<store>/embeddings/<uuid>.npy`` file, (rows, dim) float32, L2-normalised;
a row stores the file and its row index. ``tiny-random`` is a small random DINOv2 (nothing is
downloaded); real runs name any vision encoder id (SigLIP-2, DINOv2/v3): the vision tower's pooled
output (or its CLS token) is the embedding.
"""

from __future__ import annotations

import uuid

import numpy as np

from .config import EmbedConfig
from .warehouse import Outcome, Warehouse

TINY_IMAGE_SIZE = 32
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EMBEDDINGS_DIR = "embeddings"


def load_encoder(name: str):
    """(model, preprocess) where ``preprocess(list of PIL images) -> (N, 3, H, W) float tensor``."""
    import torch

    if name == "tiny-random":
        from transformers import Dinov2Config, Dinov2Model

        config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                              image_size=TINY_IMAGE_SIZE, patch_size=8)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Dinov2Model(config).eval()
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)

        def preprocess(images):
            arrays = [np.asarray(i.convert("RGB").resize((TINY_IMAGE_SIZE, TINY_IMAGE_SIZE)), dtype=np.float32) / 255 for i in images]
            return (torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) - mean) / std

        return model, preprocess
    from transformers import AutoImageProcessor, AutoModel

    model = AutoModel.from_pretrained(name).eval()
    model = getattr(model, "vision_model", model)  # SigLIP/CLIP: the vision tower only
    processor = AutoImageProcessor.from_pretrained(name)
    return model, lambda images: processor(images=[i.convert("RGB") for i in images], return_tensors="pt")["pixel_values"]


def pooled(outputs):
    """(N, dim): the encoder's pooled output, else its first (CLS) token."""
    pooled_output = getattr(outputs, "pooler_output", None)
    return pooled_output if pooled_output is not None else outputs.last_hidden_state[:, 0]


class EmbedJob:
    def __init__(self, config: EmbedConfig):
        self.config = config
        self.model = self.preprocess = None

    def ready(self, warehouse: Warehouse) -> bool:
        """Loads the model before the first claim: a model that cannot load stops the worker
        without charging any row an attempt."""
        if self.model is None:
            from .models import load_model

            self.model, self.preprocess = load_model("embed", self.config.model, load_encoder)
        return True

    def run(self, warehouse: Warehouse, rows: list[dict]) -> None:
        import torch
        from PIL import Image

        from krea2_diffusers.files import atomic_path

        from .screening import local_path

        outcomes, images, ids = [], [], []
        for row in rows:
            try:
                with Image.open(local_path(row["uri"])) as image:
                    images.append(image.convert("RGB"))
                ids.append(row["id"])
            except OSError as err:
                outcomes.append(Outcome(row["id"], error=f"{type(err).__name__}: {err}"))
        if images:
            vectors = []
            with torch.no_grad():
                for start in range(0, len(images), self.config.batch_size):
                    pixels = self.preprocess(images[start:start + self.config.batch_size])
                    vectors.append(pooled(self.model(pixel_values=pixels)).float())
            embeddings = torch.nn.functional.normalize(torch.cat(vectors), dim=-1).numpy()
            path = warehouse.require_store() / EMBEDDINGS_DIR / f"{uuid.uuid4().hex}.npy"
            with atomic_path(path) as tmp:
                with open(tmp, "wb") as handle:
                    np.save(handle, embeddings)
            outcomes += [Outcome(i, {"embedding_path": str(path), "embedding_row": n}) for n, i in enumerate(ids)]
        warehouse.write("embed", outcomes)
