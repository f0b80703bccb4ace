"""The checkpoint report: which checkpoint of a run to use (issue 41).

At each validation of a ``krea2 train`` run with validation prompts, the report samples the
prompts with the trigger and without it at a few seeds, encodes them with an image-feature
encoder and measures concept, leak, copying and diversity against the training images and the
base model's samples; ``<output_dir>/report.json`` and ``report.html`` then recommend a checkpoint.

* :mod:`~finetune.report.plan`: which prompts and seeds are sampled (trigger words, leak prompts).
* :mod:`~finetune.report.features`: the image-feature encoders (Qwen3-VL's vision tower, or a
  ``transformers`` image model).
* :mod:`~finetune.report.metrics`: the measures, as functions of features and pixels.
* :mod:`~finetune.report.collector`: the run's side: base samples (cached in the run folder),
  training-image features, one row per validation in ``report/metrics.jsonl``.
* :mod:`~finetune.report.recommend`: the rule that picks the checkpoint, with its reasons.
* :mod:`~finetune.report.writer` and :mod:`~finetune.report.html`: ``report.json`` and ``report.html``.
* :mod:`~finetune.report.cli`: ``krea2 report RUN_DIR`` rebuilds both from the run folder.
"""
