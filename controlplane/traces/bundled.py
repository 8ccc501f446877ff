"""The small slice of real traces shipped inside the package (see ``data/traces/ATTRIBUTION.md``).

It lets the demo and the tests run without the full trace folder.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvprefetch.controlplane.base.errors import KvPrefetchError

#: Bundled traces by name -> path inside ``controlplane/data/traces``.
BUNDLED_TRACES: dict[str, str] = {
    "claude-code": "claude-code",
    "mooncake": "mooncake/synthetic_trace_head.jsonl",
    "azure-conv": "azure2023/AzureLLMInferenceTrace_conv_head.csv",
    "azure-code": "azure2023/AzureLLMInferenceTrace_code_head.csv",
}


def bundled_trace_path(name: str = "claude-code") -> Path:
    """Path of a bundled trace: ``claude-code`` (a directory), ``mooncake``, ``azure-conv``
    or ``azure-code``. The package is installed as plain files, so the path is real."""
    try:
        relative = BUNDLED_TRACES[name]
    except KeyError:
        raise KvPrefetchError(
            f"no bundled trace {name!r}; bundled: {', '.join(BUNDLED_TRACES)}"
        ) from None
    root = resources.files("kvprefetch.controlplane") / "data" / "traces"
    return Path(str(root.joinpath(*relative.split("/"))))
