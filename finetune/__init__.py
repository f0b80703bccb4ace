"""Fine-tuning Krea 2 RAW: LoRA (PEFT) and full fine-tune (FSDP2), driven by one YAML config.

    krea2 train examples/train_lora_tiny.yaml --output-dir outputs/tiny
    accelerate launch -m finetune CONFIG.yaml        # several processes / GPUs

Public entry points: :func:`finetune.config.load_config`, :func:`finetune.trainer.train`.
"""

from .config import ConfigError, TrainConfig, build_config, load_config

__all__ = ["ConfigError", "TrainConfig", "build_config", "load_config", "train"]


def train(config: TrainConfig, resume: bool = False):
    from .trainer import train as _train

    return _train(config, resume)
