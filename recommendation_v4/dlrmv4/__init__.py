"""DLRMv4 HSTU benchmark: Yambda data pipeline, HSTU model and streaming trainer."""

from dlrmv4 import third_party_logs

__version__ = "0.1.0"

# Before anything imports FBGEMM (TorchRec does): its version check would log once per library.
third_party_logs.install()
