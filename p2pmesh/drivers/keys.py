"""The cluster key: 32 random bytes every Mac of a cluster shares (see drivers/tls.py).

Shown to people as 13 groups of 4 base32 characters plus a check group, e.g.
``K7Q2-...-X4RM``: easy to read aloud, type or paste, and a typo is caught by the check
group instead of silently making a different cluster.
"""
from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

KEY_BYTES = 32
KEY_FILE = "cluster.key"


class KeyError_(ValueError):
    """The text given is not a p2pmesh cluster key (the user's input is at fault)."""


def format_key(key: bytes) -> str:
    check = hashlib.sha256(b"p2pmesh-key" + key).digest()[:3]
    text = base64.b32encode(key + check).decode().rstrip("=")
    return "-".join(text[i : i + 4] for i in range(0, len(text), 4))


def parse_key(text: str) -> bytes:
    compact = "".join(ch for ch in text.strip().upper() if ch not in "- \t\n")
    if len(compact) != 56:
        raise KeyError_(f"a cluster key has 56 letters and digits (in groups of 4); got {len(compact)}")
    try:
        raw = base64.b32decode(compact + "=" * (-len(compact) % 8))
    except ValueError:
        raise KeyError_("a cluster key uses only the letters A-Z and digits 2-7") from None
    key, check = raw[:KEY_BYTES], raw[KEY_BYTES:]
    if hashlib.sha256(b"p2pmesh-key" + key).digest()[:3] != check:
        raise KeyError_("the cluster key has a typo (its check group does not match); copy it again with `p2pmesh key show`")
    return key


def write_key(path: Path, key: bytes) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the state directory: the owner's only
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(format_key(key) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_key(path: Path) -> bytes:
    try:
        return parse_key(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise KeyError_(f"{path}: not a cluster key (the file is not text)") from None
    except KeyError_ as exc:
        raise KeyError_(f"{path}: {exc}") from None


def load_or_create(state_dir: Path, key_file: Path | None) -> bytes:
    """The key from --cluster-key-file, else the state directory's, else a new one."""
    if key_file is not None:
        return read_key(key_file)
    path = state_dir / KEY_FILE
    if path.exists():
        return read_key(path)
    key = os.urandom(KEY_BYTES)
    write_key(path, key)
    return key
