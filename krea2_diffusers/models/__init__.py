"""The networks: the Krea 2 transformer (:mod:`.transformer`, built from :mod:`.layers`), the
single-frame tweak of the Qwen-Image VAE (:mod:`.vae`), tiny random components for tests
(:mod:`.tiny`), and the packaged trained ``krea2-digits`` (:mod:`.digits`). Import the modules
themselves; this package re-exports nothing."""
