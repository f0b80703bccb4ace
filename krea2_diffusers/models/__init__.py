"""The networks: the Krea 2 transformer (:mod:`.transformer`, built from :mod:`.layers`), the
single-frame tweak of the Qwen-Image VAE (:mod:`.vae`), and tiny random components for tests
(:mod:`.tiny`). Import the modules themselves; this package re-exports nothing."""
