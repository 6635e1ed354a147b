"""``python -m surgery``."""

from surgery.cli import main

main()
