#!/usr/bin/env bash
# launch-prefill.sh: EPD_PREFILL_TP prefill ranks on this node (prefill node EPD_PREFILL_NODE).
# Settings, ssh and SLURM usage: see launch.sh's header.
exec "$(dirname "${BASH_SOURCE[0]}")/launch.sh" prefill "$@"
