"""The DLRM-v3 HSTU model (SPEC §5)."""
