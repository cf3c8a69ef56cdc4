"""Helpers shared by test files: plain functions and classes, imported as ``from tests.helpers.<area> import ...``.

Why not conftest.py: a conftest module is pytest's, loaded by path for its fixtures; importing it from a test file
loads it a second time under another name, and a ``sys.path`` edit to reach a sibling file makes test modules
shadow each other. So conftest files hold fixtures only and take their helpers from here.

- ``cluster``: a tiny cluster config, waiting for every KV block to be free, a ``/metrics`` sample, polling;
- ``engine``: random prompts, transformers' greedy ``generate`` as the reference;
- ``kv``: deterministic KV payloads and a dict-backed destination cache for the transfer tests;
- ``transfer_peers``: sender and receiver processes for two-process transfer tests (spawned, so importable alone).
"""
