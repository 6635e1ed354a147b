"""``python -m surgery.replay RUN_DIR``: re-run a job from its saved config and compare every fingerprint."""

import sys

from surgery.app.replay import main

if __name__ == "__main__":
    sys.exit(main())
