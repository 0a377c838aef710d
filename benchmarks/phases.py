"""Print a ``serve_timeline.py`` JSON's levels: the scalar fields, each request phase's p50 / p90 / p99 seconds,
the engine thread's step parts and its slowest steps outside decode windows.

    python benchmarks/phases.py tl.json [more.json ...]
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    for path in sys.argv[1:]:
        with open(path) as f:
            rows = json.load(f)
        for row in rows:
            scalars = {k: v for k, v in row.items() if not isinstance(v, (dict, list))}
            print(os.path.basename(path), json.dumps(scalars))
            for name, v in row.get("request_phases", {}).items():
                print(f"    {name}: {v['p50_s']} / {v['p90_s']} / {v['p99_s']}")
            for wave, parts in row.get("http_phases", {}).items():
                print(f"    {wave} requests (ms p50 / p90 / p99, n):")
                for name, v in parts.items():
                    print(f"        {name}: {v}")
            print("    step parts", row.get("step_parts_s"))
            print("    slowest other steps", row.get("slowest_other_steps (s, window, outputs, waiting, running, "
                                                       "prompt tokens)"))


if __name__ == "__main__":
    main()
