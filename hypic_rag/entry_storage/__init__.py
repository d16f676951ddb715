"""How a segment entry's tensors are stored: cache formats (per tensor kind: a float cast, n-bit integer groups
or float8 groups, each group with its own scale) and their decoding.

A leaf of the package (it imports only `hypic_rag.entry.schema` and torch), because both sides use it: the cache
compresses an entry into its stored form before encoding it to bytes (`hypic_rag.cache.segment_cache`), and the
runtime decompresses a stored form once per hit on the device the entry is used on (`runtime.engine`).

- `quantize`: group quantization along the last dimension (the fast, vectorised path);
- `naive`: the same maths one value at a time (the reference the tests compare against);
- `formats`: `TensorCoding`, `CacheFormat`, the named `CACHE_FORMATS`, `compress_entry` / `decompress_entry`.
"""
