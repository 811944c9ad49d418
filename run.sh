#!/usr/bin/env bash
# The two README commands, and a few more. Each first runs scripts/setup.sh (venv, jars).
#   ./run.sh demo          local broker + embedded Flink job + sample predictions; Ctrl-C stops all
#   ./run.sh test [ARGS]   the test suite (pytest ARGS)
#   ./run.sh bench [ARGS]  the end-to-end benchmark (cluster-serving bench --help)
set -euo pipefail
cd "$(dirname "$0")"
command=${1:-demo}
if [ "$command" = test ]; then bash scripts/setup.sh --peers; else bash scripts/setup.sh; fi
# The venv first on PATH: Flink's thread mode embeds the first python it finds, and `flink` is there.
export PATH="$PWD/.venv/bin:$PATH"
shift || true
case "$command" in
  demo) exec cluster-serving demo "$@" ;;
  test) exec python -m pytest "$@" ;;
  bench) exec cluster-serving bench "$@" ;;
  *) echo "usage: ./run.sh demo | test [pytest args] | bench [args]" >&2; exit 2 ;;
esac
