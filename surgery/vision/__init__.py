"""Vision models from Hugging Face directories: their saved image processor applied, an image input by default."""
