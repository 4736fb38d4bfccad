"""How a custom VJP keeps compressed residuals, shared by every op: rounding settings and seeds,
residual store/restore, scheduling (when XLA may free and rebuild residuals), the reserved residual
names, trace-time contexts, forward-mode guards and the analytic estimators' layer probes."""
