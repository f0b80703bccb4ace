"""``python -m finetune CONFIG.yaml [...]`` (e.g. under ``accelerate launch`` or ``torchrun``)."""

import sys

from krea2_diffusers.cli.train import main

sys.exit(main())
