"""What a training run minimizes and how: the flow-matching loss (``objective``), where on the noise
path each sample is trained (``timesteps``), optimizers and learning-rate schedules (``optim``), an
exponential moving average of the trained weights (``ema``), and their config sections (``config``).
Shared by fine-tuning, post-training and pretraining."""
