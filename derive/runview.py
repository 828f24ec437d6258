"""What the derived tables read of a loaded run, as a Protocol.

traindx.derive.run.RunRecord is the one implementation. The ledger and the steady window type
their `run` argument with this instead of RunRecord, so that run.py may import them (it builds
its ledger with them) with no import cycle between the three modules.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol, TypeVar

import pandas as pd

T = TypeVar("T")


class RunView(Protocol):
    """A loaded run: its manifest, its per-type events and the tables derived from them."""

    @property
    def path(self) -> str: ...

    @property
    def manifest(self) -> dict[str, Any]: ...

    @property
    def t_min(self) -> int | None: ...

    @property
    def steps(self) -> pd.DataFrame: ...

    @property
    def spans(self) -> pd.DataFrame: ...

    @property
    def compiles(self) -> pd.DataFrame: ...

    @property
    def gc(self) -> pd.DataFrame: ...

    @property
    def log_steps(self) -> pd.DataFrame: ...

    @property
    def ledger(self) -> pd.DataFrame: ...

    def of_type(self, type_: str) -> pd.DataFrame: ...

    def cached(self, key: Hashable, build: Callable[[], T]) -> T: ...

    def rank_steps(self, rank: str) -> pd.DataFrame: ...

    def rank_rows(self, table: Hashable, rank: str, frame: pd.DataFrame | None = None) -> pd.DataFrame: ...
