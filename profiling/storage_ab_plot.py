"""Plot what ``storage_ab.sh`` measured: the segment store's % of raw per cell, old against new,
round by round (the ``old_N.txt`` / ``new_N.txt`` tables it writes).

    python3 -m profiling.storage_ab_plot DIR [DIR ...] --out results/x.png [--title T]

Each DIR is one ``storage_ab.sh`` output folder (one panel), or a folder of other tables (say
``gpu_host_storage.sh``'s ``pinned.txt``, ``all_cpus.txt``...: one series each); fsync rows, and
cold reads unless ``--cold``, are left out.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_ROW = re.compile(r"^\| ext4 \| (\d+) KiB \| ([^|]+?) \| [^|]+ \| [^|]+ \| (\d+)% \|")


def cells(path: Path, cold: bool) -> dict[str, int]:
    """``"64 KiB put" -> %`` of one table."""
    out = {}
    for line in path.read_text().splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        page, op, pct = m.groups()
        if "fsync" in op or ("cold" in op and not cold):
            continue
        out[f"{page} KiB {op}"] = int(pct)
    return out


def rounds(folder: Path, cold: bool) -> list[tuple[str, dict[str, int]]]:
    """(label, cells) per table in ``folder``, in the order run: old 1, new 1, old 2, ...; a
    folder of other tables (``gpu_host_storage.sh``'s) gives one series per table, by name."""
    found = []
    for p in folder.glob("*_*.txt"):
        m = re.fullmatch(r"(old|new)_(\d+)\.txt", p.name)
        if m:
            found.append((int(m.group(2)), m.group(1) != "old", p))
    if not found:
        tables = [(p.stem, cells(p, cold)) for p in sorted(folder.glob("*.txt"))]
        return [(name, c) for name, c in tables if c]
    return [(f"{'new' if n else 'old'} {r}", cells(p, cold)) for r, n, p in sorted(found)]


def _paired(label: str) -> bool:
    return label.startswith(("old ", "new "))


def _colour(label: str, i: int) -> str:
    if _paired(label):
        return "tab:blue" if label.startswith("new") else "tab:gray"
    return f"C{i}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="segment store, old against new (% of raw)")
    ap.add_argument("--cold", action="store_true", help="also the cold-read rows")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(args.dirs), 1, figsize=(11, 3.6 * len(args.dirs)), squeeze=False)
    for ax, folder in zip(axes[:, 0], args.dirs):
        runs = rounds(folder, args.cold)
        names = list(dict.fromkeys(k for _, c in runs for k in c))
        width = 0.8 / max(1, len(runs))
        for i, (label, c) in enumerate(runs):
            xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(names))]
            ax.bar(
                xs,
                [c.get(n, 0) for n in names],
                width,
                label=label,
                color=_colour(label, i),
                alpha=0.55 + 0.45 * (i // 2) / max(1, (len(runs) - 1) // 2)
                if _paired(label)
                else 1,
            )
        for target in (80, 90):
            ax.axhline(target, color="tab:red", lw=0.8, ls="--")
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("% of raw")
        ax.set_title(folder.name, fontsize=9)
        ax.legend(fontsize=7, ncol=len(runs))
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
