"""Language models: local Hugging Face directories, text prompts, generation under a surgery, LM metrics."""
