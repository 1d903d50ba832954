"""Writes csrc/include/step_scalars.h from multi_tensor/rules.py (multi_tensor.rules.header_text).

    python tools/step_scalars_header.py          # rewrite the header
    python tools/step_scalars_header.py --check  # exit 1 when the committed header is stale

Run it after changing :class:`multi_tensor.rules.StepScalars`, then rebuild the extension
(``python setup.py build_ext --inplace``).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "csrc", "include", "step_scalars.h")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed header instead of writing it")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from multi_tensor import rules

    text = rules.header_text()
    if args.check:
        with open(HEADER) as f:
            if f.read() != text:
                print(f"{HEADER} is stale: run python tools/step_scalars_header.py", file=sys.stderr)
                return 1
        return 0
    with open(HEADER, "w") as f:
        f.write(text)
    print(f"wrote {HEADER}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
