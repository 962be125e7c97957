"""Small helpers shared by the load client and the benchmark: percentiles, tables, JSON."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def dist(values: Iterable[float], *, scale: float = 1.0,
         pcts: Sequence[int] = (50, 95, 99)) -> dict[str, float | None]:
    """``{"mean", "p50", "p95", "p99", "max", "n"}`` of ``values * scale`` (linear-interpolated
    percentiles, numpy's default). An empty input has no figures: None each (printed "-", JSON
    null), ``n = 0``; a 0.00 would read as a measurement."""
    arr = np.asarray(list(values), dtype=np.float64) * scale
    out: dict[str, float | None] = {}
    if arr.size == 0:
        out["mean"] = None
        for p in pcts:
            out[f"p{p}"] = None
        out["max"] = None
        out["n"] = 0
        return out
    out["mean"] = float(arr.mean())
    for p, v in zip(pcts, np.percentile(arr, list(pcts))):
        out[f"p{p}"] = float(v)
    out["max"] = float(arr.max())
    out["n"] = int(arr.size)
    return out


def ratio(a: float | None, b: float | None) -> float:
    """``a / b``; NaN (printed "-", JSON null) when either side has no figure or ``b`` is 0."""
    if a is None or b is None or not b or not (math.isfinite(a) and math.isfinite(b)):
        return math.nan
    return a / b


def _clean(obj: Any) -> Any:
    """NaN/inf -> None, recursively, so the JSON is strict."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=2, allow_nan=False) + "\n")
    tmp.replace(p)


def interactive() -> bool:
    return sys.stderr.isatty()


def short(text: str, limit: int = 160) -> str:
    """``text`` on one line, cut to ``limit`` characters with "..." (a failure message in a table)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, digits: int = 2) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(fmt(v, digits) for v in row))
    console = Console()
    if not console.is_terminal:  # a file or a pipe: as wide as the table, no cell cut
        wide = console.options.update_width(1 << 16)
        console = Console(width=max(160, table.__rich_measure__(console, wide).maximum))
    console.print(table)
