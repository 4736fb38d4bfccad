"""Pure numerics, below everything else (no ops, Flax or planning): the rounding PRNG, lossless
bit packing, the per-group and per-sample quantizers' XLA references, DIVISION's frequency split
and bit allocation under a budget."""
