"""Colours, sizes and file names shared by the report's pictures and HTML."""

from __future__ import annotations

SHARED_COLOR = "#e8743b"
UNIQUE_COLOR = "#4c78a8"
FAILED_COLOR = "#d62728"
UNFINISHED_COLOR = "#9e9e9e"
BEST_COLOR = "#c0392b"
DPI = 110

PICTURES = ("stage_tree.png", "gantt.png", "curves.png")
