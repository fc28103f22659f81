"""vlserve training: datasets, objectives, loops, metrics and analysis."""
