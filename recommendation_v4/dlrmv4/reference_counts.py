"""Yambda-5B's counts that the MLPerf rules pin (training 6.1.0 ``closed_dlrmv4.yaml``): declared
once, below every layer that reads them (the eval schedule, the compliance rules, the benchmarks)."""

REFERENCE_TRAIN_SAMPLES = 2_290_835_423
REFERENCE_EVAL_SAMPLES = 2_058_204
REFERENCE_MAX_SEQ_LEN = 4_096
# Yambda-5B's item, artist and album counts (the base tables' rows, docs/data.md): what the memory plan
# sizes the tables by before a store is prepared.
YAMBDA_5B_TABLE_COUNTS = (9_390_624, 1_293_395, 3_367_692)
