"""``python -m surgery``."""

from surgery.app.cli import main

if __name__ == "__main__":
    main()
