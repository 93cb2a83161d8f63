"""Turning exceptions a user can cause into one-line messages for the command line."""

from __future__ import annotations

from xdsl.utils.exceptions import DiagnosticException, VerifyException


def describe(err: BaseException) -> str:
    """Return a one-message description of `err` (its text, without a traceback)."""
    if isinstance(err, (VerifyException, DiagnosticException)):
        lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
        return "invalid IR: " + (lines[0] if lines else type(err).__name__)
    if isinstance(err, FileNotFoundError):
        return f"{err.filename}: no such file"
    if isinstance(err, OSError):
        return f"{getattr(err, 'filename', '') or ''}: {err.strerror or err}"
    text = str(err).strip()
    return text if text else type(err).__name__
