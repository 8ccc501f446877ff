"""What every ``kvprefetch bench`` sub-command does around its benchmark: a progress bar
over its steps, typed errors as one line on stderr, the table, the atomic JSON."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

Step = Callable[[str], None]


def run_bench(name: str, total_steps: int, work: Callable[[Step], dict[str, Any]],
              table: Callable[[dict[str, Any]], str], *, json_out: str | None,
              progress: bool) -> dict[str, Any] | None:
    """Run ``work(on_step)``; print ``table(result)``; write ``json_out``. Returns the
    result, or None after printing why it could not run."""
    from kvprefetch.controlplane.base.atomic import write_json_atomic
    from kvprefetch.controlplane.base.errors import KvPrefetchError

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, desc=name, unit="step", file=sys.stderr)

    def on_step(label: str) -> None:
        if bar is not None:
            bar.set_postfix_str(label)
            bar.update(1)

    try:
        result = work(on_step)
    except KvPrefetchError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return None
    finally:
        if bar is not None:
            bar.close()
    print(table(result))
    if json_out:
        write_json_atomic(json_out, result, sort_keys=False)
    return result
