"""``python -m surgery.sweep DIR``: collect a sweep's reports into summary.csv, summary.md and a plot."""

import sys

from surgery.app.sweep import main

if __name__ == "__main__":
    sys.exit(main())
