#!/usr/bin/env bash
# The former name of scripts/cluster.sh (two hosts by default): every command
# and setting passes through, e.g. `scripts/netns-hosts.sh run [COMMAND...]`.
exec "$(dirname "${BASH_SOURCE[0]}")/cluster.sh" "$@"
