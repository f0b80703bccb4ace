"""``python -m finetune.posttrain CONFIG.yaml [...]`` (e.g. under ``accelerate launch`` or ``torchrun``)."""

import sys

from .cli import main

sys.exit(main())
