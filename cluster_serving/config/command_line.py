"""The command line every entry point shares (`cluster-serving`, and the job and the bridge run
alone): a usage mistake is one `error:` line, like every other mistake a user can make."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """A usage mistake is one `error:` line that says where the help is, like every other mistake,
    instead of argparse's usage block and a second, prog-prefixed line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def config_parser(prog: str, description: str) -> OneLineParser:
    """A parser with the --config option of a process that serves one config."""
    parser = OneLineParser(prog=prog, description=description)
    parser.add_argument("--config", "-c", help="config file (default: cluster_serving/config/config.yaml)")
    return parser
