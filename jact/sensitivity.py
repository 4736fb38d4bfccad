"""Sensitivity estimators: how much each compressed residual adds to the gradient's variance.

The public names of `jact._planning.sensitivity` (an internal module).
"""

from jact._planning.sensitivity import (
  SensitivityState as SensitivityState,
  Estimator as Estimator,
  find_residuals as find_residuals,
  numeric as numeric,
  analytic as analytic,
  normalization_producers as normalization_producers,
  predicted_variance as predicted_variance,
  sampling_variance as sampling_variance,
  variance_factors as variance_factors,
)

__all__ = [
  "SensitivityState",
  "Estimator",
  "find_residuals",
  "numeric",
  "analytic",
  "normalization_producers",
  "predicted_variance",
  "sampling_variance",
  "variance_factors",
]
