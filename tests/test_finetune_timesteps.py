"""Each timestep sampler (``objective.timestep_sampling``) draws the law its formula states: a
Kolmogorov-Smirnov test of 20,000 draws (fixed seed, no shift) against the formula's CDF, written
here from the formula (scipy's normal and beta CDFs; SD3's mode map inverted by bisection). The
same draws must fail against the law of a nearby parameter, so the test can tell the two apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from finetune.config import ObjectiveConfig
from finetune.optimization.timesteps import SAMPLERS, sample_timesteps

DRAWS = 20_000
# 20,000 draws: the right law passes at the 1% level, a nearby one fails far below it.
PASS_P, FAIL_P = 0.01, 1e-4


def logit(x: np.ndarray) -> np.ndarray:
    return np.log(x) - np.log1p(-x)


def mode_cdf(scale: float):
    """P(t <= x) for ``t = f(U)``, ``f(u) = 1 - u - scale (cos^2(pi u / 2) - 1 + u)``, decreasing on
    [0, 1]: ``1 - f^-1(x)``, with ``f^-1`` by bisection (float64, 60 halvings: below 1e-17)."""
    def f(u):
        return 1 - u - scale * (np.cos(np.pi * u / 2) ** 2 - 1 + u)

    def cdf(x):
        low, high = np.zeros_like(x), np.ones_like(x)
        for _ in range(60):
            mid = (low + high) / 2
            above = f(mid) > x  # f decreasing: the root lies above mid
            low, high = np.where(above, mid, low), np.where(above, high, mid)
        return 1 - (low + high) / 2
    return cdf


CASES = {
    "logit_normal": (dict(logit_mean=0.3, logit_std=0.8), lambda x: stats.norm.cdf((logit(x) - 0.3) / 0.8),
                     lambda x: stats.norm.cdf((logit(x) - 0.3) / 0.88)),
    "uniform": ({}, lambda x: x, lambda x: x**1.1),
    "sigmoid": (dict(sigmoid_scale=1.5), lambda x: stats.norm.cdf(logit(x) / 1.5), lambda x: stats.norm.cdf(logit(x) / 1.65)),
    "mode": (dict(mode_scale=1.29), mode_cdf(1.29), mode_cdf(1.0)),
    "beta": (dict(beta_alpha=3.0, beta_beta=1.5), stats.beta(3.0, 1.5).cdf, stats.beta(3.3, 1.5).cdf),
}


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_timestep_sampler_matches_its_formula(sampler):
    params, cdf, nearby = CASES[sampler]
    config = ObjectiveConfig(timestep_sampling=sampler, shift="none", **params)
    t = sample_timesteps(DRAWS, 256, config, torch.Generator().manual_seed(0)).double().numpy()
    again = sample_timesteps(DRAWS, 256, config, torch.Generator().manual_seed(0)).double().numpy()
    assert np.array_equal(t, again)  # the generator alone decides the draws (a resumed run draws the same)
    # float32 draws clamped to [1e-5, 1 - 1e-5]: both move the CDF by far less than the KS
    # statistic's resolution (1 / sqrt(20000) = 0.007).
    assert stats.kstest(t, cdf).pvalue > PASS_P
    assert stats.kstest(t, nearby).pvalue < FAIL_P

