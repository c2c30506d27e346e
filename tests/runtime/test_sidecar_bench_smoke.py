"""Smoke test of ``profiling/bench_sidecar.py`` on tiny shapes: it runs, and every row it
reports moved bytes at a positive rate against a positive ceiling (the numbers mean nothing on a
CPU; the benchmark itself runs on a GPU)."""

from __future__ import annotations

import torch

from profiling.bench_sidecar import SIDECARS, markdown, rows_for


def test_bench_sidecar_quick_rows():
    name, ratio, entry = SIDECARS[0]
    rows = rows_for(
        name,
        ratio,
        entry,
        layers=2,
        page=16,
        pool_pages=4,
        moved=(2,),
        layouts=("page_first",),
        device=torch.device("cpu"),
        rounds=2,
    )
    assert [r["what"] for r in rows] == [
        "d2h one layer",
        "d2h all layers",
        "h2d one layer",
        "h2d all layers",
    ]
    page_bytes = 16 // ratio * entry
    for r in rows:
        layers = 2 if "all" in r["what"] else 1
        assert r["mib"] * 2**20 == 2 * page_bytes * layers, r
        assert r["gbs"] > 0 and r["ceiling"] > 0 and r["programs"] == 4, r
        assert len(r["pct_rounds"]) == 2 and r["pct_rounds"] == sorted(r["pct_rounds"]), r
    assert markdown(
        {
            "gpu": None,
            "sms": None,
            "cpu": "x",
            "torch": "t",
            "triton": "t",
            "cuda": None,
            "python": "p",
            "date": "d",
            "command": "c",
        },
        rows,
    ).count("| c4 |") == len(rows)
