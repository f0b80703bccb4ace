"""Pretraining Krea 2 from scratch (or continuing it) with the report's recipe: progressive
resolution stages over ``krea2-pack-v1`` packs, warmup-stable-decay, AdamW or Muon, PMA, iREPA,
fp8 on GPUs. Runs on the training engine (:mod:`finetune.engine`): same launcher, same DCP
checkpoints. Entry point: ``krea2 pretrain`` (:mod:`finetune.pretrain.cli`)."""
