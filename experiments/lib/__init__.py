"""What several experiments share: real-data loaders, models, the zoo, run metadata, timing,
resumable runs and the notebooks' tables. Nothing here imports a script of another room."""
