"""Real data and metrics: data sets streamed through a DataLoader, metrics for the surgered and unmodified model."""
