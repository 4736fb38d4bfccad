"""jact's Flax machinery, shared by the public twins (`jact.nn`, `jact.nnx`) and `jact.convert`.

`context` holds the implicit per-call state, `hooks` the plumbing through
which Flax's own forward calls jact's ops, `compressed` the Flax route of
`jact.compressed`, `record` what `conversion_report` reads, `convert/` the
converter. Importing the package registers the Flax route of `jact.compressed`.
"""

from jact._flax import compressed  # noqa: F401  (registers the Flax route of jact.compressed)
