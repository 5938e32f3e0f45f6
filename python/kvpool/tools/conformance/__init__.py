"""Conformance runner: vLLM's own tests, vanilla and with kvpool installed.

``python -m kvpool conformance`` fetches the sdist of the installed vLLM from the
package index (cached, sha256-verified), extracts its ``tests/`` tree into a scratch
directory, runs the chosen test folders twice in fresh pytest subprocesses (once on
vLLM's own block pool, once with ``kvpool.install()`` called before any test module
imports vLLM) and compares the outcomes test by test. A test that passes vanilla but
not with kvpool is a regression.

Modules:
    sdist            -- find, download, cache, verify and extract the vLLM sdist.
    suites           -- the test folders run and the exclusions (data, with reasons).
    workdir          -- lays out the scratch directory (tests, conftest override, HF cache).
    outcomes_plugin  -- pytest plugin (``-p``) writing per-test outcomes as JSON.
    pytest_install   -- pytest plugin (``-p``) whose import calls ``kvpool.install()``.
    report           -- pure comparison and report logic.
    cli              -- argument parsing and orchestration.
    matrix           -- one environment per vLLM release (``--vllm-version`` / ``--all``).
    porting          -- ``python -m kvpool porting``: what binds in a release, the self-check.
    porting_sources  -- the wheels' sources read with ``ast``, and their diffs.
"""
