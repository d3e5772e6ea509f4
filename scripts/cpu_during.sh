#!/usr/bin/env bash
# Runs a command and says how busy the whole machine's CPUs were meanwhile (from /proc/stat): wall seconds, busy
# CPU-seconds, idle CPU-seconds. For comparing ways to run the suite on a small machine (docs/testing.md).
# usage: scripts/cpu_during.sh COMMAND [ARGS...]
read -r _ user nice system idle iowait irq softirq _ < /proc/stat
start=$(date +%s.%N) busy_before=$((user + nice + system + irq + softirq)) idle_before=$((idle + iowait))
"$@"
status=$?
read -r _ user nice system idle iowait irq softirq _ < /proc/stat
end=$(date +%s.%N) busy_after=$((user + nice + system + irq + softirq)) idle_after=$((idle + iowait))
ticks=$(getconf CLK_TCK)
python3 -c "print(f'rc=$status wall={$end - $start:.0f}s busy_cpu={($busy_after - $busy_before) / $ticks:.0f}s idle_cpu={($idle_after - $idle_before) / $ticks:.0f}s')"
exit $status
