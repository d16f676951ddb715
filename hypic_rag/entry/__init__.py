"""The segment entry and how its tensors are stored, shared by the runtime (which makes, decodes and composes
entries) and the cache (which stores them). A leaf of the package: its modules import only each other and torch.

- `schema`: the entry format itself (tensor names, kinds, seam tokens, sizes; docs/CONTRACTS.md);
- `compression`: cache formats (per tensor kind: a float cast, n-bit integer groups or float8 groups, each group with
  its own scale), `TensorCoding`, `CacheFormat`, the named `CACHE_FORMATS`, `compress_entry` / `decompress_entry`;
  the cache compresses an entry into its stored form before encoding it to bytes (`hypic_rag.cache.segment_cache`),
  the runtime decompresses a stored form once per hit on the device the entry is used on (`runtime.engine`);
- `quantize`: group quantization along the last dimension (the fast, vectorised path);
- `naive`: the same maths one value at a time (the reference the tests compare against).
"""
