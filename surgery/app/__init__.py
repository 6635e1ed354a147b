"""The command-line application around the engine: the Hydra entry point, the job, inputs, reports and plots."""
