"""Smaller transformer (and text encoder) weights: fp8 storage (:mod:`.fp8`), bitsandbytes NF4
(:mod:`.bnb`) and packed GGUF (:mod:`.gguf`). Import the modules themselves; this package
re-exports nothing, so ``krea2 quantize --help`` (which reads ``gguf.qtypes``) loads no torch."""
