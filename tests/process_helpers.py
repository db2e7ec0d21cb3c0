"""Whether a process still runs, for tests that kill one and wait for it (or its children) to be gone."""

from __future__ import annotations

from pathlib import Path


def process_running(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, waiting for its parent to reap it) has exited."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return fields[0] != "Z"
