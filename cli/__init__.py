"""The ``pdserve`` command, top of the import graph: it imports bench and planner code only inside the subcommand
that runs it, so ``pdserve --help`` and ``pdserve status`` start without torch."""
