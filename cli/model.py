"""``pdserve model ...``: model utilities (imported only when such a subcommand runs: they need torch)."""

from __future__ import annotations

import argparse

from engine.tiny_model import build_tiny_model


def tiny(args: argparse.Namespace) -> int:
    path = build_tiny_model(args.out, arch=args.arch, seed=args.seed)
    print(f"tiny {args.arch} model written to {path}")
    return 0
