"""Post-training on the training engine: ``method: dpo | grpo | draft | distill``.

    krea2 posttrain examples/posttrain_dpo_tiny.yaml

See ``finetune/POSTTRAIN.md``. Entry point: :func:`finetune.posttrain.run.posttrain`.
"""
