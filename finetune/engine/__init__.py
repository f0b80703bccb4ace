"""The training engine every method runs on (fine-tuning here; pretraining and post-training
build on it):

* ``runtime``    processes, devices, autocast (Accelerate; ``accelerate launch`` and ``torchrun`` alike)
* ``parallel``   activation checkpointing -> per-block compile -> DDP / FSDP2, in that order
* ``weights``    each rank reads only its own rows of every tensor from safetensors
* ``checkpoint`` sharded, atomic DCP checkpoints; resume on any number of processes
* ``loader``     the DataLoader over cached features, its resumable sampler and the per-process
                 split of the run's fixed global batch
* ``offload``    block swap: frozen block weights on the CPU, streamed in on a side CUDA stream
* ``plan``       the ``--dry-run`` memory plan per device
"""
