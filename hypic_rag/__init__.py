"""hypic-rag: position-independent caching for hybrid-attention LLMs."""

__version__ = "0.1.0"


def _map_source_kernels() -> None:
    """Running from a source checkout (`PYTHONPATH=<repo>`, nothing installed, or an editable install seen through
    another checkout): `hypic_rag.kernels` is the checkout's top-level `kernels/` folder, as setuptools' package-dir
    maps it in an install. An installed wheel has `hypic_rag/kernels/` itself and is left alone."""
    import importlib.util
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    source = here.parent / "kernels"
    if "hypic_rag.kernels" in sys.modules or (here / "kernels").is_dir() or not (source / "__init__.py").is_file():
        return
    spec = importlib.util.spec_from_file_location(
        "hypic_rag.kernels", source / "__init__.py", submodule_search_locations=[str(source)]
    )
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["hypic_rag.kernels"] = module
    spec.loader.exec_module(module)
    globals()["kernels"] = module


_map_source_kernels()
del _map_source_kernels
