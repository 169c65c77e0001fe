"""The pieces of the TCP transport's authentication that need no second host:
the core's SHA-256 and HMAC-SHA256 against RFC 4231's vectors and Python's
hashlib/hmac; PYCOLL_AUTH_KEY / PYCOLL_AUTH_KEY_FILE refused, naming the
variable (and the file), when empty, malformed, short or readable by others;
and init with a store passed inline (the caller keeps no reference to it),
many times over. The handshakes themselves, attacked: test_multihost_security.py."""

from __future__ import annotations

import hashlib
import hmac
import os
import random

import pytest
from spawn import free_port, run

from pycollectives import _C, auth

# RFC 4231, section 4: (key, data, HMAC-SHA256); case 5's output is truncated to 128 bits.
RFC4231 = [
    (b"\x0b" * 20, b"Hi There",
     "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (b"Jefe", b"what do ya want for nothing?",
     "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
    (b"\xaa" * 20, b"\xdd" * 50,
     "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"),
    (bytes(range(1, 26)), b"\xcd" * 50,
     "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"),
    (b"\x0c" * 20, b"Test With Truncation", "a3b6167473100ee06e0c796c2955552b"),
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
     "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
    (b"\xaa" * 131,
     b"This is a test using a larger than block-size key and a larger than block-size data. "
     b"The key needs to be hashed before being used by the HMAC algorithm.",
     "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(RFC4231)))
def test_hmac_sha256_matches_rfc4231(case):
    key, data, want = RFC4231[case]
    assert _C.hmac_sha256(key, data).hex()[: len(want)] == want


def test_sha256_and_hmac_match_python_at_every_length():
    rng = random.Random(4231)
    for n in [*range(0, 200), 1000, 4095, 4096, 4097, 1 << 20]:  # every padding case, and long
        data = rng.randbytes(n)
        assert _C.sha256(data) == hashlib.sha256(data).digest(), n
        key = rng.randbytes(rng.choice([0, 1, 16, 32, 63, 64, 65, 200]))
        assert _C.hmac_sha256(key, data) == hmac.new(key, data, hashlib.sha256).digest(), n


# ---- PYCOLL_AUTH_KEY / PYCOLL_AUTH_KEY_FILE -------------------------------------------------

GOOD = "0f" * 32


def _secret(monkeypatch, key=None, path=None):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    monkeypatch.delenv(auth.ENV_FILE, raising=False)
    if key is not None:
        monkeypatch.setenv(auth.ENV_KEY, key)
    if path is not None:
        monkeypatch.setenv(auth.ENV_FILE, str(path))
    return auth.job_secret()


def test_auth_key_from_the_environment(monkeypatch):
    assert _secret(monkeypatch) is None
    assert _secret(monkeypatch, key=GOOD) == bytes.fromhex(GOOD)
    assert _secret(monkeypatch, key=f"  {GOOD}\n") == bytes.fromhex(GOOD)
    for bad, words in [
        ("", "is empty"),
        ("   ", "is empty"),
        ("not hex at all, but long enough to pass", "is not hexadecimal"),
        ("0f" * 15, "holds 15 bytes; at least 16"),
        ("0f0", "is not hexadecimal"),
    ]:
        with pytest.raises(ValueError, match="PYCOLL_AUTH_KEY") as e:
            _secret(monkeypatch, key=bad)
        assert words in str(e.value), (bad, str(e.value))
        assert bad.strip() == "" or bad.strip() not in str(e.value)  # the secret is never echoed


def test_auth_key_file_must_be_private(monkeypatch, tmp_path):
    f = tmp_path / "job.key"
    f.write_text(GOOD + "\n")
    f.chmod(0o600)
    assert _secret(monkeypatch, path=f) == bytes.fromhex(GOOD)
    f.chmod(0o400)
    assert _secret(monkeypatch, path=f) == bytes.fromhex(GOOD)
    for mode in (0o640, 0o604, 0o660, 0o644):
        f.chmod(mode)
        with pytest.raises(ValueError, match=f"has mode {mode:o}") as e:
            _secret(monkeypatch, path=f)
        assert str(f) in str(e.value) and "PYCOLL_AUTH_KEY_FILE" in str(e.value)
    f.chmod(0o600)
    link = tmp_path / "link.key"
    link.symlink_to(f)
    with pytest.raises(ValueError, match="cannot be opened"):
        _secret(monkeypatch, path=link)  # O_NOFOLLOW: a link is not followed
    with pytest.raises(ValueError, match="is not a regular file"):
        _secret(monkeypatch, path=tmp_path)
    with pytest.raises(ValueError, match="cannot be opened"):
        _secret(monkeypatch, path=tmp_path / "missing")
    with pytest.raises(ValueError, match="PYCOLL_AUTH_KEY_FILE is empty"):
        _secret(monkeypatch, path="")
    e = tmp_path / "empty.key"
    e.write_text("\n")
    e.chmod(0o600)
    with pytest.raises(ValueError, match="empty.key.* is empty"):
        _secret(monkeypatch, path=e)
    with pytest.raises(ValueError, match="both PYCOLL_AUTH_KEY and PYCOLL_AUTH_KEY_FILE"):
        _secret(monkeypatch, key=GOOD, path=f)


def _init_with_bad_key(rank: int, world_size: int) -> str:
    import pycollectives as pc

    os.environ["PYCOLL_AUTH_KEY"] = "zz" * 32 if rank == 1 else GOOD
    try:
        pc.init(timeout=30).close()
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_malformed_key_on_one_rank_is_named_on_every_rank():
    """Checked on every rank, even on one host; every rank raises the error."""
    for msg in run(_init_with_bad_key, 2, timeout=60):
        assert "PYCOLL_AUTH_KEY is not hexadecimal" in msg and "rank 1" in msg, msg


# ---- a store passed inline --------------------------------------------------------------


def _inline_store_inits(rank: int, world_size: int, ports: list[int]) -> list[float]:
    import datetime

    import torch
    import torch.distributed as dist

    import pycollectives as pc

    sums = []
    for port in ports:  # the store passed inline: no reference to it here
        comm = pc.init(
            rank=rank,
            world_size=world_size,
            store=dist.TCPStore(
                "127.0.0.1", port, world_size, rank == 0, datetime.timedelta(seconds=30)
            ),
            timeout=30,
        )
        x = torch.ones(4)
        comm.all_reduce(x)
        sums.append(float(x[0]))
        comm.close()  # at once: the store's server (rank 0's) goes with it
    return sums


def test_a_store_passed_inline_lives_until_every_rank_is_done():
    """pc.init(store=dist.TCPStore(...)) with no other reference to the store,
    then close() at once, 12 times in a row: rank 0 serves the store, and
    dropping it while rank 1 still had a call to make failed rank 1's init
    ("the bootstrap store failed: Connection reset by peer") in 3 of 8 tries."""
    ports = [free_port() for _ in range(12)]
    for sums in run(_inline_store_inits, 2, ports, timeout=120):
        assert sums == [2.0] * len(ports), sums
