"""Calibration by measurement, what `hypic-rag calibrate` runs.

- `policy`: choosing a recompute policy (the candidates, the KL target, `calibrate`);
- `cache_format`: choosing the smallest cache format whose entries keep a model's answers;
- `index`: calibrating an index, both choices over its own requests, recorded in its manifest (`calibrate_index`).
"""
