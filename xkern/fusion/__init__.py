"""Generated kernels: grouping of the equations no named pattern took, the lax -> Triton expression
table, and the code generator (one-block row template) with its on-disk source cache."""
