"""The secret that the TCP handshakes between hosts prove (csrc/transport/tcp/tcp_auth.h).

By default each job makes its own: rank 0 puts 32 random bytes in the
bootstrap store, every rank reads them, and the last to read deletes them
(pycollectives.rendezvous). Whoever reads the store while they are there, or writes it
during set-up, could join the job; PYCOLL_AUTH_KEY (or PYCOLL_AUTH_KEY_FILE)
gives every rank a secret that never enters the store instead, e.g. one a
cluster scheduler hands every rank of the job. See docs/api.md, "Security"."""

from __future__ import annotations

import os
import stat

ENV_KEY = "PYCOLL_AUTH_KEY"
ENV_FILE = "PYCOLL_AUTH_KEY_FILE"
MIN_BYTES = 16  # 128 bits
STORE_BYTES = 32  # the material a job makes for itself


def _parse(text: str, source: str, where: str) -> bytes:
    """The secret `text` (hex, at least MIN_BYTES bytes) names; raises
    ValueError naming `source` (never the secret)."""
    text = text.strip()
    if not text:
        raise ValueError(f"{where}{source} is empty")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(
            f"{where}{source} is not hexadecimal (make one with "
            "`openssl rand -hex 32` or `python -c 'import secrets; print(secrets.token_hex(32))'`)"
        ) from None
    if len(secret) < MIN_BYTES:
        raise ValueError(
            f"{where}{source} holds {len(secret)} bytes; at least {MIN_BYTES} "
            f"({2 * MIN_BYTES} hexadecimal digits) are needed"
        )
    return secret


def _read_file(path: str, where: str) -> bytes:
    """The secret in file `path`: a regular file of this user (or root) that
    no one else may read or write (mode 0600 or stricter), as ssh requires of
    its keys. Raises ValueError naming the file and PYCOLL_AUTH_KEY_FILE."""
    what = f"{ENV_FILE}={path!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(f"{where}{what} cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}{what} is not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(
                f"{where}{what} has mode {stat.S_IMODE(st.st_mode):o}: other users "
                "may read or write it; refusing it (chmod 600 it)"
            )
        if st.st_uid not in (os.geteuid(), 0):
            raise ValueError(
                f"{where}{what} belongs to uid {st.st_uid}, not to this process's "
                f"uid {os.geteuid()} (or root); refusing it"
            )
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    if len(data) > 4096:
        raise ValueError(f"{where}{what} is larger than 4 KiB: not a key file")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{where}{what} is not hexadecimal text") from None
    return _parse(text, what, where)


def job_secret(rank: int | None = None) -> bytes | None:
    """The secret from PYCOLL_AUTH_KEY (hexadecimal, at least 16 bytes) or
    from the file PYCOLL_AUTH_KEY_FILE names (the same text), or None when
    neither is set (the job then makes its own through the store). Raises
    ValueError naming the variable (and the file) for an empty, malformed,
    short or exposed secret, or for both variables set (and `rank`, if given)."""
    where = "pycollectives: " + (f"rank {rank}: " if rank is not None else "") + "init: "
    key, path = os.environ.get(ENV_KEY), os.environ.get(ENV_FILE)
    if key is not None and path is not None:
        raise ValueError(f"{where}both {ENV_KEY} and {ENV_FILE} are set: set one")
    if key is not None:
        return _parse(key, ENV_KEY, where)
    if path is not None:
        if not path:
            raise ValueError(f"{where}{ENV_FILE} is empty")
        return _read_file(path, where)
    return None
