"""kvpool's tools, apart from the runtime: ``python -m kvpool replay | conformance | porting |
locality`` and their helpers and data (model configs for an offline Hugging Face cache).

A GPU host needs none of this: the runtime is everything in ``kvpool`` outside this package
(docs/design.md, "Runtime and tools"). The tools reach the runtime only through its public
API: ``kvpool``'s own names, :mod:`kvpool.errors`, :mod:`kvpool.envs`,
:mod:`kvpool.vllm_compat`, :mod:`kvpool.cpu_platform` and :mod:`kvpool.introspect`; the
runtime never imports the tools (``tests/repo/test_import_graph.py`` enforces both).
"""
