"""The renderers behind scripts/gen_reference.py: config.py (docs/config.md) and expressions.py (expressions.md)."""
