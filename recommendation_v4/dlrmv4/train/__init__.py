"""The streaming trainer: embeddings, optimizers, schedule, metrics, checkpoints, the loop."""
