"""Which bits each residual gets: static bit plans, sensitivity estimators (pure init/update),
AC-GC's error bounds, the `Controller` that re-plans during training, and ActNN/GACT levels."""
