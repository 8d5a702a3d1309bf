"""``python -m hotcompile.debug DIR``: summarise a HOT dump directory (or one report.json).

Why a CLI: a dump is usually read on another machine than the one that ran the job; this
reads only the files (see summary.py) and prints what was rewritten, what stayed exact
and why, the saved bytes, the cost model and the LQS choices.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .summary import load_dump, render_markdown, render_text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hotcompile.debug",
                                 description="Summarise a HOT dump directory (HOT_DUMP=DIR).")
    ap.add_argument("path", help="the dump directory, or a report.json")
    ap.add_argument("--format", choices=("text", "md", "json"), default="text")
    args = ap.parse_args(argv)
    if not os.path.exists(args.path):
        print(f"{args.path}: no such file or directory", file=sys.stderr)
        return 2
    data = load_dump(args.path)
    if args.format == "json":
        print(json.dumps(data, indent=1, default=str))
    else:
        print(render_markdown(data) if args.format == "md" else render_text(data))
    return 0 if data["graphs"] else 1


if __name__ == "__main__":
    sys.exit(main())
