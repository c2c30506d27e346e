"""Tree components: FULL (backbone), SWA (window W) and MAMBA, behind one plug-in interface."""

from __future__ import annotations

from kvtier.runtime.tree.components.base import InsertContext, TreeBooks, TreeComponent, Validator
from kvtier.runtime.tree.components.full import FullComponent
from kvtier.runtime.tree.components.mamba import MambaComponent
from kvtier.runtime.tree.components.swa import SWAComponent

__all__ = [
    "FullComponent",
    "InsertContext",
    "MambaComponent",
    "SWAComponent",
    "TreeBooks",
    "TreeComponent",
    "Validator",
]
