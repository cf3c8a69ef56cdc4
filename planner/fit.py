"""Least-squares curves through measured step times: the ``Fit``\\ s a profile carries.

Why relative least squares: measured times span two or three orders of magnitude (a 16-token prefill against a
2048-token one), and the simulator cares about every size equally. Plain least squares would fit the largest points
and let the small ones be off by 100%; dividing each row by its measured time minimises the relative error instead.

Why non-negative coefficients: every feature (a constant, tokens, tokens x context, batch, bytes) can only add time.
A negative coefficient, which noise easily produces for a small quadratic term, would make a longer prompt predict a
shorter time outside the measured range. So a feature whose coefficient comes out negative is dropped (its
coefficient set to 0) and the rest refitted, until none is negative: a small active-set NNLS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from planner.profile_model import Fit, feature_value


@dataclass(slots=True)
class FitQuality:
    """How well a fit reproduces the points it was fitted to (relative errors, |predicted - measured| / measured)."""

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
    weighted = design / y[:, None]  # relative least squares: each row divided by its measured time
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
