"""The segment store: the default L3 file backend (``"file"``), page records appended to
segment files that several processes share on one root."""

from __future__ import annotations

from kvtier.storage.segments.store import RecordSpan, SegmentBackend, SegmentBackendConfig

__all__ = ["RecordSpan", "SegmentBackend", "SegmentBackendConfig"]
