"""Where the CLI finds the gateway that ``gateway serve`` runs on this machine.

``gateway serve`` keeps its embedded server's socket and its secret in a data directory
(``./.gateway`` by default). ``gateway agent``, ``token``, ``publish`` and ``tail`` need
them too, often from another folder (a project of your own next to the gateway's). So a
serving gateway leaves a note of its data directory in the user's state directory
(``$XDG_STATE_HOME/gateway/serving.json``, else ``~/.local/state/...``), and the CLI looks
for a data directory in this order:

1. ``--data-dir`` or ``GATEWAY_DATA_DIR``, when given;
2. ``.gateway`` in the current folder or one of its parents, when a server runs there;
3. the one the note names, when its server still runs.

The note also says whether that gateway runs the demo agent, which would share the inbox
with an agent started beside it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import msgspec

SOCKET = "redis.sock"


class Serving(msgspec.Struct, frozen=True):
    """The note a serving gateway leaves."""

    data_dir: str
    pid: int
    demo_agent: bool = False


def note_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "gateway" / "serving.json"


def leave_note(data_dir: Path, demo_agent: bool) -> None:
    """Tell later CLI commands, from any folder, where this gateway keeps its data."""
    path = note_path()
    with contextlib.suppress(OSError):  # a read-only home: only discovery is lost
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(msgspec.json.encode(Serving(str(data_dir), os.getpid(), demo_agent)))


def remove_note() -> None:
    """Take the note back, if it is still this process's."""
    note = read_note()
    if note is not None and note.pid == os.getpid():
        with contextlib.suppress(OSError):
            note_path().unlink()


def read_note() -> Serving | None:
    try:
        return msgspec.json.decode(note_path().read_bytes(), type=Serving)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def running(data_dir: Path) -> bool:
    """Whether a server listens in ``data_dir`` (its socket exists)."""
    return (data_dir / SOCKET).exists()


def find_data_dir(default: str) -> tuple[Path, Serving | None]:
    """The data directory of the gateway serving on this machine (steps 2 and 3 above),
    else ``default``; and the note when it came from the note."""
    here = Path.cwd()
    for folder in (here, *here.parents):
        if running(folder / default):
            return folder / default, None
    note = read_note()
    if note is not None and running(Path(note.data_dir)):
        return Path(note.data_dir), note
    return Path(default).absolute(), None
