"""Yambda-5B's counts that the MLPerf rules pin (training 6.1.0 ``closed_dlrmv4.yaml``): declared
once, below every layer that reads them (the eval schedule, the compliance rules, the benchmarks)."""

REFERENCE_TRAIN_SAMPLES = 2_290_835_423
REFERENCE_EVAL_SAMPLES = 2_058_204
REFERENCE_MAX_SEQ_LEN = 4_096
