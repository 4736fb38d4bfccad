"""Experiments for jact, in four rooms: `lib/` (data, models, the zoo, run metadata, timing,
resumable runs: what several experiments share), `papers/` (the papers' reproductions),
`bench/` (measurements of jact itself) and `gpu/` (checks that need a GPU). Entry points:
`python -m experiments.compare` (the main job) and `python -m experiments.gpu_campaign`."""
