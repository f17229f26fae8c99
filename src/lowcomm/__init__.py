"""lowcomm: data-parallel training over slow links."""

__version__ = "0.1.0"
