"""The ``pdserve`` command, the top of the import graph: the only package that imports bench (and planner) code,
and only inside the subcommand that runs it, so ``pdserve --help`` and ``pdserve status`` start without torch."""
