"""Load test for any OpenAI-compatible server: ``pdserve bench serve`` and ``pdserve bench compare``.

A run, module by module (``cli`` glues them; ``options`` declares the options):
1. ``workloads`` / ``conversations``: the requests or multi-turn chats, each prompt built to an exact token count;
   a trace (``replay``): its rows read and fitted (``traces``), their prompts sharing what the rows share
   (``trace_prompts``);
2. ``shapes`` / ``multiturn``: send them on a schedule (open or closed loop, or a trace's fixed times), warm-up
   first, until the bound;
3. ``client``: one streamed request, timed at the client (``sse`` parses the stream);
4. ``metrics``: a run's summary and a sweep's best rate (``replay``: a trace's rows, lag, hit rates and series);
   ``output``: the results folder and the table; ``plots``: its figures.
It needs nothing of pdserve's server; ``docs/loadtest.md`` says how to run it and how each figure is computed.
"""
