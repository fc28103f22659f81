"""vlserve: one installable system to serve vision-and-language transformers."""
__version__ = "0.1.0"
