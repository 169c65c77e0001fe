"""python -m pycollectives.strategies.checkpoint consolidate DIR OUT [--model-only]: one
safetensors file from a sharded checkpoint (see consolidation.py); in
memory about the largest tensor."""

from __future__ import annotations

import argparse
import sys

from .consolidation import consolidate
from .validate import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pycollectives.strategies.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="one safetensors file from a sharded checkpoint")
    c.add_argument("dir", help="the checkpoint directory (holds index.json)")
    c.add_argument("out", help="the .safetensors file to write")
    c.add_argument("--model-only", action="store_true", help="parameters and buffers only")
    args = parser.parse_args(argv)
    try:
        stats = consolidate(args.dir, args.out, model_only=args.model_only)
    except (OSError, ValueError, CheckpointError) as e:
        print(f"consolidate: {e}", file=sys.stderr)
        return 1
    print(
        f"{args.out}: {stats['tensors']} tensors, {stats['bytes']} bytes "
        f"(largest tensor {stats['largest_tensor_bytes']} bytes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
