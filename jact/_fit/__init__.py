"""`jact.fit`: fit a training step into a memory budget (bits per residual, compressed remat of
marked segments, offload) by compiling a bounded number of candidates."""
