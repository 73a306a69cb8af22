"""Make the example plugin importable from its source folder (as its own test suite would)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
