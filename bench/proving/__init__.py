"""The proving ground (issue 32): a Krea 2 of the real architecture, small enough for a CPU, trained
from scratch on scikit-learn's real handwritten digits with the project's own commands, then
measured stage by stage (``bench/proving_ground.py``).

Modules, one job each: :mod:`digits` (the data), :mod:`autoencoder` (the tiny Qwen-Image VAE the
bench trains), :mod:`pretraining` (``krea2 pack`` + ``krea2 pretrain`` + the model folder),
:mod:`lora` (``krea2 train``), :mod:`sampling` (``Krea2Pipeline``), :mod:`judge`, :mod:`rewards`,
:mod:`posttraining`, :mod:`report`.
"""
