"""Passes over jaxprs: a graph view, canonicalization, the pattern language, the rewriter, and one
`*_rules.py` file of patterns per op family (picked up automatically).

Invariants every pass keeps:
- a rewrite happens only where the program equals the pattern exactly (re-traced at the real shapes,
  dtypes and params); anything not understood is left exactly as it was;
- no pass edits a jaxpr in place: programs are rebuilt by re-tracing an interpreter, with source info;
- nothing here imports jax._src (see xkern/_compat.py) or jax_triton.
"""
