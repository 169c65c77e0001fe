"""Communicators that autograd drives.

On CUDA tensors autograd runs the backward pass on its own device thread, not
on the thread that called `backward()`: a strategy's gradient collectives
(DDP's bucket all-reduces, ZeRO/FSDP's reduce-scatters and prefetched
all-gathers, tensor parallelism's backward collectives) are issued from there.
By default a pycollectives communicator refuses a second issuing thread (two
threads issuing at once would pair different calls across ranks); here the
calls are serialized by autograd itself, the calling thread waiting in
`backward()` while the device thread issues, so every communicator a strategy
uses lets any thread issue.
"""

from __future__ import annotations

from pycollectives import Communicator


def autograd_comm(comm: Communicator) -> Communicator:
    """Returns `comm`, set to accept operations issued from autograd's threads."""
    comm._issue_from_any_thread()
    return comm
