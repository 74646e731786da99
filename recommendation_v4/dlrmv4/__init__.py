"""DLRMv4 HSTU benchmark: Yambda data pipeline, HSTU model and streaming trainer."""

__version__ = "0.1.0"
