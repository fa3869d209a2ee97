"""Stage 8 — serving an index on an existing engine (Qdrant): exporter.py (token store →
collection: multivector MaxSim + sparse IDF vectors), targets.py (embedded qdrant_edge shard or
a Qdrant server/cluster), sparse.py (BM25 / miniCOIL sparse vectors), querying.py (the Query
API: multivector, prefetch + RRF fusion, sparse rerank), publish_job.py (aligner-publish)."""
