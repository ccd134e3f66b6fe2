#!/bin/sh
# Stands in for ssh when mpiexec starts its daemons on the "hosts" of
# scripts/cluster.sh (--prtemca plm_ssh_agent scripts/netns-agent.sh).
# Called as: netns-agent.sh [ssh options] HOST COMMAND...
# HOST is an address NET.N or a name hN; COMMAND runs in namespace PREFIXhN
# with its own hostname hN (ranks on hosts that share a hostname abort or hang).
prefix=${MPIKV_NETNS_PREFIX:-mpikv_}
net=${MPIKV_NETNS_NET:-10.77.0}
while [ $# -gt 0 ]; do
  case $1 in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;   # ssh options that take a value
    -*) shift ;;
    *) break ;;
  esac
done
if [ $# -lt 2 ]; then
  echo "netns-agent.sh: usage: netns-agent.sh [ssh options] HOST COMMAND..." >&2
  exit 255
fi
host=$1
shift
case $host in
  "$net".[0-9]*) n=${host##*.} ;;
  h[0-9]*) n=${host#h} ;;
  *) echo "netns-agent.sh: $host is not one of the namespace hosts ($net.N or hN)" >&2; exit 255 ;;
esac
exec ip netns exec "${prefix}h$n" unshare --uts sh -c "hostname h$n; $*"
