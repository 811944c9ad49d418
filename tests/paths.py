"""Where the clone is: the tests and their examples run from it."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
