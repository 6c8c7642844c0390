"""Output locations checked before any work: a command that cannot write its results refuses to start.

A check creates what it must to find out (missing folders, one empty probe
file) and removes it again, so a refused command leaves nothing behind.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from fedray.core.errors import FedrayError


def check_folder(folder: Path, option: str = "--out") -> None:
    """Refuse ``folder`` unless it is (or can be made) a folder in which files can be created."""
    _check_folder(Path(folder).absolute(), option, Path(folder))


def check_file(path: Path, option: str = "--out") -> None:
    """Refuse ``path`` unless a file can be written there: not a folder, in a folder where files can be created."""
    path = Path(path)
    if _nearest_existing(path.absolute(), option, path) == path.absolute() and path.is_dir():
        raise FedrayError(f"{option} {path}: is a folder; name the file to write, e.g. {path / 'federation.parquet'}")
    _check_folder(path.absolute().parent, option, path)


def _check_folder(folder: Path, option: str, named: Path) -> None:
    """``folder`` (absolute), for ``option`` ``named``: the errors name ``named`` and, when it is another one, the folder."""
    named_itself = folder == named.absolute()
    existing = _nearest_existing(folder, option, named)
    if not existing.is_dir():
        what = "" if existing == named.absolute() else f"{existing} "
        raise FedrayError(f"{option} {named}: {what}is a file, not a folder")
    missing = [parent for parent in (folder, *folder.parents) if existing in parent.parents]  # deepest first
    try:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            where = "" if named_itself else f" {folder}"
            raise FedrayError(f"{option} {named}: cannot create the folder{where} ({error.strerror})") from None
        probe = folder / f".fedray-probe.{secrets.token_hex(4)}.tmp"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except OSError as error:
            where = "it" if named_itself else folder
            raise FedrayError(f"{option} {named}: cannot create files in {where} ({error.strerror})") from None
        probe.unlink()
    finally:
        for created in missing:
            try:
                created.rmdir()
            except OSError:
                break


def _nearest_existing(path: Path, option: str, named: Path) -> Path:
    """``path`` (absolute) or its nearest parent that exists."""
    try:
        return next(parent for parent in (path, *path.parents) if parent.exists())
    except OSError as error:  # a parent that may not be searched: whether the rest exists cannot be told
        raise FedrayError(f"{option} {named}: cannot reach it ({error.strerror})") from None
