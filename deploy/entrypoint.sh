#!/bin/sh
# The container's entrypoint: `aserve --config "$ASERVE_CONFIG" ARGS...`.
# A --config among ARGS wins (argparse keeps the last one); an empty
# ASERVE_CONFIG passes none, so aserve serves its embedded default.
# exec: aserve replaces this shell, keeps its PID (1) and gets the signals.
set -eu
if [ -n "${ASERVE_CONFIG:-}" ]; then
  set -- --config "$ASERVE_CONFIG" "$@"
fi
exec aserve "$@"
