from __future__ import annotations

import sys
from pathlib import Path

# until the extension is pip-installed (-e), import it from its source folder
EXTENSION = Path(__file__).resolve().parents[2] / "extensions" / "jupyterlab-gpulab"
if str(EXTENSION) not in sys.path:
    sys.path.insert(0, str(EXTENSION))
