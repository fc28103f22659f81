# The load balancer of the one-machine rehearsal (docker/deploy_test.py), from Debian's haproxy. Its configuration,
# docker/haproxy.cfg, is mounted at /etc/haproxy/haproxy.cfg when it runs (the image is built with no context).
ARG BASE=python:3.11-slim
FROM ${BASE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy \
 && rm -rf /var/lib/apt/lists/*
USER haproxy
EXPOSE 8080
CMD ["haproxy", "-W", "-db", "-f", "/etc/haproxy/haproxy.cfg"]
