"""Recipes inside other people's training loops: Lightning (``.lightning``) and ``transformers.Trainer`` (``.hf``).

Each submodule imports its framework; this package imports neither, so ``surgery`` works without them.
"""
