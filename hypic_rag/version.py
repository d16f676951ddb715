"""The package's version, a leaf module (what `hypic_rag.__version__`, the service and `hypic-rag --version` report)."""

__version__ = "0.1.0"
