"""A cold compiled decode step compiled in another process, so that an engine's start never waits for it.

An engine whose step is not yet on disk (engine/compile_cache.py) starts on the eager path and runs
``python -m engine.background_compile '<EngineConfig as JSON>'`` (started by ``engine.decode_graphs``, which names this
module rather than importing it: this one builds an engine): the same engine built again there, at the lowest
CPU priority (it takes what serving leaves), compiles every batch bucket into the same entry (the same config gives
the same key) and exits. It is detached (engine/detached.py): neither Ray, which ends a worker's children with it, nor
a Ctrl-C stops it. The serving engine polls the process between steps and, once it has exited, loads the
entry (``DecodeGraphs.poll_background``). The child finishes even if its parent stops first (the compile is paid
once per machine: the next start loads it); an engine that starts while another process holds the entry serves
eagerly and waits for it in a child of its own, never in its start.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from engine.config import EngineConfig
from engine.detached import report_exit

logger = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    os.nice(19)  # what serving leaves
    logging.basicConfig(level=logging.INFO, format="[background compile %(process)d] %(name)s %(message)s")
    for noisy in ("httpx", "torch", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from engine import decode_graphs
    from engine.engine_parts import build_engine_parts

    decode_graphs.KEEP_ONLY = True
    config = EngineConfig(**json.loads(argv[0]))
    parts = build_engine_parts(config)
    graphs = getattr(parts.runner, "decode_graphs", None)
    done = graphs is not None and not getattr(graphs, "_broken", True)
    logger.info("the decode step is %s", "compiled and kept" if done else "not compiled (see above)")
    return 0 if done else 1


if __name__ == "__main__":
    status = main(sys.argv[1:])
    report_exit(status)
    sys.exit(status)
