"""Command line: ``python -m kvpool {replay,locality,conformance,porting,info}``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m kvpool",
        description="kvpool: native KV block pool for vLLM.",
    )
    parser.add_argument(
        "command",
        choices=["replay", "locality", "conformance", "porting", "info"],
        help="replay: workload through vLLM's scheduler, vanilla vs kvpool; "
        "locality: paged attention time per block-table layout (needs torch, not vLLM); "
        "conformance: vLLM's own tests with and without kvpool; "
        "porting: what kvpool meets in a vLLM release (what binds, the self-check, source diffs); "
        "info: versions, install state and the effective KVPOOL_* settings. "
        "`python -m kvpool COMMAND --help` for a command's options",
    )
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "replay":
        from kvpool.tools.replay.cli import main as replay_main

        return replay_main(rest)
    if command == "locality":
        from kvpool.tools.locality.cli import main as locality_main

        return locality_main(rest)
    if command == "conformance":
        from kvpool.tools.conformance.cli import main as conformance_main

        return conformance_main(rest)
    if command == "porting":
        from kvpool.tools.conformance.porting import main as porting_main

        return porting_main(rest)
    if command == "info":
        from kvpool.info import main as info_main

        return info_main(rest)
    parser.error(f"unknown command {command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
