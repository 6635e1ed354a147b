"""Built-in example models in plain torch: `cnn`, `mlp` and the seeds' `functions`."""
