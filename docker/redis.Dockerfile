# Redis for the feature store, from Debian's redis-server (no registry needed): LRU eviction under a memory cap, no
# persistence (the store is a cache: a restart starts empty and refills). Build: docker/build.sh. Run as user redis.
ARG BASE=python:3.11-slim
FROM ${BASE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
USER redis
EXPOSE 6379
ENV REDIS_MAXMEMORY=256mb
CMD ["sh", "-c", "exec redis-server --bind 0.0.0.0 --protected-mode no --maxmemory \"$REDIS_MAXMEMORY\" --maxmemory-policy allkeys-lru --save '' --appendonly no"]
