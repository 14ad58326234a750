#!/usr/bin/env bash
# launch-encode.sh: the bootstrap server and EPD_ENCODE_TP encode ranks on this node.
# Settings, ssh and SLURM usage: see launch.sh's header.
exec "$(dirname "${BASH_SOURCE[0]}")/launch.sh" encode "$@"
