"""What a run gives people to read: ``report.md`` and the self-contained ``report.html``.

The application (:mod:`surgery.app`) calls these after writing ``report.json``; they read only the run
directory's own files (through :mod:`surgery.files`) and what the run hands them in memory.
"""

from surgery.report.circuit_md import circuit_markdown
from surgery.report.markdown import render_report_md, write_report_md
from surgery.report.report_html import render_report_html, write_report_html
from surgery.report.study_md import study_markdown

__all__ = [
    "circuit_markdown",
    "render_report_html",
    "render_report_md",
    "study_markdown",
    "write_report_html",
    "write_report_md",
]
