"""The TorchRec backend: the tables sharded by TorchRec's planner under DistributedModelParallel,
looked up and updated by FBGEMM's fused row-wise Adagrad.

  tables.py    TorchRecEmbeddings: the sharded tables, the lookup, ids sent ahead, the live state
  sharding.py  TorchRec's sharding plan for a target topology and the quantized all-to-all codecs
  permute.py   a gather for the backward of TorchRec's row-wise unbucketize step
  compat.py    every reliance on TorchRec's and FBGEMM's insides, checked once
"""
