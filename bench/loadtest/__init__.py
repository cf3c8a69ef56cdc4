"""Load test for any OpenAI-compatible server: ``pdserve bench serve`` and ``pdserve bench compare``.

A run, module by module:
1. ``workloads``: the request list, each prompt built to an exact token count with the model's tokenizer (synthetic
   lengths, a JSONL or ShareGPT file, shared-prefix groups); ``conversations``: multi-turn chats.
2. ``shapes``: sends them on a schedule (open-loop gamma arrivals, or a closed loop at a concurrency), warm-up first,
   until the count or duration bound; ``multiturn`` plays conversations under the same options.
3. ``client``: one streamed request, timed at the client; ``sse`` parses the stream.
4. ``metrics``: a run's summary (percentiles, throughput, goodput, SLO attainment) and a sweep's best rate.
5. ``output``: the results folder and the table; ``options`` declares the options, ``cli`` glues the rest together.
It needs nothing of pdserve's server; ``bench/compare_modes.py`` runs it against pdserve in both modes.
``docs/loadtest.md`` says how to run it and how each figure is computed.
"""
