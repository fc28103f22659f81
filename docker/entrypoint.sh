#!/bin/sh
# Serve the model set at /models (mounted, or built into the image with PROFILE) unless VLSERVE_MODEL_DIR /
# VLSERVE_DETECTOR_DIR say otherwise; with no model set there, `vlserve serve` builds the demo set into /cache.
if [ -f /models/encoder/config.json ] && [ -z "${VLSERVE_MODEL_DIR:-}" ]; then export VLSERVE_MODEL_DIR=/models/encoder; fi
if [ -f /models/detector/config.json ] && [ -z "${VLSERVE_DETECTOR_DIR:-}" ]; then export VLSERVE_DETECTOR_DIR=/models/detector; fi
exec "$@"
