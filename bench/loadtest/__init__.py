"""Load test for any OpenAI-compatible server: ``pdserve bench serve`` and ``pdserve bench compare``.

A run, module by module (``cli`` glues them; ``options`` declares the options):
1. ``workloads`` / ``conversations``: the requests or multi-turn chats, each prompt built to an exact token count;
2. ``shapes`` / ``multiturn``: send them on a schedule (open or closed loop), warm-up first, until the bound;
3. ``client``: one streamed request, timed at the client (``sse`` parses the stream);
4. ``metrics``: a run's summary and a sweep's best rate; ``output``: the results folder and the table.
It needs nothing of pdserve's server; ``docs/loadtest.md`` says how to run it and how each figure is computed.
"""
