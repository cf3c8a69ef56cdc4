"""Load test for any OpenAI-compatible server: ``pdserve bench serve`` and ``pdserve bench compare``.

How a run flows, module by module:

- ``workloads``: builds the request list (prompt text built to an exact token count with the model's tokenizer,
  and a forced output length) from synthetic lengths, a JSONL file, a ShareGPT file or shared-prefix groups.
- ``shapes``: sends those requests on a schedule (open-loop Poisson/gamma arrivals with optional ramp-up, or a
  closed loop at a concurrency), with warm-up first, and stops at the count or duration bound, cancelling whatever
  is still outstanding.
- ``conversations`` and ``multiturn`` (``--dataset-name multi-turn``): conversations whose every turn sends the whole
  history with the server's own answers, with think times between turns; played instead of single requests under
  the same load options (rate and concurrency bound apply to conversations) and summarized by turn.
- ``client``: one streamed request, timed at the client with ``time.perf_counter``; ``sse`` parses the stream.
- ``metrics``: per-request figures to a run summary (percentiles, throughput, goodput, SLO attainment, server-side
  stage timings) and a sweep's highest rate that meets the SLOs.
- ``output``: the results folder (per-request JSONL, summary JSON, CSV, PNG plots) and the printed table.
- ``options``: the command-line options, declared with argparse alone (``pdserve bench serve --help`` imports nothing
  heavy); ``cli`` (``pdserve bench serve``) glues the rest together.

It imports nothing of pdserve's server, so it can load-test any OpenAI-compatible endpoint; ``bench/compare_modes.py``
(``pdserve bench compare``) runs it against pdserve's cluster in both modes.

``docs/loadtest.md`` says how to run it and how each figure is computed.
"""
