#!/usr/bin/env bash
# Exit 0 once a Docker daemon answers: the one running, else dockerd started here in the background (Debian's
# docker.io installed first when root and missing; log /var/log/vlserve-dockerd.log). Exit 1, saying why, when none can.
set -uo pipefail
docker info >/dev/null 2>&1 && exit 0
if ! command -v dockerd >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io) >/dev/null 2>&1
    fi
    command -v dockerd >/dev/null || { echo "docker: no dockerd on this machine and it could not be installed"; exit 1; }
fi
command -v docker >/dev/null || { echo "docker: no docker client on this machine"; exit 1; }
[ "$(id -u)" = 0 ] || { echo "docker: no daemon answers and starting dockerd needs root"; exit 1; }
nohup dockerd >/var/log/vlserve-dockerd.log 2>&1 &
for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && { echo "docker: started dockerd (pid $!)"; exit 0; }
    kill -0 $! 2>/dev/null || break
    sleep 1
done
echo "docker: dockerd did not start: $(tail -3 /var/log/vlserve-dockerd.log | tr '\n' ' ')"
exit 1
