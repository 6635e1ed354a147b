"""``python -m surgery``."""

from surgery.app.cli import main

main()
