"""vlserve service: FastAPI app, settings, feature store, batcher and runtimes (never imports training/)."""
