"""Checkpoints, below the model and the trainer that write them:

- ``files``: the files of a checkpoint and their life: the atomic save, the marker and the checks, the
  resume point, the load, the background writer and the cadence;
- ``tables``: the embedding tables as a checkpoint entry, one format for both backends and any
  number of ranks;
- ``rng``: the random streams a checkpoint carries;
- ``resume_contract``: the settings a checkpoint records and a resume must match.

``train/checkpointer.py`` is the trainer's part that uses them.
"""
