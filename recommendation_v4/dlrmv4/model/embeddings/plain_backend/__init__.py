"""The plain PyTorch backend: a replica of every table on each rank, looked up by gathers.

tables.py            PlainEmbeddings: the replicated fp32 tables, the lookup and its pending gradients
sparse_optimizer.py  the row-wise Adagrad update (FBGEMM's rule, in place)
exchange.py          the gradients' exchange between ranks
"""
