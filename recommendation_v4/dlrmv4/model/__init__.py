"""The DLRM-v3 HSTU model (docs/model.md)."""
