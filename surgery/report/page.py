"""``report.html``'s skeleton: one self-contained page (style, script, data and images inline), nothing fetched.

Every string from the run (token text, config values, module names) is data: text goes through
:func:`escape`, the data the script reads sits in one ``<script type="application/json">`` block
with every ``<``, ``>`` and ``&`` written as a ``\\u`` escape (:func:`json_block`), and the page's
Content-Security-Policy allows only its own script and style (by hash), images from ``data:`` and
no network at all: even a string that slipped through could not run or fetch anything.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from surgery.files.gate import read_text

ASSETS = Path(__file__).resolve().parent  # report.js and report.css ship beside this file (package data)
ASSET_MAX = 256 * 1024


def escape(value: Any) -> str:
    """``value`` as HTML text or attribute content: ``& < > " '`` escaped."""
    return html.escape(str(value), quote=True)


def mapping(value: Any) -> Mapping[str, Any]:
    """``value`` if it is a mapping, else an empty one (a report's parts are data: any may be missing or odd)."""
    return value if isinstance(value, Mapping) else {}


def plain(value: Any) -> Any:
    """``value`` with every float JSON cannot hold (NaN, ±inf) as None, tuples as lists, keys as strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def json_block(data: Any, element_id: str = "report-data") -> str:
    """``data`` as a ``<script type="application/json">`` block no string inside can close or comment out."""
    text = json.dumps(plain(data), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f'<script type="application/json" id="{escape(element_id)}">{text}</script>'


def data_uri(data: bytes, mime: str) -> str:
    """``data:`` URI of some bytes (an image inline in the page)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def asset(name: str) -> str:
    """The text of a file shipped in this folder (``report.js``, ``report.css``), read through the gate."""
    return read_text(ASSETS / name, "report.html", ASSET_MAX)


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


Section = tuple[str, str, str]  # (anchor, title, inner HTML already escaped)


def page(title: str, header: str, sections: list[Section], data: Mapping[str, Any]) -> str:
    """The whole page: head (policy, style), the sections (their HTML already escaped), the data block, the script."""
    style, script = asset("report.css"), asset("report.js")
    policy = (f"default-src 'none'; img-src data:; style-src '{_sha256(style)}'; script-src '{_sha256(script)}';"
              " base-uri 'none'; form-action 'none'")  # fmt: skip
    shown = [(anchor, name, inner) for anchor, name, inner in sections if inner]
    nav = " ".join(f'<a href="#{escape(anchor)}">{escape(name)}</a>' for anchor, name, _ in shown)
    body = "\n".join(
        f'<section id="{escape(anchor)}"><h2>{escape(name)}</h2>\n{inner}\n</section>' for anchor, name, inner in shown
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{escape(policy)}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n<style>{style}</style></head>\n"
        f"<body>\n<header>{header}</header>\n<nav>{nav}</nav>\n<main>\n{body}\n</main>\n"
        '<div id="tip" class="tip" role="tooltip" hidden></div>\n'
        f"{json_block(data)}\n<script>{script}</script>\n</body></html>\n"
    )


def table(head: list[str], rows: list[list[Any]], numeric: set[int] | frozenset[int] = frozenset()) -> str:
    """An HTML table; every cell escaped, the columns in ``numeric`` right-aligned."""
    if not rows:
        return ""
    cls = [' class="num"' if i in numeric else "" for i in range(len(head))]
    top = "".join(f"<th{c}>{escape(h)}</th>" for h, c in zip(head, cls))
    body = "".join("<tr>" + "".join(f"<td{c}>{escape(v)}</td>" for v, c in zip(row, cls)) + "</tr>" for row in rows)
    thead = f"<thead><tr>{top}</tr></thead>" if any(head) else ""
    return f"<table>{thead}<tbody>{body}</tbody></table>"


def number(value: Any, missing: str = "–") -> str:
    """A number as the page shows it (4 significant digits, like the script's ``fmt``); other values as text."""
    if value is None:
        return missing
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
