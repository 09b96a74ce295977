"""Read and check an OpenAI Batch input file before anything is sent.

Each line is `{"custom_id": str, "method": "POST", "url": one of URLS, "body": {...}}`.
Duplicate `custom_id`s refuse the whole file (a result could not be matched to its request);
malformed lines are reported with their line numbers and skipped, or refuse the file in strict
mode. Blank lines are ignored.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import orjson

__all__ = ["URLS", "BatchItem", "InputReport", "read_input"]

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/infer")


@dataclass(frozen=True)
class BatchItem:
    line_no: int  # 1-based line in the input file
    custom_id: str
    url: str  # one of URLS
    body: bytes  # the request body, re-encoded as compact JSON


@dataclass
class InputReport:
    items: list[BatchItem]
    fingerprint: str  # sha256 of the input file's bytes: a resume must see the same file
    malformed: list[tuple[int, str]] = field(default_factory=list)  # (line, what is wrong)
    duplicates: dict[str, list[int]] = field(default_factory=dict)  # custom_id -> lines

    def problems(self, limit: int = 20) -> list[str]:
        """Human-readable lines, duplicates first, at most `limit` of each kind."""
        out: list[str] = []
        for cid, lines in list(self.duplicates.items())[:limit]:
            out.append(f"duplicate custom_id {cid!r} on lines {', '.join(map(str, lines))}")
        if len(self.duplicates) > limit:
            out.append(f"... and {len(self.duplicates) - limit} more duplicated custom_ids")
        for line_no, why in self.malformed[:limit]:
            out.append(f"line {line_no}: {why}")
        if len(self.malformed) > limit:
            out.append(f"... and {len(self.malformed) - limit} more malformed lines")
        return out


def _check_line(line_no: int, raw: bytes) -> BatchItem | str:
    """The item, or a sentence saying what is wrong with the line."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return "'custom_id' is missing or not a non-empty string"
    method = obj.get("method")
    if method != "POST":
        return f"custom_id {cid!r}: 'method' must be \"POST\", got {method!r}"
    url = obj.get("url")
    if url not in URLS:
        return f"custom_id {cid!r}: 'url' must be one of {', '.join(URLS)}; got {url!r}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return f"custom_id {cid!r}: 'body' must be a JSON object"
    return BatchItem(line_no=line_no, custom_id=cid, url=url, body=orjson.dumps(body))


def read_input(path: Path) -> InputReport:
    data = path.read_bytes()
    report = InputReport(items=[], fingerprint=hashlib.sha256(data).hexdigest())
    seen: dict[str, list[int]] = {}
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        checked = _check_line(line_no, raw)
        if isinstance(checked, str):
            report.malformed.append((line_no, checked))
            continue
        seen.setdefault(checked.custom_id, []).append(line_no)
        report.items.append(checked)
    report.duplicates = {cid: lines for cid, lines in seen.items() if len(lines) > 1}
    return report
