"""The `credproxy` entry point: the store's CLI plus `credproxy run`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from store import cli


def main(argv: Sequence[str] | None = None) -> int:
    parser, sub, common = cli.build_parser()
    from addon import runner

    runner.add_command(sub, common)
    return cli.run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
