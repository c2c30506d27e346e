"""Child Python processes that import this checkout's ``kvtier``.

A test that starts ``python3 script.py`` or ``python3 -c ...`` must not depend on kvtier being
installed, nor on the directory pytest runs from: a script's own directory, not the working
directory, heads its ``sys.path``, and an editable install may point at another checkout (or at
one since deleted). ``child_env`` puts this checkout first on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``, plus ``extra``."""
    path = os.environ.get("PYTHONPATH")
    first = str(CHECKOUT)
    return {
        **os.environ,
        "PYTHONPATH": first if not path else first + os.pathsep + path,
        **extra,
    }
