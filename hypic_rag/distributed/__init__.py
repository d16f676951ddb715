"""Beyond one machine: Ray for precompute and query-time segment parallelism, replicas routed by cache affinity.

Nothing here imports Ray at module import time except the modules that need it (`cluster.ray_module` is the one
gate), so `hypic-rag` without `--ray` never loads it. See docs/scale.md.

| module | concern |
| --- | --- |
| `cluster.py` | connect to a Ray cluster (`--ray [local|auto|ADDRESS]`), encoder slots, the missing-Ray error |
| `actors.py` | `EncoderActor`: one model per actor, encodes batches (precompute and query-time misses); with a remote tier, uploads its entries itself |
| `ray_encoder.py` | `RayEncoderPool`: LPT scheduling of encoding batches over actors (a `session.SegmentEncoder`, an `Engine.miss_encoder`); `RayMissEncoders` |
| `ray_ingest.py` | load, chunk and embed as Ray tasks, feeding the index's single writer in corpus order |
| `ray_scale_out.py` | `RayScaleOut`: the `PrecomputeConfig.scale_out` of `precompute --ray` |
| `rendezvous.py` | rendezvous (HRW) routing over retrieved chunk ids with in-flight load as tie-break (no Ray) |
| `asgi_bridge.py` | one HTTP request through an in-process ASGI app, streamed back in parts (no Ray) |
| `front.py` | the HTTP front of `serve --replicas N` and `--workers N`: retrieve, route, forward, aggregate stats (no Ray) |
| `local_workers.py` | `serve --workers N`: worker processes on this host behind the front, restarted when they die (no Ray) |
| `unix_http.py` | HTTP/1.1 to a local worker over its Unix socket: the front's relay for `--workers` (no Ray) |
| `serve_replicas.py` | the replicas as Ray Serve deployments, one per replica id |
| `serve_front.py` | running `serve --replicas N`: deploy the replicas, serve the front, shut both down |

The rest of the package never imports this one: precompute takes a `ScaleOut` and the service a
`MissEncoderFactory`, which the command line builds from here when `--ray`, `--replicas` or `--encode-actors`
ask for them.
"""
