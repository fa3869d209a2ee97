"""Stage 6 — lexical retrieval with meaning: miniCOIL (words.py, meaning.py, triplets.py, teacher.py, minicoil.py)."""
