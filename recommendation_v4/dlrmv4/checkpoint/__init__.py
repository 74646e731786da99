"""Checkpoints, below the model and the trainer that write them:

- ``layout``: a checkpoint on disk, its file names and its ``COMPLETE`` marker;
- ``state``: what a checkpoint holds (the position, the tensor entries, the small state);
- ``chain``: the chain of deltas (a delta's parent, the checkpoints a resume loads, pruning);
- ``newest``: the newest checkpoint a run can trust, and the resume point;
- ``writer``: the atomic save and the background writer; ``cadence``: when one is due;
- ``loading``: reading a checkpoint back, with the chain it continues;
- ``dcp_io``: DCP's saves and loads, every writer thread's error, the written files checked;
- ``tables``: the embedding tables as a checkpoint entry, one format for both backends and any
  number of ranks; ``table_deltas``: the table rows changed since the checkpoint before;
- ``rng``: the random streams a checkpoint carries;
- ``resume_contract``: the settings a checkpoint records and a resume must match.

``train/checkpointer.py`` is the trainer's part that uses them.
"""
