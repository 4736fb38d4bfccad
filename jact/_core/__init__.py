"""Pure numerics, below everything else (no ops, Flax or planning): the rounding PRNG, lossless
bit packing, the per-group and per-sample quantizers' layouts and group math, DIVISION's pooling
and bit allocation under a budget. The XLA references built on them sit next to their kernels in
`jact.kernels.<op>.reference`."""
