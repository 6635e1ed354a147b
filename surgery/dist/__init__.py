"""Runs across processes launched by torchrun: process group, wrapping (DDP, FSDP2), one run directory."""
