"""Least-squares curves through measured step times: the ``Fit``\\ s a profile carries.

Relative least squares (each row divided by its measured time): times span orders of magnitude and every size
matters equally, while plain least squares would leave the small ones off by 100%. Coefficients are non-negative
(every feature can only add time; a negative quadratic term from noise would predict a longer prompt faster outside
the measured range): a negative feature is dropped and the rest refitted, a small active-set NNLS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from planner.profile_model import Fit, feature_value


@dataclass(slots=True)
class FitQuality:
    """How well a fit reproduces its own points (relative errors, |predicted - measured| / measured)."""

    mean_rel_error: float
    max_rel_error: float
    num_points: int

    def describe(self) -> str:
        return f"{self.num_points} points, mean rel. error {self.mean_rel_error:.1%}, max {self.max_rel_error:.1%}"


def fit_points(
    features: Sequence[str], rows: Sequence[Mapping[str, float]], seconds: Sequence[float]
) -> tuple[Fit, FitQuality]:
    """Fit ``seconds ~ sum(coef * feature)`` over ``rows`` (variable name -> value), coefficients >= 0."""
    if len(rows) != len(seconds) or not rows:
        raise ValueError("fit_points needs one measured time per row, and at least one row")
    y = np.asarray(seconds, dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("measured times must be > 0")
    design = np.array([[feature_value(name, row) for name in features] for row in rows], dtype=np.float64)
    weighted = design / y[:, None]
    target = np.ones_like(y)
    active = list(range(len(features)))
    coefficients = np.zeros(len(features))
    while active:
        solution, *_ = np.linalg.lstsq(weighted[:, active], target, rcond=None)
        if np.all(solution >= 0):
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))  # drop the most negative feature, refit the rest
    fit = Fit(features=list(features), coefficients=[float(c) for c in coefficients])
    return fit, quality(fit, rows, seconds)


def quality(fit: Fit, rows: Sequence[Mapping[str, float]], seconds: Sequence[float]) -> FitQuality:
    errors = [abs(fit(**row) - measured) / measured for row, measured in zip(rows, seconds)]
    return FitQuality(float(np.mean(errors)), float(np.max(errors)), len(errors))
