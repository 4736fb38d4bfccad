"""Transforms of whole functions: `jact.compressed` (compress any function's residuals) and
`jact.checkpoint` with its stateless `jax.checkpoint` policies."""
