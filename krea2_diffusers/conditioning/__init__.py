"""What the transformer is conditioned on: prompts through Qwen3-VL (:mod:`.text`, with the
tokenizer in :mod:`.tokenizer`), prompt expansion (:mod:`.expander`), and style references as
images (:mod:`.references`) or described in words (:mod:`.descriptions`), assembled by
:mod:`.style`. Import the modules themselves; this package re-exports nothing."""
