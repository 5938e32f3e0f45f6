"""The plugin end to end, as a user gets it: a fresh interpreter loads vLLM's general
plugins (as ``LLM`` does), vLLM spawns an engine-core process, that process logs that
kvpool is active, and the reorder works from ``LLM`` down to its pools.

Nothing here installs kvpool by hand, and the test imports kvpool from wherever the
interpreter finds it (the checkout when editable, site-packages when installed from
a wheel; ``scripts/test-python.sh`` runs this file against the built wheel)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from kvpool.cpu_platform import cpu_environment
from tests.support.paths import REPO

SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r})
from vllm.plugins import load_general_plugins
load_general_plugins()  # what LLM / the engine args do in the front-end process
from tests.support.scripted_engine import make_engine_core_client
from tests.integration import test_engine_api as t

client = make_engine_core_client(multiprocess_mode=True)
try:
    llm = t._llm_over(client)
    t.client_scramble(client)
    scrambled = t.client_probe(client)
    reordered = llm.reset_free_block_queue_order()
    after = t.client_probe(client)
    t.client_scramble(client)
    reset = llm.reset_prefix_cache(reorder_free_queue=True)
    after_reset = t.client_probe(client)
    print("RESULT", os.getpid(), scrambled, reordered, after, reset, after_reset, flush=True)
finally:
    client.shutdown()
"""


@pytest.mark.slow  # starts an engine-core process
def test_engine_core_started_by_vllm_runs_kvpool_and_llm_reorders_it():
    unset = ("KVPOOL_DISABLE", "VLLM_PLUGINS", "KVPOOL_REORDER_ON_RESET")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(VLLM_WORKER_MULTIPROC_METHOD="spawn")
    cpu_environment(env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT.format(repo=str(REPO)))],
        capture_output=True, text=True, env=env, timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    result = re.search(r"RESULT (\d+) (\[.*?\]) (\w+) (\[.*?\]) (\w+) (\[.*?\])", out)
    assert result, out[-6000:]
    client_pid = int(result.group(1))
    line = r"kvpool \S+ active: native block pool patched into vLLM \S+ \(.*?\bpid (\d+)"
    active = [int(pid) for pid in re.findall(line, out)]
    assert any(pid != client_pid for pid in active), f"no engine-core process logged kvpool active:\n{out[-6000:]}"
    assert result.group(2) != "[1, 2, 3, 4]"  # the scramble took effect
    assert result.group(3) == "True" and result.group(4) == "[1, 2, 3, 4]"
    assert result.group(5) == "True" and result.group(6) == "[1, 2, 3, 4]"
