"""``kvprefetch gateway``: the OpenAI-compatible gateway in front of the nodes' vLLM servers
(:mod:`kvprefetch.controlplane.live.gateway`), in the foreground.

The scheduler's API token comes from the ``KVPREFETCH_API_TOKEN`` environment variable or
``--token-file PATH`` (a file only its owner may read: mode 0600 or 0400), never from the
command line, which every user of the machine sees in ``ps``.
"""

from __future__ import annotations

import argparse

EPILOG = """examples:
  KVPREFETCH_API_TOKEN=... kvprefetch gateway --scheduler http://head:8000 \\
      --upstream http://node0:8000 --upstream http://node1:8000 --config serve.yaml
  kvprefetch gateway --token-file /run/secrets/kvprefetch-token --scheduler http://head:8000 \\
      --upstream http://node0:8000 --host 0.0.0.0 --port 8080
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvprefetch.controlplane.live.gateway_options import add_arguments as gateway_arguments

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.allow_abbrev = False  # --token must not pass for --token-file
    p.epilog = EPILOG
    gateway_arguments(p)


def run(args: argparse.Namespace) -> int:
    from kvprefetch.controlplane.live.gateway import run as run_gateway

    return run_gateway(args)
