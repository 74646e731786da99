"""HSTU operators: one dispatcher per op, a PyTorch reference and a Triton kernel behind each."""
