"""What a run exports, written from one of its DCP checkpoints: LoRA files and full weights
(:mod:`.writer`), and ``krea2 export`` (:mod:`.cli`). This package re-exports nothing."""
